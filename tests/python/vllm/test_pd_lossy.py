"""Full-length lossy specs (q8, q4, think 0.5): every token kept, the cache quantized or its key
channels pruned, loaded dense into the decode instance. Teacher-forced against the single
instance over 32 tokens: top-1 agreement (the decode instance's greedy token equals the
reference's) and KL(reference || decode) of the next-token distributions (pdutil.kl_coarse over
the reference's top-20 tokens plus the rest)."""

import pytest

import pdutil
from kvc.vllm.proxy import cache_salt

POSITIONS = 32
# Floors well under what these specs measure here (docs/vllm.md), so a regression that breaks
# the load (wrong layout, wrong dequantization) fails while ordinary drift does not.
FLOORS = {"q8": (0.97, 0.01), "q4": (0.85, 0.1), "think:0.5": (0.6, 0.6)}


def _reference(stack, prompt, tag):
    cont = pdutil.token_ids(pdutil.completion(stack.decode.url, prompt, POSITIONS,
                                              cache_salt=tag))
    r = pdutil.completion(stack.decode.url, prompt + cont, 1, prompt_logprobs=20,
                          return_tokens_as_token_ids=True, cache_salt=tag)
    r.raise_for_status()
    plp = r.json()["choices"][0]["prompt_logprobs"][len(prompt):]
    ref = []
    for entry in plp:
        top = sorted(entry.items(), key=lambda kv: kv[1]["rank"])[:20]
        ref.append({int(str(t).split(":")[-1]): v["logprob"] for t, v in top})
    return cont, ref


def measure(stack, prompts, spec):
    agree, kls = [], []
    for n, prompt in enumerate(prompts):
        cont, ref = stack.references[n]
        params = pdutil.prefill(stack.prefill.url, prompt, spec)
        assert "error" not in params["kvc"], params
        assert params["kvc"]["mode"] == "full"
        salt = cache_salt(params["kvc"]["cache_id"])
        for i in range(POSITIONS):
            ids = sorted(ref[i])
            r = pdutil.completion(stack.decode.url, prompt + cont[:i], 1, logprobs=20,
                                  logprob_token_ids=ids, return_tokens_as_token_ids=True,
                                  kv_transfer_params=params, cache_salt=salt)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            test = pdutil.id_logprobs(choice["logprobs"]["top_logprobs"][0])
            agree.append(choice["token_ids"][0] == cont[i])
            kls.append(pdutil.kl_coarse(ref[i], test))
    return sum(agree) / len(agree), sum(kls) / len(kls), max(kls)


@pytest.fixture(scope="module")
def lossy_prompts(stack):
    tok = pdutil.tokenizer(stack.model_dir)
    prompts = pdutil.prompts(tok, 1, 600, 600, skip=14000)
    stack.references = [_reference(stack, p, f"lossy-ref-{i}") for i, p in enumerate(prompts)]
    return prompts


@pytest.mark.parametrize("spec", list(FLOORS))
def test_full_length_lossy(stack, lossy_prompts, spec):
    before = stack.decode.external_tokens()
    top1, kl, max_kl = measure(stack, lossy_prompts, spec)
    loaded = stack.decode.external_tokens() - before
    line = {"spec": spec, "prompts": len(lossy_prompts), "positions": POSITIONS, "top1": top1,
            "mean_kl": kl, "max_kl": max_kl, "external_tokens": loaded}
    pdutil.record("lossy", line)
    assert loaded >= sum(len(p) - 1 for p in lossy_prompts)  # the cache was really loaded
    floor_top1, ceil_kl = FLOORS[spec]
    assert top1 >= floor_top1 and kl <= ceil_kl, line
    assert stack.decode.wait_idle() == (0, 0, 0)

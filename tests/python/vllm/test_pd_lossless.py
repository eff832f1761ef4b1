"""Lossless: spec none through prefill -> kvcd -> decode gives one vLLM instance's greedy tokens,
and vLLM's own counter shows the decode instance loaded the prompts instead of computing them."""

import concurrent.futures

import requests

import pdutil

MAX_NEW = 8


def test_lossless_matches_single_instance(stack):
    tok = pdutil.tokenizer(stack.model_dir)
    prompts = pdutil.prompts(tok, 22, 24, 1000)
    before = stack.decode.external_tokens() or 0

    def via_proxy(i):
        kvc = {"spec": "none", "load": "sync" if i % 3 == 2 else "async"}
        r = requests.post(stack.proxy_url + "/v1/completions", json={
            "model": "m", "prompt": prompts[i], "max_tokens": MAX_NEW, "temperature": 0,
            "return_token_ids": True, "kv_transfer_params": {"kvc": kvc}}, timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvc-mode"] == "full"
        assert int(r.headers["x-kvc-loaded-tokens"]) == len(prompts[i]) - 1
        return r.json()["choices"][0]["token_ids"]

    def single(i):  # the decode instance alone; its own salt keeps the loaded blocks out
        return pdutil.token_ids(pdutil.completion(stack.decode.url, prompts[i], MAX_NEW,
                                                  cache_salt=f"reference-{i}"))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pd = list(pool.map(via_proxy, range(len(prompts))))
        ref = list(pool.map(single, range(len(prompts))))
    mismatches = [(i, len(prompts[i]), a, b) for i, (a, b) in enumerate(zip(pd, ref)) if a != b]
    loaded = stack.decode.external_tokens() - before
    lengths = [len(p) for p in prompts]
    pdutil.record("lossless", {
        "prompts": len(prompts), "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths), "generated_per_prompt": MAX_NEW,
        "prompts_same_tokens": len(prompts) - len(mismatches),
        "external_tokens_loaded": loaded, "prompt_tokens_to_load": sum(lengths) - len(prompts)})
    assert not mismatches, mismatches
    assert loaded == sum(len(p) - 1 for p in prompts), loaded
    assert stack.decode.wait_idle() == (0, 0, 0)
    assert stack.prefill.wait_idle() == (0, 0, 0)

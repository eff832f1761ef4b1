"""Request helpers shared by the vLLM tests and the benchmark."""

import json
import math
import os

import requests

TEXT_FILES = ("Apache-2.0", "GPL-2", "MPL-2.0", "GFDL-1.3", "LGPL-2.1", "Artistic", "MPL-1.1",
              "CC0-1.0", "BSD")
_FALLBACK = ("The quick brown fox jumps over the lazy dog while the committee debates the "
             "minutes of its previous meeting, which nobody has read. ")


def corpus():
    out = []
    for name in TEXT_FILES:
        path = os.path.join("/usr/share/common-licenses", name)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                out.append(" ".join(f.read().split()))
    return out or [_FALLBACK * 400]


def prompts(tokenizer, count, min_tokens, max_tokens, skip=0):
    """`count` prompts (token id lists) of lengths spread over [min_tokens, max_tokens]:
    consecutive, non-overlapping windows of the corpus (after its first `skip` tokens), so no
    two prompts share a prefix."""
    stream = []
    for t in corpus():
        stream.extend(tokenizer(t).input_ids)
    lengths = [min_tokens + (max_tokens - min_tokens) * i // max(1, count - 1)
               for i in range(count)]
    while len(stream) < skip + sum(lengths):
        stream = stream + stream[len(stream) // 3:]
    out, at = [], skip
    for n in lengths:
        out.append(stream[at:at + n])
        at += n
    return out


def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def prefill(url, prompt, spec, timeout=300, **extra):
    """The prefill instance's kv_transfer_params for `prompt` (token ids or text)."""
    r = requests.post(url + "/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "kvc": {"spec": spec}}, **extra},
        timeout=timeout)
    r.raise_for_status()
    return r.json()["kv_transfer_params"]


def completion(url, prompt, max_tokens, timeout=300, **extra):
    """POST /v1/completions greedily; returns the Response."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    return requests.post(url + "/v1/completions", json=body, timeout=timeout)


def token_ids(resp):
    resp.raise_for_status()
    return resp.json()["choices"][0]["token_ids"]


def id_logprobs(entry):
    """{token_id: logprob} of a top_logprobs entry (requested with return_tokens_as_token_ids)."""
    return {int(k.split(":", 1)[1]): v for k, v in entry.items()}


def kl_coarse(ref, test):
    """KL(ref || test) in nats over ref's listed tokens plus one bucket for the rest: the exact
    KL of both distributions coarsened to that partition (a lower bound of the full KL)."""
    kl, pr, pt = 0.0, 0.0, 0.0
    for tok, lp in ref.items():
        p, q = math.exp(lp), math.exp(test[tok])
        kl += p * (lp - test[tok])
        pr, pt = pr + p, pt + q
    rest_p, rest_q = max(0.0, 1.0 - pr), max(1e-30, 1.0 - pt)
    if rest_p > 0:
        kl += rest_p * math.log(max(rest_p, 1e-30) / rest_q)
    return max(0.0, kl)


def record(kind, line):
    """Prints a measured line and appends it to $KVC_VLLM_RESULTS (JSON lines) when set: ctest
    sets it to vllm_pd_results.jsonl in its build folder, which run.py empties at the start."""
    print(kind, json.dumps(line))
    path = os.environ.get("KVC_VLLM_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": kind, **line}) + "\n")

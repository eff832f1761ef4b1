"""Faults: bad kv_transfer_params, a decode instance serving another model, kvcd down at save
time, kvcd restarted between save and load, a load cut mid-stream, a cache deleted mid-load, a
client giving up during a load. Never a wrong token: the 'fail' instance (decode) answers an
error, the 'recompute' instance (prefill, used as a decode instance here) answers the single
instance's tokens without loading; never a hang; no request or KV block left behind."""

import concurrent.futures
import copy
import time

import pytest
import requests

import pdutil
from kvc.vllm.proxy import cache_salt

MAX_NEW = 8


@pytest.fixture(scope="module")
def case(stack):
    tok = pdutil.tokenizer(stack.model_dir)
    prompt = pdutil.prompts(tok, 1, 700, 700, skip=26000)[0]
    ref = pdutil.token_ids(pdutil.completion(stack.decode.url, prompt, MAX_NEW,
                                             cache_salt="faults-ref"))
    return prompt, ref


def decode(server, prompt, params, salt=None, timeout=120):
    extra = {"kv_transfer_params": params}
    if salt:
        extra["cache_salt"] = salt
    return pdutil.completion(server.url, prompt, MAX_NEW, timeout=timeout, **extra)


def idle(stack):
    for s in (stack.prefill, stack.decode, stack.other):
        assert s.wait_idle() == (0, 0, 0), s.name


def expect_fail_and_recompute(stack, prompt, ref, params, salt=None):
    """The fail instance answers an error; the recompute instance the right tokens, unloaded."""
    r = decode(stack.decode, prompt, params, salt)
    assert r.status_code == 500, r.text
    before = stack.prefill.external_tokens() or 0
    r = decode(stack.prefill, prompt, params, salt)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == ref
    assert (stack.prefill.external_tokens() or 0) == before
    idle(stack)


def good_params(stack, prompt, spec="none"):
    params = pdutil.prefill(stack.prefill.url, prompt, spec)
    assert "error" not in params["kvc"], params
    return params


def wait_kvcd_usable(stack, prompt):
    """After a kvcd restart: until a prefill stores again (gRPC reconnects)."""
    deadline = time.monotonic() + 60
    while True:
        params = pdutil.prefill(stack.prefill.url, prompt, "none")
        if "error" not in params["kvc"]:
            return params
        assert time.monotonic() < deadline, params
        time.sleep(0.5)


def test_bad_params(stack, case):
    prompt, ref = case
    good = good_params(stack, prompt)
    lossy = good_params(stack, prompt, "q4")
    variants = []
    for mutate in (lambda p: p["kvc"].update(v=99),
                   lambda p: p["kvc"].update(cache_id="no spaces allowed"),
                   lambda p: p["kvc"].update(prompt_hash="0" * 32),
                   lambda p: p["kvc"].update(seq_len="many"),
                   lambda p: p["kvc"].update(kept_tokens=10 ** 9),
                   lambda p: p["kvc"].update(cache_id="vllm/never-stored"),
                   lambda p: p.update(kvc=["not", "an", "object"])):
        p = copy.deepcopy(good)
        mutate(p)
        variants.append((p, None))
    variants.append((lossy, None))  # a lossy cache without its cache_salt
    other_prompt = list(prompt)
    other_prompt[5] = (other_prompt[5] + 1) % 1000
    for params, salt in variants:
        expect_fail_and_recompute(stack, prompt, ref, params, salt)
    # The right cache under another prompt: refused by the prompt hash.
    r = decode(stack.decode, other_prompt, good)
    assert r.status_code == 500
    idle(stack)


def test_evicted_on_a_recompute_instance_is_held_not_recomputed(stack, case):
    prompt, _ = case
    params = good_params(stack, prompt, "keydiff:0.5")
    k = params["kvc"]["kept_tokens"]
    ids = [0] * k + [params["kvc"]["last_token"]]
    params["kvc"]["placeholder"] = 0
    salt = cache_salt(params["kvc"]["cache_id"])
    with pytest.raises(requests.Timeout):  # held (no token from placeholders), until we leave
        pdutil.completion(stack.prefill.url, ids, MAX_NEW, timeout=8, cache_salt=salt,
                          kv_transfer_params=params)
    idle(stack)
    r = decode(stack.decode, ids, params, salt)  # the fail instance serves it
    assert r.status_code == 200, r.text


def test_other_model_refused_by_fingerprint(stack, case):
    prompt, _ = case
    params = good_params(stack, prompt)
    r = decode(stack.other, prompt, params)
    assert r.status_code == 500
    assert "the cache was made by model" in stack.other.proc.output(200000)
    idle(stack)


def test_kvcd_down_at_save_time(stack, case):
    prompt, ref = case
    stack.kvcd.stop()
    try:
        params = pdutil.prefill(stack.prefill.url, prompt, "none")  # prefill still answers
        assert "error" in params["kvc"] and params["do_remote_prefill"], params
        expect_fail_and_recompute(stack, prompt, ref, params)
        r = requests.post(stack.proxy_url + "/v1/completions", json={
            "model": "m", "prompt": prompt, "max_tokens": MAX_NEW}, timeout=120)
        assert r.status_code == 502
        msg = r.json()["error"]["message"]
        assert "decode instance" in msg and "kvcd" in msg, msg
        assert requests.get(stack.proxy_url + "/health", timeout=30).status_code == 503
    finally:
        stack.kvcd.start()
    wait_kvcd_usable(stack, prompt)
    idle(stack)


def test_kvcd_restarted_between_save_and_load(stack, case):
    prompt, ref = case
    params = good_params(stack, prompt)
    stack.kvcd.stop()
    stack.kvcd.start()
    expect_fail_and_recompute(stack, prompt, ref, params)
    wait_kvcd_usable(stack, prompt)


@pytest.mark.parametrize("load", ["async", "sync"])
def test_load_cut_mid_stream(stack, case, load):
    prompt, ref = case
    params = good_params(stack, prompt)
    params["kvc"]["load"] = load
    stack.relay_d.cut_after(3 << 20)  # of a ~26 MB load
    r = decode(stack.decode, prompt, params)
    assert r.status_code == 500, r.text
    assert stack.relay_d.cuts >= 1
    stack.relay_p.cut_after(3 << 20)
    before = stack.prefill.external_tokens() or 0
    r = decode(stack.prefill, prompt, params)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref, r.text
    if load == "async":  # (vLLM counts a failed synchronous load's tokens as external anyway)
        assert (stack.prefill.external_tokens() or 0) == before  # recomputed, not loaded
    idle(stack)
    # Afterwards loads work again through the same relay.
    r = decode(stack.decode, prompt, good_params(stack, prompt))
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == ref


def test_cache_deleted_mid_load_and_client_gone(stack, case):
    prompt, ref = case
    client = stack.client()
    params = good_params(stack, prompt)
    stack.relay_d.throttle(4 << 20)  # ~8 s for the whole cache
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            down0 = stack.relay_d.down_bytes
            fut = pool.submit(decode, stack.decode, prompt, params)
            deadline = time.monotonic() + 60
            while stack.relay_d.down_bytes < down0 + (1 << 20):
                assert time.monotonic() < deadline and not fut.done()
                time.sleep(0.05)
            client.delete(params["kvc"]["cache_id"])
            r = fut.result(timeout=120)
        # kvcd keeps serving a stream it started, or the load fails: never a wrong token.
        assert r.status_code in (200, 500), r.text
        if r.status_code == 200:
            assert r.json()["choices"][0]["token_ids"] == ref
        # A client that gives up during a load: the request is aborted and its blocks freed.
        params = good_params(stack, prompt)
        with pytest.raises(requests.Timeout):
            decode(stack.decode, prompt, params, timeout=3)
    finally:
        stack.relay_d.throttle(None)
    idle(stack)

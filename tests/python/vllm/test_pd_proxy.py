"""kvc-pd-proxy: both OpenAI endpoints, streamed and not, full-length and evicted; what it refuses;
health, metrics and a clear error when an instance is down."""

import json
import sys

import requests

import harness
import pdutil

PROMPT = ("Write one sentence about the sea. The sea is wide and deep, and ships sail on it from "
          "one harbour to the next while the gulls follow them. ") * 6


def post(url, path, body, stream=False, timeout=300):
    return requests.post(url + path, json={"model": "m", **body}, stream=stream,
                         timeout=timeout)


def sse_text(r, key):
    """Concatenated text of an SSE stream and its last usage object."""
    out, usage = "", None
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            usage = ev["usage"]
        for ch in ev.get("choices", []):
            out += (ch.get("text") if key == "text" else ch.get("delta", {}).get("content")) or ""
    return out, usage


def test_completions_streamed_and_not(stack):
    for spec in ("none", "keydiff:0.5"):
        body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                "kv_transfer_params": {"kvc": {"spec": spec}}}
        plain = post(stack.proxy_url, "/v1/completions", body)
        assert plain.status_code == 200, plain.text
        assert "kv_transfer_params" not in plain.json()
        r = post(stack.proxy_url, "/v1/completions",
                 {**body, "stream": True, "stream_options": {"include_usage": True}}, True)
        assert r.status_code == 200
        assert r.headers["x-kvc-mode"] == ("full" if spec == "none" else "evicted")
        text, usage = sse_text(r, "text")
        assert text == plain.json()["choices"][0]["text"]
        assert usage["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
    single = pdutil.completion(stack.decode.url, PROMPT, 10, cache_salt="proxy-ref").json()
    assert plain.json()["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]


def test_chat_streamed_and_not(stack):
    messages = [{"role": "user", "content": "What is the capital of France? " * 20}]
    ref = post(stack.decode.url, "/v1/chat/completions",
               {"messages": messages, "max_tokens": 10, "temperature": 0,
                "cache_salt": "chat-ref"}).json()["choices"][0]["message"]["content"]
    for spec in ("none", "keydiff:0.5"):
        body = {"messages": messages, "max_tokens": 10, "temperature": 0,
                "kv_transfer_params": {"kvc": {"spec": spec}}}
        r = post(stack.proxy_url, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        content = r.json()["choices"][0]["message"]["content"]
        if spec == "none":
            assert content == ref
        s = post(stack.proxy_url, "/v1/chat/completions", {**body, "stream": True}, True)
        assert s.status_code == 200
        assert sse_text(s, "content")[0] == content


def test_refusals(stack):
    r = post(stack.proxy_url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "repetition_penalty": 1.2,
        "kv_transfer_params": {"kvc": {"spec": "keydiff:0.5"}}})
    assert r.status_code == 400 and "repetition_penalty" in r.json()["error"]["message"]
    r = post(stack.proxy_url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "repetition_penalty": 1.2,
        "kv_transfer_params": {"kvc": {"spec": "q8"}}})
    assert r.status_code == 200  # full length: the decode instance sees the real prompt
    r = post(stack.proxy_url, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": {"kvc": {"spec": "snapkv:0.5"}}})
    assert r.status_code == 400 and "Q_obs" in r.json()["error"]["message"]
    r = requests.post(stack.proxy_url + "/v1/completions", data=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_health_metrics_models(stack):
    h = requests.get(stack.proxy_url + "/health", timeout=30)
    assert h.status_code == 200 and h.json()["status"] == "ok", h.text
    assert any(k.startswith("kvcd") for k in h.json()["checks"])
    m = requests.get(stack.proxy_url + "/metrics", timeout=30).text
    assert harness.metric(m, "kvc_proxy_requests_total", 'outcome="ok"') > 0
    assert harness.metric(m, "kvc_proxy_stored_bytes_total") > 0
    assert requests.get(stack.proxy_url + "/v1/models", timeout=30).json()["data"][0]["id"] == "m"


def test_instance_down(stack):
    port = harness.free_port()
    dead = f"http://127.0.0.1:{harness.free_port()}"
    p = harness.Proc("proxy-dead", [sys.executable, "-m", "kvc.vllm.proxy", "--prefill", dead,
                                    "--decode", stack.decode.url, "--port", str(port),
                                    "--connect-timeout", "2"], stack.dir)
    try:
        url = f"http://127.0.0.1:{port}"
        import time
        deadline = time.monotonic() + 60
        while True:
            try:
                h = requests.get(url + "/health", timeout=10)
                break
            except requests.RequestException:
                assert time.monotonic() < deadline and p.alive(), p.output()
                time.sleep(0.2)
        assert h.status_code == 503 and "unreachable" in h.json()["checks"][f"prefill {dead}"]
        r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})
        assert r.status_code == 503
        assert f"prefill instance {dead}" in r.json()["error"]["message"]
    finally:
        p.stop()

"""The prefill/decode demo behind deploy/pd-demo.sh (see there). Run with the project venv's
Python from the repository root; KVCD_PATH names the kvcd binary."""

import argparse
import json
import os
import sys
import tempfile
import time

import requests

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "python", "vllm"))

import harness  # noqa: E402  (process helpers shared with the tests)

PROMPTS = [
    ("chat", [{"role": "user", "content": "In two sentences: why do ships float?"}]),
    ("passage", "Summary of the licence below in one sentence.\n\n" + " ".join(
        open("/usr/share/common-licenses/Apache-2.0").read().split()[:700])
     if os.path.exists("/usr/share/common-licenses/Apache-2.0") else
     "Once upon a time " * 200),
    ("pass key", "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 10 +
     "The pass key is 71432. Remember it. " +
     "The grass is green. The sky is blue. The sun is yellow. Here we go. " * 10 +
     "What is the pass key? The pass key is"),
]


def stream(url, path, body):
    """(text, ttft seconds, tokens/s after the first token, response headers)."""
    t0 = time.perf_counter()
    r = requests.post(url + path, json={"model": "m", "stream": True, "temperature": 0,
                                        "stream_options": {"include_usage": True}, **body},
                      stream=True, timeout=600)
    if r.status_code != 200:
        return f"<HTTP {r.status_code}: {r.text[:200]}>", None, None, r.headers
    text, first, n, last = "", None, 0, None
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if ev.get("usage"):
            n = ev["usage"].get("completion_tokens", n)
        for ch in ev.get("choices", []):
            piece = ch.get("text") if "text" in ch else ch.get("delta", {}).get("content")
            if piece:
                now = time.perf_counter()
                first = first or now
                last = now
                text += piece
    ttft = (first - t0) if first else None
    rate = (n - 1) / (last - first) if first and last and last > first and n > 1 else None
    return text, ttft, rate, r.headers


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", default="none,q4,think:0.5,keydiff:0.5,expected:0.5")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--keep", action="store_true", help="leave the logs directory")
    args = ap.parse_args()
    from kvc.models import smollm2
    model = str(smollm2.ensure())
    work = tempfile.mkdtemp(prefix="kvc_pd_demo_")
    procs, kvcd = [], None
    try:
        print(f"pd-demo: logs in {work}", flush=True)
        kvcd = harness.Kvcd(os.environ["KVCD_PATH"], work, None, store="2GiB").start()
        from kvc.vllm import qstats
        import numpy as np
        stats = os.path.join(work, "qstats.npz")
        calib = "/usr/share/common-licenses/GPL-3"
        text = open(calib).read() if os.path.exists(calib) else PROMPTS[1][1]
        q, sq, meta = qstats.measure(model, [text], max_tokens=1024)
        with open(stats, "wb") as f:
            np.savez(f, q_stats=q, q_sq=sq, meta=np.array(json.dumps(meta)))
        extra = {"target": kvcd.address, "query_stats": stats}
        c = harness.cores()
        pre = harness.Vllm("prefill", model, c[0], work, harness.connector_config(
            "kv_producer", "fail", extra))
        dec = harness.Vllm("decode", model, c[1 % len(c)], work, harness.connector_config(
            "kv_consumer", "fail", extra))
        procs += [pre, dec]
        print("pd-demo: starting kvcd, prefill (core %d) and decode (core %d) vLLM instances "
              "(about a minute)..." % (c[0], c[1 % len(c)]), flush=True)
        for p in (pre, dec):
            p.wait_ready()
        port = harness.free_port()
        proxy = harness.Proc("proxy", [sys.executable, "-m", "kvc.vllm.proxy", "--prefill",
                                       pre.url, "--decode", dec.url, "--port", str(port),
                                       "--kvcd", kvcd.address], work)
        procs.append(proxy)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("kvc-pd-proxy did not come up:\n" + proxy.output())
            time.sleep(0.3)
        print(f"pd-demo: kvc-pd-proxy on {url}\n", flush=True)
        for i, (name, prompt) in enumerate(PROMPTS):
            path = "/v1/chat/completions" if isinstance(prompt, list) else "/v1/completions"
            key = "messages" if isinstance(prompt, list) else "prompt"
            ref, ttft, rate, _ = stream(dec.url, path, {key: prompt, "max_tokens":
                                                        args.max_tokens,
                                                        "cache_salt": f"demo-single-{i}"})
            print(f"=== {name}: single instance (decode alone): TTFT {ttft:.2f} s, "
                  f"{rate or 0:.1f} tok/s\n    {ref!r}")
            for spec in args.specs.split(","):
                served = kvcd.served_bytes() or 0
                text, ttft, rate, h = stream(url, path, {
                    key: prompt, "max_tokens": args.max_tokens,
                    "kv_transfer_params": {"kvc": {"spec": spec}}})
                fetched = (kvcd.served_bytes() or 0) - served
                seq = int(h.get("x-kvc-seq-len", 0))
                print(f"--- {spec:14s} {h.get('x-kvc-mode', '?'):7s} kept "
                      f"{h.get('x-kvc-kept-tokens', '?')}/{seq} tokens, stored "
                      f"{int(h.get('x-kvc-stored-bytes', 0)) / 1e6:.2f} MB of "
                      f"{int(h.get('x-kvc-input-bytes', 0)) / 1e6:.2f} MB, fetched "
                      f"{fetched / 1e6:.2f} MB, TTFT {ttft or float('nan'):.2f} s, "
                      f"{rate or 0:.1f} tok/s, same as single: {text == ref}\n    {text!r}",
                      flush=True)
            print()
    finally:
        for p in reversed(procs):
            p.stop()
        if kvcd is not None:
            kvcd.stop()
        if not args.keep:
            import shutil
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""kvc inside vLLM, measured (docs/vllm.md has the numbers and the command):

  ttft        the decode instance's time to first token for a prompt loaded from kvcd vs
              recomputed from scratch, at 1K and 4K prompt tokens, per spec; bytes kvcd stored
              and the decode instance fetched per request
  throughput  the connector's save path (gather from vLLM's paged blocks + the layer-fed PutCache
              stream) and load path (GetCache + expansion + vLLM's cache update into the blocks)
              against the Python client's plain put/get of the same bytes, in the same run

    KVCD_PATH=build/service/kvcd .venv/bin/python tests/bench/vllm_pd_bench.py \\
        [--lengths 1024,4096] [--repeat 3] [--specs none,q8,...] [--skip-ttft] [--json out.json]

Starts its own kvcd (plaintext, loopback), a prefill and a decode instance (one core each) and
stops them at the end. TTFT is the latency of a non-streamed max_tokens=1 request to the decode
instance (its load or recompute, the last token, sampling, HTTP): the median of --repeat runs,
each on a fresh cache (recompute: a fresh cache_salt, so vLLM's prefix cache never helps).
"""

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python", "vllm"))

import harness  # noqa: E402
import pdutil  # noqa: E402

SPECS = ["none", "q8", "q4", "think:0.5", "keydiff:0.5", "expected:0.5", "keydiff:0.25",
         "expected:0.25"]


def ttft(stack, lengths, specs, repeat):
    tok = pdutil.tokenizer(stack["model"])
    rows = []
    skip = 0
    for n in lengths:
        prompts = pdutil.prompts(tok, repeat * (len(specs) + 1), n, n, skip=skip)
        skip += len(prompts) * n
        it = iter(prompts)
        rec = []
        for r in range(repeat):
            p = next(it)
            t = time.perf_counter()
            resp = pdutil.completion(stack["decode"].url, p, 1, cache_salt=f"bench-{n}-{r}")
            resp.raise_for_status()
            rec.append(time.perf_counter() - t)
        rows.append({"tokens": n, "spec": "recompute", "ttft_s": statistics.median(rec)})
        print(f"{n:5d} recompute        TTFT {rows[-1]['ttft_s']:.3f} s", flush=True)
        for spec in specs:
            times, stored, fetched, pre = [], [], [], []
            for r in range(repeat):
                p = next(it)
                t = time.perf_counter()
                params = pdutil.prefill(stack["prefill"].url, p, spec)
                pre.append(time.perf_counter() - t)
                kvc = params["kvc"]
                assert "error" not in kvc, kvc
                extra = {"kv_transfer_params": params}
                if kvc["spec"] != "none":
                    from kvc.vllm.proxy import cache_salt
                    extra["cache_salt"] = cache_salt(kvc["cache_id"])
                if kvc["mode"] == "evicted":
                    kvc["placeholder"] = 0
                    p = [0] * kvc["kept_tokens"] + [kvc["last_token"]]
                t = time.perf_counter()
                resp = pdutil.completion(stack["decode"].url, p, 1, **extra)
                resp.raise_for_status()
                times.append(time.perf_counter() - t)
                d = resp.json().get("kv_transfer_params", {}).get("kvc_decode", {})
                assert d.get("loaded_tokens", 0) > 0 and "error" not in d, d
                stored.append(kvc["stored_bytes"])
                fetched.append(d["fetched_bytes"])
            row = {"tokens": n, "spec": spec, "ttft_s": statistics.median(times),
                   "prefill_s": statistics.median(pre), "kept_tokens": kvc["kept_tokens"],
                   "input_bytes": kvc["input_bytes"], "stored_bytes": statistics.median(stored),
                   "fetched_bytes": statistics.median(fetched)}
            rows.append(row)
            print(f"{n:5d} {spec:15s}  TTFT {row['ttft_s']:.3f} s  prefill {row['prefill_s']:.3f} s"
                  f"  kept {row['kept_tokens']}  stored {row['stored_bytes'] / 1e6:.2f} MB  "
                  f"fetched {row['fetched_bytes'] / 1e6:.2f} MB  (uncompressed "
                  f"{row['input_bytes'] / 1e6:.2f} MB)", flush=True)
    return rows


def throughput(kvcd, tokens, repeat, specs=("none", "q4", "l2:0.5", "keydiff:0.5")):
    """The connector's worker code on real vLLM CPU-backend caches vs kvc.Client put/get."""
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.cpu_attn import (CPUAttentionBackend,
                                                     CPUAttentionBackendImpl, _get_attn_isa)
    from kvc.vllm.config import ConnectorConfig
    from kvc.vllm.jobs import KvcConnectorMetadata, LoadJob, SaveJob
    from kvc.vllm.layout import PagedLayout, slots_for
    from kvc.vllm.spec import parse_spec
    from kvc.vllm.transfer import Replicas
    from kvc.vllm.worker import WorkerSide, _Load

    torch.set_num_threads(1)
    L, H, D, BS, HQ = 30, 3, 64, 128, 9
    blocks = (tokens + BS - 1) // BS
    vcfg = VllmConfig()
    vcfg.model_config = types.SimpleNamespace(dtype=torch.float32)
    with set_current_vllm_config(vcfg):
        impl = CPUAttentionBackendImpl(HQ, D, D ** -0.5, H, None, None, "auto")
    layer = types.SimpleNamespace(impl=impl, attn_backend=CPUAttentionBackend,
                                  isa=_get_attn_isa(torch.float32, BS, D, "auto"),
                                  _k_scale_float=1.0, _v_scale_float=1.0)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    kv = {n: torch.zeros(blocks + 2, H, BS, 2 * D) for n in names}
    lay = PagedLayout(layer, kv[names[0]], H, D)
    block_ids = list(range(2, blocks + 2))[::-1]  # not in order, as vLLM hands them out
    slots = slots_for(block_ids, BS, 0, tokens)
    g = torch.Generator().manual_seed(0)
    plain = []
    for n in names:
        k = torch.randn(tokens, H, D, generator=g)
        v = torch.randn(tokens, H, D, generator=g)
        impl.do_kv_cache_update(layer, k, v, kv[n], slots)
        plain.append((k, v))
    cfg = ConnectorConfig({"target": kvcd.address}, "fail")
    replicas = Replicas(kvcd.address, cfg.client_options)
    rope = {"theta": 100000.0, "style": "ROPE_HALF_SPLIT"}  # SmolLM2's, for evicted loads
    model = types.SimpleNamespace(num_layers=L, num_kv_heads=H, num_q_heads=HQ, head_dim=D,
                                  layer_names=names, rope=rope, rope_error=None)
    ws = WorkerSide(cfg, model, replicas, None, types.SimpleNamespace(
        cache_config=types.SimpleNamespace(block_size=BS)))
    ws.kv, ws.names, ws.dtype = kv, names, torch.float32
    ws.index = {n: i for i, n in enumerate(names)}
    ws.layouts = {n: lay for n in names}
    client = kvcd.client()
    nbytes = 2 * L * tokens * H * D * 4
    out = []
    for spec in specs:
        config = parse_spec(spec).config
        t_conn_save, t_raw_put, t_conn_load, t_raw_get = [], [], [], []
        for r in range(repeat):
            cid = f"bench/{spec}/{tokens}/{r}"
            job = SaveJob("req", cid + "/c", kvcd.address, config, tokens, 0, tokens,
                          block_ids, True, True)
            meta = KvcConnectorMetadata(saves=[job])
            t = time.perf_counter()
            for n in names:
                ws.save_kv_layer(meta, n, kv[n])
            ws.wait_for_save(meta)
            t_conn_save.append(time.perf_counter() - t)
            assert client.stat(cid + "/c").shape.seq_len == tokens
            t = time.perf_counter()
            client.put(cid + "/r", plain, layout="NHD", compression=config)
            t_raw_put.append(time.perf_counter() - t)
            # Lossless caches load DENSE, full-length lossy ones PACKED, evicted ones as the
            # contiguous export (keys re-rotated by kvcd), as the connector fetches them.
            kept = client.stat(cid + "/c").kept_tokens[0]
            evicted = kept < tokens
            fmt = "contiguous" if evicted else "dense" if spec == "none" else "packed"
            lj = LoadJob("req", cid + "/c", kvcd.address, "evicted" if evicted else "full",
                         tokens, kept, 0, kept, block_ids, False, fmt)
            run = _Load(lj, L, time.monotonic() + 600)
            t = time.perf_counter()
            ws._load(run)
            t_conn_load.append(time.perf_counter() - t)
            assert run.error is None, run.error
            t = time.perf_counter()
            client.get(cid + "/r", format=fmt, tensors="torch",
                       **({"rope": rope} if evicted else {}))
            t_raw_get.append(time.perf_counter() - t)
            client.delete(cid + "/c")
            client.delete(cid + "/r")
        row = {"spec": spec, "tokens": tokens, "uncompressed_bytes": nbytes,
               "connector_save_s": statistics.median(t_conn_save),
               "client_put_s": statistics.median(t_raw_put),
               "connector_load_s": statistics.median(t_conn_load),
               "client_get_s": statistics.median(t_raw_get)}
        row["save_ratio"] = row["client_put_s"] / row["connector_save_s"]
        row["load_ratio"] = row["client_get_s"] / row["connector_load_s"]
        out.append(row)
        print(f"throughput {spec:5s} {tokens} tokens ({nbytes / 1e6:.1f} MB): connector save "
              f"{nbytes / row['connector_save_s'] / 1e6:.0f} MB/s vs client put "
              f"{nbytes / row['client_put_s'] / 1e6:.0f} MB/s = {row['save_ratio']:.2f}x; "
              f"connector load {nbytes / row['connector_load_s'] / 1e6:.0f} MB/s vs client get "
              f"{nbytes / row['client_get_s'] / 1e6:.0f} MB/s = {row['load_ratio']:.2f}x",
              flush=True)
    ws.shutdown()
    replicas.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1024,4096")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--specs", default=",".join(SPECS))
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--throughput-tokens", type=int, default=2048)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    from kvc.models import smollm2
    model = smollm2.default_dir()
    work = tempfile.mkdtemp(prefix="kvc_vllm_bench_")
    kvcd = harness.Kvcd(os.environ["KVCD_PATH"], work, None, store="8GiB").start()
    procs = []
    result = {"machine": os.uname().nodename, "cores": harness.cores()}
    try:
        result["throughput"] = throughput(kvcd, args.throughput_tokens, args.repeat)
        if not args.skip_ttft:
            from kvc.vllm import qstats
            import numpy as np
            stats = os.path.join(work, "qstats.npz")
            with open("/usr/share/common-licenses/GPL-3") as f:
                q, sq, meta = qstats.measure(model, [f.read()], max_tokens=1024)
            with open(stats, "wb") as f:
                np.savez(f, q_stats=q, q_sq=sq, meta=np.array(json.dumps(meta)))
            c = harness.cores()
            extra = ("--max-model-len", "8192")
            pre = harness.Vllm("prefill", model, c[0], work, harness.connector_config(
                "kv_producer", "fail", {"target": kvcd.address, "query_stats": stats}),
                extra_args=extra, cache_gib=2)
            dec = harness.Vllm("decode", model, c[1 % len(c)], work, harness.connector_config(
                "kv_consumer", "fail", {"target": kvcd.address, "query_stats": stats}),
                extra_args=extra, cache_gib=2)
            procs = [pre, dec]
            for p in procs:
                p.wait_ready()
            lengths = [int(x) for x in args.lengths.split(",")]
            result["ttft"] = ttft({"prefill": pre, "decode": dec, "model": model}, lengths,
                                  args.specs.split(","), args.repeat)
    finally:
        for p in procs:
            p.stop()
        kvcd.stop()
        if os.environ.get("KVC_KEEP_TEST_DIR") is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"logs kept in {work}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

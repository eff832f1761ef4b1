"""kvc side by side with NVIDIA's kvpress on a real model: one command, one run, one CSV.

    python -m kvc.bench.sidebyside --out DIR [--tasks passkey:100,multikey:100,...]
        [--ratios 0.5,0.25,0.1] [--max-minutes M]

Every row (kvpress presses, kvc specs through a real kvcd, Python prototypes, the full cache)
compresses the same documents from one prefill each (model.py explains why that is exactly what
kvpress's pipeline does), in two scenarios: `after` (the context alone is compressed, the
question is decoded on the compressed cache: kvpress's default and the serving case) and
`inside` (everything but the prompt's last token is compressed). Continuation documents have one
scenario, `prefix`. Writes DIR/results.csv (one line per document, scenario and row),
DIR/summary.csv, DIR/table.md, DIR/plot.png and DIR/run.json (configuration, versions, timing).
docs/fidelity-smollm2.md has the protocol and the measured table.
"""

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import time

import torch

from . import kvcrows, model as M, presses as P, recon as R, reference, report, tasks
from .rows import (KVC_BYTES_DEFAULT, KVC_DEFAULT, KVPRESS_DEFAULT, PROTO_DEFAULT, expand,
                   split_list)

TASKS = ("passkey", "multikey", "multivalue", "multiquery", "vartrack", "kvlist", "qa",
         "continuation")


def task_counts(spec):
    """[(task, documents)] of a --tasks value "TASK:N,..." (N defaults to 100)."""
    out = []
    for item in str(spec).split(","):
        name, _, n = item.partition(":")
        out.append((name, int(n or 100)))
    return out


def cpu_info():
    """The CPU a segment ran on. The rows run in bf16, whose CPU matrix kernels differ by
    instruction set (AMX, AVX-512 BF16, AVX2): a run repeats exactly on one machine, while on
    another a few near-tie selections, and so a few answers, may differ."""
    model, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                    break
    except OSError:
        pass
    return {"model": model, "torch": torch.backends.cpu.get_cpu_capability(),
            "amx_bf16": "amx_bf16" in flags, "avx512_bf16": "avx512_bf16" in flags}


def build_docs(tok, spec, length, seed, cont_len):
    b = tasks.Builder(tok)
    lines = tasks.filler_lines()
    out = []
    for name, n in task_counts(spec):
        if name == "passkey":
            out += tasks.passkey_docs(b, n, length, seed, lines)
        elif name == "multikey":
            out += tasks.multikey_docs(b, n, length, seed + 1, lines, keys=8)
        elif name == "multivalue":
            out += tasks.multivalue_docs(b, n, length, seed + 2, lines, values=2)
        elif name == "multiquery":
            out += tasks.multiquery_docs(b, n, length, seed + 3, lines, keys=4)
        elif name == "vartrack":
            out += tasks.vartrack_docs(b, n, length, seed + 5, lines, hops=2)
        elif name == "kvlist":
            out += tasks.kvlist_docs(b, n, length, seed + 6)
        elif name == "qa":
            out += tasks.qa_docs(b, n, length, seed + 7, lines)
        elif name == "continuation":
            out += tasks.continuation_docs(b, n, length, cont_len, seed + 4,
                                           tasks.text_sources())
        else:
            raise SystemExit(f"--tasks: unknown task {name!r} (one of {', '.join(TASKS)})")
    return out


class Runner:
    def __init__(self, args, tok, model, shadow, server, rows):
        self.args, self.tok, self.model, self.shadow = args, tok, model, shadow
        self.server, self.rows = server, rows
        self.dtype = next(model.parameters()).dtype
        self.upload_dtype = self.dtype if args.upload_dtype == "model" else torch.float32
        self.stored = {}  # (task, scenario, row) -> measured kvc fraction (fp16 upload)
        self.newline = set(tok("\n", add_special_tokens=False)["input_ids"])
        eos = model.generation_config.eos_token_id
        self.stop_ids = self.newline | set(eos if isinstance(eos, list) else [eos])

    def needs_recon(self, row):
        if row.family == "kvpress":
            return row.spec in P.RECON_PRESSES
        if row.family in ("kvc", "kvc-bytes"):
            cfg = kvcrows.config_for(kvcrows.parse_row(row.spec)[0], 100)
            return cfg.get("eviction", {}).get("policy") == "kvzip"
        return False

    def compress_all(self, lin, task, scen, ids):
        lin32 = P.fp32_layers(lin)
        memo = P.ScoreMemo()
        uploads = None
        recon = None
        if any(self.needs_recon(r) for r in self.rows):
            t0 = time.perf_counter()
            plus = P.recon_needs_plus(r.spec for r in self.rows if r.family == "kvpress")
            recon = R.Reconstruction(self.tok, self.shadow, ids, lin32, plus=plus)
            recon.seconds = time.perf_counter() - t0
        out = []
        for row in self.rows:
            t0 = time.perf_counter()
            if row.family == "full":
                cache = M.full_cache(lin)
            elif row.family == "kvpress" and row.spec in P.RECON_PRESSES:
                cache = P.compress_recon(row.spec, recon, self.shadow, lin, float(row.keep),
                                         self.dtype)
            elif row.family == "kvpress":
                press = memo.wrap(P.PRESSES[row.spec](1.0 - float(row.keep)))
                cache, _ = P.compress(press, self.shadow, lin32, self.dtype)
            elif row.family in ("kvc", "kvc-bytes"):
                if uploads is None:
                    uploads = kvcrows.Uploads(self.shadow, lin, self.upload_dtype, recon)
                cache = kvcrows.compress(self.server, row.spec, uploads, self.args.window)
                key = (task, scen, row.name)
                if key not in self.stored:
                    self.stored[key] = kvcrows.stored_fraction_fp16(
                        self.server, row.spec, self.shadow, lin, self.args.window, recon)
                cache.stored_fraction = self.stored[key]
            else:
                cache = reference.compress(row.spec, self.shadow, lin32, self.dtype)
            if row.family not in ("kvc", "kvc-bytes", "proto"):
                cache.stored_fraction = row.nominal_stored()
            cache.seconds = time.perf_counter() - t0
            if recon is not None and self.needs_recon(row):
                cache.seconds += recon.seconds  # the extra pass is part of the method's cost
            out.append(cache)
        return out

    def batches(self, caches, todo):
        order = sorted(todo, key=lambda i: caches[i].length())
        B = self.args.batch
        return [order[i:i + B] for i in range(0, len(order), B)]

    def evaluate(self, doc, scen, caches):
        """Per row: dict of metrics, and the seconds its share of decoding took. Rows whose
        caches hold the same entries (model.fingerprint) are decoded once."""
        p, qs = doc["prompt"], doc["question_start"]
        res = [dict() for _ in caches]
        secs = [0.0] * len(caches)
        first, same = {}, {}
        for i, c in enumerate(caches):
            fp = M.fingerprint(c)
            if fp is not None and fp in first:
                same[i] = first[fp]
            elif fp is not None:
                first[fp] = i
        todo = [i for i in range(len(caches)) if i not in same]
        for idx in self.batches(caches, todo):
            rows = [caches[i] for i in idx]
            t0 = time.perf_counter()
            if doc["task"] == "continuation":
                cont = doc["continuation"]
                lg = M.forward_rows(self.model, rows, cont, len(p), len(cont))
                for j, i in enumerate(idx):
                    res[i]["logits"] = lg[j]
            elif doc["task"] == "multivalue":
                toks, start = (p[qs:], qs) if scen == "after" else (p[-1:], len(p) - 1)
                gen = M.generate_rows(self.model, rows, toks, start, self.args.max_new,
                                      self.stop_ids)
                for j, i in enumerate(idx):
                    text = self.tok.decode(gen[j])
                    vals = doc["meta"]["values"]
                    res[i]["recall"] = sum(v in text for v in vals) / len(vals)
                    res[i]["acc"] = float(all(v in text for v in vals))
                    res[i]["output"] = text
            else:
                ans = doc["answer"]
                toks, start = ((p[qs:] + ans[:-1], qs) if scen == "after"
                               else (p[-1:] + ans[:-1], len(p) - 1))
                lg = M.forward_rows(self.model, rows, toks, start, len(ans))
                pred = lg.argmax(-1)
                check = doc.get("check") or [True] * len(ans)
                for j, i in enumerate(idx):
                    ok = all(int(pred[j, t]) == ans[t] for t in range(len(ans)) if check[t])
                    res[i]["acc"] = float(ok)
                    res[i]["output"] = self.tok.decode(pred[j])
            dt = (time.perf_counter() - t0) / len(idx)
            for i in idx:
                secs[i] = dt
        for i, j in same.items():
            res[i] = dict(res[j], same_as=self.rows[j].name)
        if doc["task"] == "continuation":
            ref = next(r["logits"] for r, row in zip(res, self.rows) if row.family == "full")
            top_ref = ref.argmax(-1)
            for r in res:
                lg = r.pop("logits")
                r["kl"] = float(M.log_softmax_kl(ref, lg).mean())
                r["top1"] = float((lg.argmax(-1) == top_ref).float().mean())
        return res, secs

    def run_doc(self, doc):
        p, qs = doc["prompt"], doc["question_start"]
        t0 = time.perf_counter()
        if doc["task"] == "continuation":
            cap = M.Capture(self.model, p)
            scenarios = [("prefix", cap.layers_in, p)]
        else:
            cap = M.Capture(self.model, p[:-1])
            scenarios = [(s, cap.prefix(qs), p[:qs]) if s == "after" else (s, cap.layers_in, p[:-1])
                         for s in self.args.scenarios]
        prefill = time.perf_counter() - t0
        out = []
        heads = len(self.model.model.layers) * self.model.config.num_key_value_heads
        for scen, lin, ids in scenarios:
            caches = self.compress_all(lin, doc["task"], scen, ids)
            res, secs = self.evaluate(doc, scen, caches)
            S = lin[0].keys.shape[2]
            for row, cache, r, s in zip(self.rows, caches, res, secs):
                out.append({"task": doc["task"], "doc": doc["id"], "scenario": scen,
                            "row": row.name, "family": row.family, "method": row.method,
                            "keep": row.keep, "tokens": S,
                            "kept": cache.kept() / heads,
                            "stored": round(cache.stored_fraction, 5),
                            "acc": r.get("acc", ""), "recall": r.get("recall", ""),
                            "top1": r.get("top1", ""), "kl": r.get("kl", ""),
                            "seconds": round(cache.seconds + s, 4),
                            "compress_s": round(cache.seconds, 4), "decode_s": round(s, 4),
                            "prefill_s": round(prefill / len(scenarios), 4),
                            "same_as": r.get("same_as", ""), "output": r.get("output", "")})
        return out


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m kvc.bench.sidebyside",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--model", default=None, help="SmolLM2 directory (default: kvc-smollm2's)")
    ap.add_argument("--kvcd", default=os.environ.get("KVCD_PATH", "build/service/kvcd"))
    ap.add_argument("--tasks", default="passkey:100,multikey:100,multivalue:100,"
                    "multiquery:100,continuation:100",
                    help="TASK:N,... (passkey, multikey, multivalue, multiquery, vartrack, "
                         "kvlist, qa, continuation)")
    ap.add_argument("--length", type=int, default=1000, help="context tokens (about)")
    ap.add_argument("--continuation", type=int, default=64, help="continuation tokens")
    ap.add_argument("--ratios", default="0.5,0.25,0.1")
    ap.add_argument("--scenarios", default="after,inside")
    ap.add_argument("--kvpress", default=",".join(KVPRESS_DEFAULT),
                    help="press names (presses.PRESSES), comma-separated")
    ap.add_argument("--kvc", default=";".join(KVC_DEFAULT), help="kvc spec templates, ';'")
    ap.add_argument("--kvc-bytes", default=";".join(KVC_BYTES_DEFAULT),
                    help="fixed kvc specs (equal-bytes rows), ';'")
    ap.add_argument("--proto", default=";".join(PROTO_DEFAULT), help="prototype templates, ';'")
    ap.add_argument("--window", type=int, default=64, help="kvc rows' observation window W")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    ap.add_argument("--upload-dtype", default="model", choices=("model", "float32"))
    ap.add_argument("--batch", type=int, default=1,
                    help="rows decoded in one batch (1: each alone, so a row's answer does not "
                         "depend on the other rows of the run; bf16 padding moves near ties)")
    ap.add_argument("--max-new", type=int, default=20, help="multivalue: tokens generated")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared box)")
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="take no new document after M minutes and report the documents done "
                         "(the order is round robin over the tasks, so each task gets its share);"
                         " 0: no limit")
    ap.add_argument("--resume", action="store_true",
                    help="continue the run in --out (one stopped by --max-minutes): keep its "
                         "documents, run the others; every option that shapes the results must "
                         "be the run's")
    ap.add_argument("--workers", type=int, default=2,
                    help="worker processes, each with its own model copy and one torch thread")
    a = ap.parse_args(argv)
    a.scenarios = [s for s in a.scenarios.split(",") if s]
    a.ratios = [float(r) for r in a.ratios.split(",") if r]
    return a


_WORKER = {}


def _init_worker(args, model_dir, address, rows):
    import transformers
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    tok, model, shadow = M.load(model_dir, args.dtype, args.threads)
    server = kvcrows.Remote(address)
    _WORKER["runner"] = Runner(args, tok, model, shadow, server, rows)


def _work(doc):
    t0 = time.time()
    return doc["id"], len(doc["prompt"]), _WORKER["runner"].run_doc(doc), time.time() - t0


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if argv is None:  # run as a program
        kvcrows.exit_on_sigterm()
    import transformers
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    from transformers import AutoTokenizer
    from kvc.models import smollm2
    model_dir = args.model or str(smollm2.default_dir())
    os.makedirs(args.out, exist_ok=True)
    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(model_dir)
    docs = build_docs(tok, args.tasks, args.length, args.seed, args.continuation)
    by = {}
    for d in docs:  # round robin over the tasks, so a partial run covers every task
        by.setdefault(d["task"], []).append(d)
    docs = [d for i in range(max(len(g) for g in by.values())) for g in by.values()
            if i < len(g) for d in [g[i]]]
    rows = expand(args.kvpress.split(",") if args.kvpress else [], split_list(args.kvc),
                  split_list(args.kvc_bytes), split_list(args.proto), args.ratios)
    print(f"sidebyside: {len(docs)} documents, {len(rows)} rows, scenarios "
          f"{','.join(args.scenarios)}, model {args.dtype}, {args.workers} worker(s)",
          flush=True)
    results, done_docs, before = [], [], None
    if args.resume:
        results, done_docs, before = resume(args, docs)
        docs = [d for d in docs if d["id"] not in set(done_docs)]
        print(f"sidebyside: resuming {args.out}: {len(done_docs)} documents done in "
              f"{before[1] / 60:.1f} min, {len(docs)} to run", flush=True)
    n_before = len(done_docs)
    with kvcrows.Kvcd(args.kvcd, threads=max(1, args.workers)) as server:
        if args.workers <= 1:
            _init_worker(args, model_dir, server.address, rows)
            done = map(_work, docs)
            pool = None
        else:
            import multiprocessing as mp
            pool = mp.get_context("spawn").Pool(args.workers, _init_worker,
                                                (args, model_dir, server.address, rows))
            done = pool.imap_unordered(_work, docs)
        try:
            for i, (name, n, out, secs) in enumerate(done):
                results += out
                done_docs.append(name)
                print(f"[{i + 1}/{len(docs)}] {name} {n} tokens {secs:.1f}s "
                      f"(total {(time.time() - t_start) / 60:.1f} min)", flush=True)
                if (i + 1) % 20 == 0:
                    report.write_csv(os.path.join(args.out, "results.csv"), results)
                if args.max_minutes and time.time() - t_start > args.max_minutes * 60:
                    print(f"sidebyside: --max-minutes {args.max_minutes:g} reached after "
                          f"{len(done_docs) - n_before} of {len(docs)} documents", flush=True)
                    break
        finally:
            if pool is not None:
                pool.terminate()
    report.write_csv(os.path.join(args.out, "results.csv"), results)
    finish(args, results, rows, time.time() - t_start, done_docs, before,
           len(done_docs) - n_before)


# Options that do not change a document's results: a resumed run may set them anew. (Not
# --batch: in bf16 a batch's padding can flip a near-tie answer.)
RESUME_FREE = {"out", "kvcd", "max_minutes", "workers", "threads", "resume"}


def _tasks_grow(then, now):
    """Whether --tasks `now` names the tasks of `then` in the same order, each with at least as
    many documents: a resumed run may ask for more documents. The retrieval generators draw
    their documents one after another from one seeded stream, so the first N of N + M are the
    N; continuation spreads its N windows over the text, so its count may not change."""
    try:
        a, b = task_counts(then), task_counts(now)
    except ValueError:
        return False
    return [n for n, _ in a] == [n for n, _ in b] and all(
        y == x if name == "continuation" else y >= x for (name, x), (_, y) in zip(a, b))


def resume(args, docs):
    """(results, done document ids, seconds spent) of the run in args.out, refused unless its
    options are these (but RESUME_FREE, and --tasks may ask for more documents of the same
    tasks: _tasks_grow) and its documents are among `docs`. A document's rows
    are written together, so a document in results.csv is complete."""
    import csv
    path, meta_path = os.path.join(args.out, "results.csv"), os.path.join(args.out, "run.json")
    if not (os.path.exists(path) and os.path.exists(meta_path)):
        raise SystemExit(f"--resume: {args.out} has no results.csv and run.json to continue")
    with open(meta_path) as f:
        meta = json.load(f)
    then = meta.get("args", {})
    now = json.loads(json.dumps(vars(args), default=str))
    differ = sorted(k for k in now if k not in RESUME_FREE and then.get(k) != now[k]
                    and not (k == "tasks" and _tasks_grow(then.get(k), now[k])))
    if differ:
        raise SystemExit("--resume: options differ from the run's: " + ", ".join(
            f"--{k.replace('_', '-')} {then.get(k)!r} then, {now[k]!r} now" for k in differ))
    with open(path, newline="") as f:
        results = list(csv.DictReader(f))
    ids = {d["id"] for d in docs}
    done = list(dict.fromkeys(r["doc"] for r in results))
    unknown = [d for d in done if d not in ids]
    if unknown:
        raise SystemExit(f"--resume: {len(unknown)} documents of the run are not generated by "
                         f"these options (first {unknown[0]!r})")
    segments = meta.get("segments") or [{"argv": meta.get("argv"), "minutes": meta.get("minutes"),
                                          "documents": meta.get("documents", len(done))}]
    return results, done, (segments, float(meta.get("seconds", 0.0)))


def finish(args, results, rows, seconds, docs, before=None, ran=None):
    summary = report.summarize(results)
    report.write_csv(os.path.join(args.out, "summary.csv"), summary)
    present = []
    for t in TASKS:
        if any(r["task"] == t for r in results):
            present.append(t)
    cols = []
    for t in present:
        if t == "continuation":
            cols += [(t, "prefix", "top1"), (t, "prefix", "kl")]
        else:
            for s in args.scenarios:
                cols.append((t, s, "recall" if t == "multivalue" else "acc"))
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(report.markdown(summary, cols, [r.name for r in rows]))
    png = report.plot(summary, os.path.join(args.out, "plot.png"),
                      [t for t in present if t != "multiquery"] or present)
    import kvpress
    import transformers
    prior_segments, before = before if before else ([], 0.0)
    total = before + seconds
    meta = {"argv": sys.argv, "seconds": round(total, 1), "minutes": round(total / 60, 1),
            "documents": len(docs), "rows": len(rows),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "kvpress": importlib.metadata.version("kvpress"),
                         "python": platform.python_version()},
            "plot": png, "args": {k: v for k, v in vars(args).items()},
            # one entry per invocation (--resume adds one): its command, minutes and documents
            "segments": prior_segments + [{"argv": sys.argv, "minutes": round(seconds / 60, 1),
                                           "documents": len(docs) if ran is None else ran,
                                           "cpu": cpu_info()}]}
    with open(os.path.join(args.out, "run.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
    print(f"sidebyside: {len(results)} results in {total / 60:.1f} min -> {args.out}",
          flush=True)


if __name__ == "__main__":
    main()

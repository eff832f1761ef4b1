"""Issue 19's goals read off one side-by-side run (its results.csv), as a markdown table.

    python -m kvc.bench.goals DIR [--scenario after]

Per retrieval task and keep ratio: the best kvpress press and the best kvc spec by mean accuracy,
and kvc's best minus every press's (paired over the same documents, percentile bootstrap 95%);
equal bytes: every fixed-size kvc row (--kvc-bytes) storing at most kvpress's keep-0.25 fp16
bytes (0.25 of the fp16 cache, as kvcd measured it) against the full cache; equal memory: per
kvpress keep ratio r, its best press against the best kvc row of any kind (kept tokens,
quantization, ThinK) that kvcd stored in at most r of the fp16 cache's bytes; continuation at
keep 0.5: the lowest mean KL of each side and their paired difference; then every kvc row of a
keep ratio against that ratio's best press (paired), with the number of documents both answer
alike. "Best" is chosen by mean on the same documents it is then compared on. Only rows in the
run take part: the table says which rows those were.
"""

import argparse
import csv
import os
import random
from collections import defaultdict

from .report import code


def paired(a, b, reps=2000, seed=7):
    """Mean of a - b over the documents both have, and its 95% bootstrap interval."""
    docs = sorted(set(a) & set(b))
    d = [a[k] - b[k] for k in docs]
    if not d:
        return float("nan"), (float("nan"), float("nan")), 0
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(len(d))] for _ in d) / len(d) for _ in range(reps))
    return sum(d) / len(d), (means[int(0.025 * reps)], means[int(0.975 * reps) - 1]), len(d)


def load(path, scenario):
    """{(task, row): {doc: value}} (acc for retrieval, kl for continuation), {row: meta} and
    {(task, row): stored}: the largest fraction of the fp16 bytes the row stored on any document
    of the task."""
    vals, meta, stored_in = defaultdict(dict), {}, {}
    with open(path) as f:
        for r in csv.DictReader(f):
            if r["scenario"] not in (scenario, "prefix"):
                continue
            metric = "kl" if r["task"] == "continuation" else "acc"
            if r[metric] == "":
                continue
            key = (r["task"], r["row"])
            vals[key][r["doc"]] = float(r[metric])
            stored = float(r["stored"])
            stored_in[key] = max(stored_in.get(key, stored), stored)
            meta[r["row"]] = {"family": r["family"], "keep": r["keep"]}
    return vals, meta, stored_in


def mean(d):
    return sum(d.values()) / len(d) if d else float("nan")


def table(vals, meta, stored_in):
    lines = ["| task | keep | best kvpress | best kvc | kvc - kvpress (paired, 95%) | n |",
             "|---|---|---|---|---|---|"]
    tasks = sorted({t for t, _ in vals if t != "continuation"})
    for task in tasks:
        keeps = sorted({meta[r]["keep"] for t, r in vals if t == task and meta[r]["keep"]},
                       key=float, reverse=True)
        for keep in keeps:
            side = {fam: [r for t, r in vals if t == task and meta[r]["keep"] == keep
                          and meta[r]["family"] == fam] for fam in ("kvpress", "kvc")}
            if not side["kvpress"] or not side["kvc"]:
                continue
            bp = max(side["kvpress"], key=lambda r: mean(vals[(task, r)]))
            bk = max(side["kvc"], key=lambda r: mean(vals[(task, r)]))
            d, (lo, hi), n = paired(vals[(task, bk)], vals[(task, bp)])
            lines.append(f"| {task} | {keep} | {code(bp)} {mean(vals[(task, bp)]):.2f} | "
                         f"{code(bk)} {mean(vals[(task, bk)]):.2f} | "
                         f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}] | {n} |")
    lines += ["", "| task | equal-bytes row (stored <= 0.25 of fp16) | stored | accuracy | "
              "minus full (paired, 95%) | n |", "|---|---|---|---|---|---|"]
    for task in tasks:
        full = vals.get((task, "full"), {})
        for t, r in sorted(vals):
            if t != task or meta[r]["family"] != "kvc-bytes" or not stored_in[(t, r)] <= 0.25:
                continue
            d, (lo, hi), n = paired(vals[(t, r)], full)
            lines.append(f"| {task} | {code(r)} | {stored_in[(t, r)]:.3f} | "
                         f"{mean(vals[(t, r)]):.2f} | {d:+.2f} [{lo:+.2f}, {hi:+.2f}] | {n} |")
    lines += memory_table(vals, meta, stored_in, tasks)
    lines += rows_table(vals, meta, tasks)
    cont = [(r, v) for (t, r), v in vals.items()
            if t == "continuation" and meta[r]["keep"] == "0.5"]
    if cont:
        side = {fam: [(r, v) for r, v in cont if meta[r]["family"] == fam]
                for fam in ("kvpress", "kvc")}
        if side["kvpress"] and side["kvc"]:
            bp, vp = min(side["kvpress"], key=lambda x: mean(x[1]))
            bk, vk = min(side["kvc"], key=lambda x: mean(x[1]))
            d, (lo, hi), n = paired(vk, vp)
            lines += ["", "| continuation, keep 0.5 | lowest mean KL | kvc - kvpress (paired, "
                      "95%) | n |", "|---|---|---|---|",
                      f"| kvpress | {code(bp)} {mean(vp):.4f} | | |",
                      f"| kvc | {code(bk)} {mean(vk):.4f} | {d:+.4f} [{lo:+.4f}, {hi:+.4f}] "
                      f"| {n} |"]
    return "\n".join(lines) + "\n"


def memory_table(vals, meta, stored_in, tasks):
    """Lines of the equal-memory table: per task and kvpress keep ratio r, the best press at r
    against the best kvc row (kvc or kvc-bytes) that stored at most r of the fp16 bytes."""
    lines = ["", "| task | memory (of fp16) | best kvpress | best kvc in no more bytes | stored | "
             "kvc - kvpress (paired, 95%) | n |", "|---|---|---|---|---|---|---|"]
    for task in tasks:
        presses = [r for t, r in vals if t == task and meta[r]["family"] == "kvpress"]
        for keep in sorted({meta[r]["keep"] for r in presses}, key=float, reverse=True):
            budget = float(keep)
            at = [r for r in presses if meta[r]["keep"] == keep]
            kvc = [r for t, r in vals if t == task and meta[r]["family"] in ("kvc", "kvc-bytes")
                   and stored_in[(t, r)] <= budget]
            if not kvc:
                continue
            bp = max(at, key=lambda r: mean(vals[(task, r)]))
            bk = max(kvc, key=lambda r: mean(vals[(task, r)]))
            d, (lo, hi), n = paired(vals[(task, bk)], vals[(task, bp)])
            lines.append(f"| {task} | {keep} | {code(bp)} {mean(vals[(task, bp)]):.2f} | "
                         f"{code(bk)} {mean(vals[(task, bk)]):.2f} | {stored_in[(task, bk)]:.3f} | "
                         f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}] | {n} |")
    return lines


def rows_table(vals, meta, tasks):
    """Lines of the per-row table: per task and keep ratio, every kvc row against the best
    kvpress press of that ratio (paired), and on how many documents the two answer alike."""
    lines = ["", "| task | keep | kvc row | accuracy | minus best kvpress (paired, 95%) | "
             "alike | n |", "|---|---|---|---|---|---|---|"]
    for task in tasks:
        rows = [r for t, r in vals if t == task]
        for keep in sorted({meta[r]["keep"] for r in rows if meta[r]["keep"]}, key=float,
                           reverse=True):
            presses = [r for r in rows if meta[r]["keep"] == keep
                       and meta[r]["family"] == "kvpress"]
            if not presses:
                continue
            bp = max(presses, key=lambda r: mean(vals[(task, r)]))
            vp = vals[(task, bp)]
            for r in sorted(r for r in rows if meta[r]["keep"] == keep
                            and meta[r]["family"] == "kvc"):
                v = vals[(task, r)]
                d, (lo, hi), n = paired(v, vp)
                alike = sum(v[k] == vp[k] for k in set(v) & set(vp))
                lines.append(f"| {task} | {keep} | {code(r)} | {mean(v):.2f} | "
                             f"{d:+.2f} [{lo:+.2f}, {hi:+.2f}] ({code(bp)}) | {alike} | {n} |")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvc.bench.goals")
    ap.add_argument("dir", help="a sidebyside --out folder (reads results.csv)")
    ap.add_argument("--scenario", default="after")
    args = ap.parse_args(argv)
    out = table(*load(os.path.join(args.dir, "results.csv"), args.scenario))
    with open(os.path.join(args.dir, "goals.md"), "w") as f:
        f.write(out)
    print(out, end="")


if __name__ == "__main__":
    main()

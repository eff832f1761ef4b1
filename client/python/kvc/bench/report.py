"""Intervals, the summary table (CSV and markdown) and the plot of the side-by-side harness."""

import csv
import math
import random

Z95 = 1.959963984540054


def wilson(k, n, z=Z95):
    """95% Wilson score interval of k successes in n trials."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo, hi = max(0.0, mid - half), min(1.0, mid + half)
    # exact ends: rounding must not leave a bound on the wrong side of p = 0 or 1
    return (0.0 if k == 0 else min(lo, p), 1.0 if k == n else max(hi, p))


def bootstrap(values, reps=2000, seed=12345):
    """95% percentile bootstrap interval of the mean (documents resampled with replacement)."""
    n = len(values)
    if n == 0:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = sorted(sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    return (means[int(0.025 * reps)], means[min(reps - 1, int(0.975 * reps))])


# metric -> (how it is aggregated, interval)
METRICS = {
    "acc": "wilson",      # exact answer, 0/1 per document
    "recall": "boot",     # multi-value: fraction of the values written
    "top1": "boot",       # continuation: top-1 agreement with the full cache (per document)
    "kl": "boot",         # continuation: mean KL(full || compressed) (per document)
}


def summarize(results):
    """Rows of the summary: one per (task, scenario, row, metric) with mean, interval, n and
    the mean cost and stored fraction."""
    groups = {}
    for r in results:
        key = (r["task"], r["scenario"], r["row"])
        groups.setdefault(key, []).append(r)
    out = []
    for (task, scen, row), rs in groups.items():
        for metric, kind in METRICS.items():
            vals = [float(r[metric]) for r in rs if r.get(metric) not in (None, "")]
            if not vals:
                continue
            mean = sum(vals) / len(vals)
            if kind == "wilson":
                lo, hi = wilson(sum(1 for v in vals if v >= 0.5), len(vals))
            else:
                lo, hi = bootstrap(vals)
            out.append({"task": task, "scenario": scen, "row": row, "family": rs[0]["family"],
                        "method": rs[0]["method"], "keep": rs[0]["keep"], "metric": metric,
                        "mean": mean, "lo": lo, "hi": hi, "n": len(vals),
                        "stored": sum(float(r["stored"]) for r in rs) / len(rs),
                        "seconds": sum(float(r["seconds"]) for r in rs) / len(rs)})
    return out


def write_csv(path, rows):
    if not rows:
        return
    keys = list(rows[0].keys())
    for r in rows[1:]:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow(r)


def code(name):
    """A row name as inline code in a markdown table cell: its pipes escaped (a spec such as
    `kvzip:0.1|passes=1` would otherwise split the cell)."""
    return "`" + name.replace("|", "\\|") + "`"


def _cell(s, metric):
    if s is None:
        return ""
    if metric == "kl":
        return f"{s['mean']:.3f} [{s['lo']:.3f}, {s['hi']:.3f}]"
    return f"{s['mean']:.2f} [{s['lo']:.2f}, {s['hi']:.2f}]"


def markdown(summary, columns, row_order):
    """A markdown table: one line per row, one column per (task, scenario, metric)."""
    index = {(s["task"], s["scenario"], s["row"], s["metric"]): s for s in summary}
    info = {s["row"]: s for s in summary}
    head = ["row", "bytes"] + [f"{t} {sc} {m}" for t, sc, m in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in row_order:
        if row not in info:
            continue
        cells = [code(row), f"{info[row]['stored']:.3f}"]
        cells += [_cell(index.get((t, sc, row, m)), m) for t, sc, m in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary, path, tasks, scenario="after", metric="acc"):
    """Accuracy against keep ratio, one panel per task: kvpress dashed, kvc solid, prototypes
    dotted. Returns the path written (PNG with matplotlib; None without it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 4.2), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        m = "kl" if task == "continuation" else ("recall" if task == "multivalue" else metric)
        sc = "prefix" if task == "continuation" else scenario
        series = {}
        for s in summary:
            if s["task"] != task or s["scenario"] != sc or s["metric"] != m:
                continue
            if s["family"] == "full":
                ax.axhline(s["mean"], color="k", lw=0.8)
                continue
            if s["keep"] in ("", None) or s["family"] == "kvc-bytes":
                continue
            series.setdefault((s["family"], s["method"]), []).append(
                (float(s["keep"]), s["mean"], s["lo"], s["hi"]))
        for (fam, method), pts in sorted(series.items()):
            pts.sort()
            style = {"kvpress": "--", "kvc": "-", "proto": ":"}.get(fam, "-")
            ax.errorbar([p[0] for p in pts], [p[1] for p in pts],
                        yerr=[[max(0.0, p[1] - p[2]) for p in pts],
                              [max(0.0, p[3] - p[1]) for p in pts]],
                        ls=style, marker="o", ms=3, capsize=2, lw=1, label=f"{fam}:{method}")
        ax.set_xscale("log")
        ax.set_xticks([0.1, 0.25, 0.5, 1.0])
        ax.set_xticklabels(["0.1", "0.25", "0.5", "1"])
        ax.set_xlabel("keep ratio")
        ax.set_ylabel(m)
        ax.set_title(f"{task} ({sc})")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    fig.tight_layout(rect=(0, 0.18, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

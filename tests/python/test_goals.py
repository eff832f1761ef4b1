"""kvc.bench.goals on a small hand-made results.csv: which rows each table compares, and the
paired differences (the harness itself runs in python_sidebyside_venv_test)."""

import csv

from kvc.bench import goals

FIELDS = ["task", "doc", "scenario", "row", "family", "method", "keep", "stored", "acc", "kl"]


def write(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})


def rows_of(row, family, keep, stored, accs, task="multikey"):
    """One results line per document; `stored` a number or a list (per document)."""
    per_doc = stored if isinstance(stored, list) else [stored] * len(accs)
    return [{"task": task, "doc": f"d{i}", "scenario": "after", "row": row, "family": family,
             "keep": keep, "stored": s, "acc": a} for i, (a, s) in enumerate(zip(accs, per_doc))]


def table_of(tmp_path, lines):
    """goals' markdown for these results lines (written as a results.csv under tmp_path)."""
    path = tmp_path / "results.csv"
    write(path, lines)
    return goals.table(*goals.load(str(path), "after"))


def test_equal_memory_takes_the_best_kvc_row_within_the_bytes(tmp_path):
    lines = (rows_of("full", "full", "1.0", 1.0, [1, 1, 1, 1])
             + rows_of("kvpress:kvzip@0.25", "kvpress", "0.25", 0.25, [1, 0, 0, 1])
             + rows_of("kvpress:snapkv@0.25", "kvpress", "0.25", 0.25, [0, 0, 0, 1])
             # kept tokens at 0.25: over the budget by its index bytes, so not in the memory table
             + rows_of("kvc:kvzip:0.25", "kvc", "0.25", 0.256, [1, 1, 1, 1])
             # within the budget on three documents, over it on one: out as well
             + rows_of("kvc:kvzip:0.7+q4", "kvc-bytes", "", [0.24, 0.24, 0.26, 0.24], [1, 1, 1, 1])
             + rows_of("kvc:kvzip:0.6+q4", "kvc-bytes", "", 0.22, [1, 1, 0, 1])
             + rows_of("kvc:kvzip:0.5+q4", "kvc-bytes", "", 0.20, [0, 1, 0, 1]))
    path = tmp_path / "results.csv"
    write(path, lines)
    vals, meta, stored_in = goals.load(str(path), "after")
    assert stored_in[("multikey", "kvc:kvzip:0.7+q4")] == 0.26  # the largest over documents
    out = goals.table(vals, meta, stored_in)
    # Same keep ratio: the kept-token rows, best against best.
    assert ("| multikey | 0.25 | `kvpress:kvzip@0.25` 0.50 | `kvc:kvzip:0.25` 1.00 | "
            "+0.50 [+0.00, +1.00] | 4 |") in out
    # Equal memory: only rows storing <= 0.25 of fp16 on every document; 0.6+q4 is their best.
    memory = [ln for ln in out.splitlines() if ln.startswith("| multikey | 0.25 | `kvpress")
              and "no more" not in ln]
    assert memory[-1] == ("| multikey | 0.25 | `kvpress:kvzip@0.25` 0.50 | `kvc:kvzip:0.6+q4` "
                          "0.75 | 0.220 | +0.25 [+0.00, +0.75] | 4 |")


def test_equal_memory_row_is_left_out_when_nothing_fits(tmp_path):
    lines = (rows_of("kvpress:kvzip@0.1", "kvpress", "0.1", 0.1, [1, 0])
             + rows_of("kvc:kvzip:0.1", "kvc", "0.1", 0.103, [1, 1]))
    out = table_of(tmp_path, lines)
    ls = out.splitlines()
    header = ls.index(next(ln for ln in ls if "no more bytes" in ln))
    end = ls.index("", header)  # the tables are separated by blank lines
    assert end > header + 1 and not any(ln.startswith("| multikey |") for ln in ls[header + 2:end])


def test_every_kvc_row_is_paired_with_the_best_press_of_its_keep(tmp_path):
    lines = (rows_of("kvpress:kvzip@0.1", "kvpress", "0.1", 0.1, [1, 0, 0, 1])
             + rows_of("kvpress:snapkv@0.1", "kvpress", "0.1", 0.1, [0, 0, 0, 1])
             + rows_of("kvc:kvzip:0.1", "kvc", "0.1", 0.102, [1, 0, 0, 1])
             + rows_of("kvc:kvzip:0.1,top=16", "kvc", "0.1", 0.102, [1, 1, 1, 0])
             # another keep ratio with no press: no line of its own
             + rows_of("kvc:kvzip:0.5", "kvc", "0.5", 0.51, [1, 1, 1, 1]))
    out = table_of(tmp_path, lines)
    per_row = [ln for ln in out.splitlines() if "(`kvpress:" in ln]
    assert per_row == [
        "| multikey | 0.1 | `kvc:kvzip:0.1` | 0.50 | +0.00 [+0.00, +0.00] (`kvpress:kvzip@0.1`) "
        "| 4 | 4 |",
        "| multikey | 0.1 | `kvc:kvzip:0.1,top=16` | 0.75 | +0.25 [-0.50, +1.00] "
        "(`kvpress:kvzip@0.1`) | 1 | 4 |"]


def test_pipes_in_row_names_are_escaped_in_the_tables(tmp_path):
    lines = (rows_of("kvpress:kvzip@0.1", "kvpress", "0.1", 0.1, [1, 0])
             + rows_of("kvc:kvzip:0.1|passes=1", "kvc", "0.1", 0.102, [1, 1]))
    out = table_of(tmp_path, lines)
    best = next(ln for ln in out.splitlines() if ln.startswith("| multikey | 0.1 | `kvpress"))
    assert "`kvc:kvzip:0.1\\|passes=1` 1.00" in best
    # every line of a table has as many cells as its header
    assert best.count("|") - best.count("\\|") == 7

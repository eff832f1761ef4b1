"""Parity of kvc and kvpress, and the harness's equivalence with kvpress's own pipeline.

    python -m kvc.bench.parity --out DIR [--docs 3] [--ratios 0.5,0.25,0.1]

1. Equivalence: for each press, the kept positions of the harness (the press's score/compress
   on captured inputs, presses.py) against kvpress's forward hooks during a real prefill
   (`with press(model): model.model(ids, past_key_values=cache)`), per layer and head. For
   ScorerPress rows the cache after the hooked prefill is matched row by row to the captured
   keys; for AdaKV the masked indices are compared.
2. Kept sets: for each method both implement, kvpress's kept positions against kvcd's (DENSE
   download positions), on the same captured keys, values and queries, per layer and head:
   the mean overlap |A n B| / |A|, the share of (layer, head) sets that are identical, the
   worst overlap; for ThinK the pruned key channels. Where sets differ, two numbers say why:
   `gap`, how far below kvpress's cut (its n-th highest score, relative to the head's largest
   score) the lowest token kvc kept instead lies, by kvpress's own score (near 1e-7: a tie
   broken by rounding); `edge`, the share of the differing sets where a differing position
   lies within 2 of either end of the scored range (kvpress's zero-padded pooling there).
3. Explained: kvpress's expected-attention score computed with kvc's two choices (the first
   4 keys inside the softmax, and not protected) against kvc's kept sets.

Runs in float32 (model, scores and uploads), so nothing is decided by bf16 rounding.
"""

import argparse
import json
import math
import os
import sys

import torch
from transformers import DynamicCache

from . import kvcrows, model as M, presses as P, tasks
from .sidebyside import build_docs

# kvpress press -> the kvc spec of the same method ({r}: keep ratio), and W for the upload.
PAIRS = [
    ("streaming", "streaming:{r}", 64),
    ("knorm", "knorm:{r}", 64),
    ("keydiff", "keydiff:{r}", 64),
    ("snapkv", "snapkv:{r},kernel=5,pool=avg", 64),
    ("snapkv", "snapkv:{r}", 64),
    ("expected", "expected:{r},stats=1,horizon=512,veps=0", 64),
    ("expected", "expected:{r},stats=1", 64),
    ("tova", "h2o:{r},recent=0,layer=1", 1),
    ("adakv-snapkv", "snapkv:{r},kernel=5,pool=avg,ada=0.2", 64),
    ("adakv-expected", "expected:{r},stats=1,horizon=512,veps=0,ada=0.2", 64),
    ("snapkv+think0.5", "snapkv:{r},kernel=5,pool=avg+think:0.5", 64),
    # KVzip per layer (AdaKV-like selection over the layer's heads, sinks kept) against kvc's
    # kvzip with no per-head floor; W = S + 9 (every query of the reconstruction pass, recon.py),
    # with and without the rows' log-masses over the pass's own keys (stats=1).
    ("kvzip-layer", "kvzip:{r},ada=0,stats=1", 0),
    ("kvzip-layer", "kvzip:{r},ada=0", 0),
    # The same with the reconstruction passes named in the spec: each pass's rows normalised over
    # the sinks and its chunk, as KVzipPress does (the same as above within one 2,048-token chunk).
    ("kvzip-layer", "kvzip:{r},ada=0,stats=1|passes=1", 0),
]


def kept_sets_press(row, kept):
    """Per layer, per head: the kept positions of a press's RowCache (sets)."""
    out = []
    for (k, v, m), idx in zip(row.layers, kept):
        if idx is not None:
            out.append([set(idx[h].tolist()) for h in range(idx.shape[0])])
        else:
            out.append([set(torch.nonzero(m[h]).flatten().tolist()) for h in range(m.shape[0])])
    return out


def kept_sets_kvc(row):
    return [[set(p[h][p[h] >= 0].tolist()) for h in range(p.shape[0])] for p in row.positions]


def pruned_channels(k, valid, recent=0):
    """Per head: channels that are zero in every kept key except the `recent` latest."""
    out = []
    for h in range(k.shape[0]):
        rows = k[h][valid[h]]
        old = rows[:max(0, rows.shape[0] - recent)] if recent else rows
        out.append(set(torch.nonzero((old == 0).all(0)).flatten().tolist()))
    return out


def score_gap(press, model, layers_in, a, b):
    """Largest, over (layer, head) sets that differ, of (kvpress's cut - kvpress's score of the
    lowest token only kvc kept) / the head's largest |score|; None for presses without a
    score of their own (0.0 when no set differs)."""
    if not isinstance(press, P.ScorerPress):
        return None
    worst = 0.0
    with torch.no_grad():
        for li, (x, la, lb) in enumerate(zip(layers_in, a, b)):
            if all(sa == sb for sa, sb in zip(la, lb)):
                continue
            module = model.model.layers[li].self_attn
            sc = press.score(module, x.hidden, x.keys, x.values, None,
                             P._kwargs(x, x.hidden))[0]
            for h, (sa, sb) in enumerate(zip(la, lb)):
                only_b = sb - sa
                if not only_b:
                    continue
                cut = float(sc[h].topk(len(sa)).values[-1])
                low = min(float(sc[h][j]) for j in only_b)
                worst = max(worst, (cut - low) / max(float(sc[h].abs().max()), 1e-30))
    return worst


def edge_share(a, b, S, W, half=2):
    """Share of the (layer, head) sets that differ where a position kept by one side only lies
    within `half` of position 0 or of the last scored position S - W - 1 (None when no set
    differs)."""
    n = edge = 0
    for la, lb in zip(a, b):
        for sa, sb in zip(la, lb):
            if sa != sb:
                n += 1
                edge += any(p < half or S - W - 1 - half < p < S - W for p in sa ^ sb)
    return edge / n if n else None


def expected_as_kvc_sets(press, model, layers_in):
    """Kept sets of kvpress's ExpectedAttentionPress score computed with kvc's choices: the
    first n_sink keys stay inside the softmax and are not protected (kvpress drops them from
    the softmax and keeps them with score max + 1). Everything else is kvpress's code."""
    out = []
    with torch.no_grad():
        for li, x in enumerate(layers_in):
            module = model.model.layers[li].self_attn
            keys, values = x.keys, x.values
            mu, cov = press.get_query_statistics(module, x.hidden)
            b, H, S, d = keys.shape
            g = module.config.num_attention_heads // H
            k = keys.repeat_interleave(g, dim=1).transpose(2, 3)
            s = torch.matmul(mu.unsqueeze(2), k).squeeze(2) / math.sqrt(d)
            s = s + torch.einsum("bhin,bhij,bhjn->bhn", k, cov, k) / d / 2
            s = torch.softmax(s, -1).view(b, H, g, S).mean(2)
            s = (s + press.epsilon) * values.norm(dim=-1)
            idx = s.topk(P.compute_n_kept(S, press.compression_ratio), -1).indices[0]
            out.append([set(idx[h].tolist()) for h in range(H)])
    return out


def kvzip_as_kvc_sets(recon, layers_in, keep, n_sink=4, lse=False):
    """Kept sets of KVzip per layer scored as kvcd scores it (kvc/selection.h, kvzip): the
    maximum over the reconstruction queries (recon.q_obs, every row of the pass) and the
    group's heads of the softmax over the S context keys (with `lse`, plus each row's log-mass
    recon.lse in the denominator, as kvcd does with stats=1); then KVzipPress's per-layer
    selection (sinks kept, the layer's lowest scores over all heads dropped) keeping kvc's count,
    H * floor(S * keep) a layer (kvpress keeps H * S - floor(H * S * (1 - keep)): up to H - 1
    more)."""
    out = []
    with torch.no_grad():
        for li, (q, x) in enumerate(zip(recon.q_obs, layers_in)):
            keys = x.keys[0].float()  # [H, S, D]
            H, S, D = keys.shape
            g = q.shape[0] // H
            a = torch.einsum("hgwd,hsd->hgws", q.view(H, g, -1, D), keys) / math.sqrt(D)
            if lse:
                extra = recon.lse[li].view(H, g, -1, 1)
                den = torch.logaddexp(torch.logsumexp(a, -1, keepdim=True), extra)
                sc = torch.exp(a - den).amax(dim=(1, 2))
            else:
                sc = torch.softmax(a, -1).amax(dim=(1, 2))  # [H, S]
            out.append(_layer_top_sets(sc, keep, n_sink))
    return out


def _layer_top_sets(sc, keep, n_sink):
    """KVzipPress's per-layer selection of scores sc [H, S] with kvc's count: the sinks kept,
    the layer's H * S - H * budget lowest scores over all heads dropped; per head its set."""
    H, S = sc.shape
    sc[:, :n_sink] = sc.max() + 1
    n_pruned = H * S - H * kvcrows.budget_for(S, keep)
    drop = torch.topk(-sc.reshape(-1), n_pruned).indices
    valid = torch.ones(H * S, dtype=torch.bool)
    valid[drop] = False
    valid = valid.view(H, S)
    return [set(torch.nonzero(valid[h]).flatten().tolist()) for h in range(H)]


def kvzip_press_sets(recon, keep, n_sink=4):
    """Kept sets of KVzipPress's own scores (recon.scores: per chunk normalised) under its
    per-layer selection, keeping kvc's count (see kvzip_as_kvc_sets)."""
    return [_layer_top_sets(recon.scores[li, 0].clone(), keep, n_sink)
            for li in range(recon.scores.shape[0])]


def compare(a, b):
    """(mean overlap, identical share, min overlap) of two per-layer per-head set lists."""
    ov, same = [], 0
    for la, lb in zip(a, b):
        for sa, sb in zip(la, lb):
            n = max(len(sa), len(sb), 1)
            ov.append(len(sa & sb) / n)
            same += sa == sb
    return sum(ov) / len(ov), same / len(ov), min(ov)


def equivalence(model, press_name, ratio, ids, shadow_lin32):
    """Share of (layer, head) kept sets equal between kvpress's hooks and the harness."""
    press = P.PRESSES[press_name](1 - ratio)
    cache = DynamicCache()
    masked = {}

    def grab(module, args, kwargs, output):
        masked[module.layer_idx] = module.masked_key_indices

    hooks = []
    try:
        with torch.no_grad(), press(model):
            # registered after the press's own hooks, so they run after it compressed
            if isinstance(press, (P.AdaKVPress, P.CriticalAdaKVPress)):
                hooks = [layer.self_attn.register_forward_hook(grab, with_kwargs=True)
                         for layer in model.model.layers]
            model.model(torch.tensor([ids]), past_key_values=cache)
    finally:
        for h in hooks:
            h.remove()
    mine, kept = P.compress(P.PRESSES[press_name](1 - ratio), model, shadow_lin32, torch.float32)
    ours = kept_sets_press(mine, kept)
    theirs = []
    for li, x in enumerate(shadow_lin32):
        if masked:
            _, hh, ss = masked[li]
            H, S = x.keys.shape[1], x.keys.shape[2]
            valid = torch.ones(H, S, dtype=torch.bool)
            valid[hh, ss] = False
            theirs.append([set(torch.nonzero(valid[h]).flatten().tolist()) for h in range(H)])
            continue
        ck = cache.layers[li].keys[0]
        per = []
        for h in range(ck.shape[0]):
            full = x.keys[0, h]
            # each kept key row is one of the captured rows: find its position
            d = torch.cdist(ck[h].double(), full.double())
            per.append(set(d.argmin(1).tolist()))
        theirs.append(per)
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None
    return compare(ours, theirs)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvc.bench.parity")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=None)
    ap.add_argument("--kvcd", default=os.environ.get("KVCD_PATH", "build/service/kvcd"))
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--length", type=int, default=1000)
    ap.add_argument("--ratios", default="0.5,0.25,0.1")
    ap.add_argument("--scenarios", default="after,inside")
    ap.add_argument("--pairs", default="", help="only these kvpress presses of the kept-set "
                    "pairs (comma-separated; default all)")
    ap.add_argument("--equivalence", default="streaming,knorm,snapkv,keydiff,expected,tova,"
                    "adakv-snapkv,adakv-expected,criticalkv-snapkv")
    args = ap.parse_args(argv)
    if argv is None:  # run as a program
        kvcrows.exit_on_sigterm()
    import transformers
    transformers.logging.disable_progress_bar()
    transformers.logging.set_verbosity_error()
    from kvc.models import smollm2
    tok, model, shadow = M.load(args.model or str(smollm2.default_dir()), "float32")
    docs = build_docs(tok, f"passkey:{args.docs}", args.length, 7, 64)
    ratios = [float(r) for r in args.ratios.split(",")]
    os.makedirs(args.out, exist_ok=True)
    lines = []
    with kvcrows.Kvcd(args.kvcd) as server:
        for d in docs:
            qs = d["question_start"]
            cap = M.Capture(model, d["prompt"][:-1])
            for scen, lin in (("after", cap.prefix(qs)), ("inside", cap.layers_in)):
                if scen not in args.scenarios.split(","):
                    continue
                lin32 = P.fp32_layers(lin)
                ids = d["prompt"][:qs] if scen == "after" else d["prompt"][:-1]
                pairs = [p for p in PAIRS if not args.pairs or p[0] in args.pairs.split(",")]
                recon = None
                if any(p[0] in P.RECON_PRESSES for p in pairs):
                    from .recon import Reconstruction
                    recon = Reconstruction(tok, shadow, ids, lin32,
                                           plus=P.recon_needs_plus(p[0] for p in pairs))
                uploads = kvcrows.Uploads(shadow, lin, torch.float32, recon)
                for r in ratios:
                    for name in args.equivalence.split(","):
                        if name and scen == "after":
                            mean, same, worst = equivalence(model, name, r, ids, lin32)
                            lines.append({"check": "equivalence", "doc": d["id"], "scenario": scen,
                                          "keep": r, "kvpress": name, "kvc": "",
                                          "overlap": mean, "identical": same, "min": worst})
                    S = lin32[0].keys.shape[2]
                    for pname, tmpl, W in pairs:
                        if pname in P.RECON_PRESSES:
                            press = None
                            prow = P.compress_recon(pname, recon, shadow, lin32, r, torch.float32)
                            pkept = [None] * len(lin32)
                            W = S
                        else:
                            press = P.PRESSES[pname](1 - r)
                            prow, pkept = P.compress(press, shadow, lin32, torch.float32)
                        krow = kvcrows.compress(server, "kvc:" + tmpl.replace("{r}", f"{r:g}"),
                                                uploads, W)
                        a, b = kept_sets_press(prow, pkept), kept_sets_kvc(krow)
                        mean, same, worst = compare(a, b)
                        line = {"check": "kept", "doc": d["id"], "scenario": scen, "keep": r,
                                "kvpress": pname, "kvc": tmpl, "overlap": mean,
                                "identical": same, "min": worst,
                                "gap": score_gap(press, shadow, lin32, a, b),
                                "edge": edge_share(a, b, S, W)}
                        if tmpl.startswith("kvzip:{r},ada=0") and "|passes=1" in tmpl:
                            e_mean, e_same, e_worst = compare(kvzip_press_sets(recon, r), b)
                            lines.append({"check": "explained", "doc": d["id"],
                                          "scenario": scen, "keep": r,
                                          "kvpress": "kvzip-layer with kvc's count (its own "
                                          "per-chunk scores)", "kvc": tmpl,
                                          "overlap": e_mean, "identical": e_same,
                                          "min": e_worst})
                        elif tmpl.startswith("kvzip:{r},ada=0"):
                            with_lse = "stats=1" in tmpl
                            e_mean, e_same, e_worst = compare(
                                kvzip_as_kvc_sets(recon, lin32, r, lse=with_lse), b)
                            lines.append({"check": "explained", "doc": d["id"],
                                          "scenario": scen, "keep": r,
                                          "kvpress": "kvzip-layer with kvc's count, every query "
                                          "of the pass " + ("with their log-masses" if with_lse
                                                            else "over the context keys only"),
                                          "kvc": tmpl,
                                          "overlap": e_mean, "identical": e_same,
                                          "min": e_worst})
                        if tmpl == "expected:{r},stats=1,horizon=512,veps=0":
                            e_mean, e_same, e_worst = compare(
                                expected_as_kvc_sets(press, shadow, lin32), b)
                            lines.append({"check": "explained", "doc": d["id"],
                                          "scenario": scen, "keep": r,
                                          "kvpress": "expected, kvc's sink handling",
                                          "kvc": tmpl, "overlap": e_mean,
                                          "identical": e_same, "min": e_worst})
                        if "think" in pname:
                            ca = [pruned_channels(k, m) for k, _, m in prow.layers]
                            cb = [pruned_channels(k, m, recent=32) for k, _, m in krow.layers]
                            line["channels_overlap"], line["channels_identical"], _ = \
                                compare(ca, cb)
                        lines.append(line)
                        print(json.dumps(line), flush=True)
    agg = {}
    for ln in lines:
        key = (ln["check"], ln["kvpress"], ln["kvc"], ln["scenario"], ln["keep"])
        agg.setdefault(key, []).append(ln)
    table = ["| check | kvpress | kvc | scenario | keep | mean overlap | identical (layer, head) "
             "sets | worst overlap | gap (max) | edge | channels (ThinK) |", "|" + "---|" * 11]
    for (check, p, k, scen, keep), ls in sorted(agg.items()):
        ch = ""
        if "channels_overlap" in ls[0]:
            ch = f"{sum(x['channels_overlap'] for x in ls) / len(ls):.3f} overlap, " \
                 f"{sum(x['channels_identical'] for x in ls) / len(ls):.2f} identical"
        gaps = [x["gap"] for x in ls if x.get("gap") is not None]
        edges = [x["edge"] for x in ls if x.get("edge") is not None]
        gap = f"{max(gaps):.1e}" if gaps else ""
        edge = f"{sum(edges) / len(edges):.2f}" if edges else ""
        table.append(f"| {check} | {p} | `{k}` | {scen} | {keep:g} | "
                     f"{sum(x['overlap'] for x in ls) / len(ls):.4f} | "
                     f"{sum(x['identical'] for x in ls) / len(ls):.3f} | "
                     f"{min(x['min'] for x in ls):.3f} | {gap} | {edge} | {ch} |")
    with open(os.path.join(args.out, "parity.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    with open(os.path.join(args.out, "parity.json"), "w") as f:
        json.dump(lines, f, indent=1)
    print("\n".join(table))


if __name__ == "__main__":
    main()

"""Where a KVzip selection spends its budget, head by head, and which heads retrieve.

    python -m kvc.bench.heads [--model DIR] [--docs 40] [--seed 11] [--keep 0.1] [--top 16]
        [--ablate 10] [--variants plain,merge=0.9,...] [--out results.csv]

Three measurements on one model (docs/fidelity-smollm2.md, "Where KVzip's budget goes"):

- **Induction score** of every KV head, computed once per model and independent of any task
  (the retrieval-head test of RazorAttention, Tang et al., 2024): random tokens repeated twice;
  a head's score is the mean attention the second copy's tokens give to the token that followed
  their first occurrence, the largest over the group's query heads. Heads that copy from context
  score near 1, the others near 0.
- **Budget share**: on multi-key documents (the side-by-side harness's generator and seed), the
  tokens each KV head keeps under KVzipPress's selection over all layers and heads (on the mean
  of each token's `top` largest reconstruction probabilities: kvcd's `kvzip ... top=K`), and
  whether the asked needle's first digit is among them in the induction heads.
- **Ablation** (`--ablate N`, on the first N documents the full cache answers): the drop in the
  log-probability of the answer's first digit when the asked needle's tokens (or only that
  digit) are removed from one head at a time, the rest of the full cache intact.
- **Variants** (`--variants`): the same selection with each KV head's scores weighted before it,
  scored as the harness scores multi-key (exact match of the answer, teacher-forced): `plain`;
  `boost=F`, every score of a head times 1 + F x its induction score; `damp=F`, divided by it
  (less budget for the retrieving heads, their own ranking unchanged); `cap=C`, no head keeps
  more than C x keep x S tokens (its best by score); `ask`, the asked needle's tokens kept in
  every head (an oracle); `needles`, every needle's tokens kept in every head (an oracle);
  `merge=T`, the plain selection with each evicted entry's value merged into the kept entry of
  the same head whose key is most similar (cosine), when that similarity is at least T: the kept
  value becomes (v + sum of c x v_evicted) / (1 + sum of c), c the similarity (the keys, and
  so where attention goes, unchanged; D2O-style merging, Wan et al., 2024).
"""

import argparse
import math
import re
import sys

import torch


def induction_scores(model, n=200, trials=4, seed=0, low=1000, high=None):
    """[L, Hq] mean attention from each token of a repeated random sequence to the token after
    its first occurrence, per query head (the model must return attention probabilities: eager
    attention). Token ids are drawn from [low, high) (default: the vocabulary's end)."""
    high = high or model.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    out = None
    for _ in range(trials):
        r = torch.randint(low, high, (n,), generator=g)
        with torch.no_grad():
            att = model(torch.cat([r, r]).unsqueeze(0), output_attentions=True).attentions
        i = torch.arange(n + 1, 2 * n)
        s = torch.stack([a[0][:, i, i - n + 1].mean(-1) for a in att])  # [L, Hq]
        out = s if out is None else out + s
    return out / trials


def kv_head_scores(scores_q, kv_heads):
    """[L, Hkv]: the largest score over each KV head's group of query heads."""
    L, hq = scores_q.shape
    return scores_q.reshape(L, kv_heads, hq // kv_heads).amax(-1)


def head_shares(valid):
    """[L, Hkv] fraction of each head's tokens a selection keeps (valid: per layer [Hkv, S])."""
    return torch.stack([m.float().mean(-1) for m in valid])


def budget_held(valid, heads):
    """Fraction of all kept entries that the (layer, head) pairs in `heads` hold."""
    total = sum(int(m.sum()) for m in valid)
    return sum(int(valid[l][h].sum()) for l, h in heads) / max(total, 1)


def needle_spans(tok, ids):
    """{word: (needle token indices, word's, number's)} of the multi-key needles in `ids`."""
    text = tok.decode(ids)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != list(ids):
        raise ValueError("the context does not round-trip through the tokenizer")
    om = enc["offset_mapping"]

    def covering(a0, b0):
        return [i for i, (a, b) in enumerate(om) if a < b0 and b > a0]

    return {m.group(1): (covering(m.start(), m.end()), covering(m.start(1), m.end(1)),
                         covering(m.start(2), m.end(2)))
            for m in re.finditer(r"The special magic number for (\w+) is (\d+)\.", text)}


def parse_variant(name):
    """(kind, number) of a --variants entry: plain, ask and needles take no number (None);
    boost=F and damp=F a finite F >= 0, cap=C a finite C > 0, merge=T a T in [0, 1]. ValueError
    names what is wrong."""
    kind, eq, arg = name.partition("=")
    if not eq and kind in ("plain", "ask", "needles"):
        return kind, None
    if eq and kind in ("boost", "damp", "cap", "merge"):
        try:
            x = float(arg)
        except ValueError:
            x = math.nan
        if kind == "merge":
            if 0 <= x <= 1:
                return kind, x
            raise ValueError(f"--variants: {name!r} needs a cosine threshold T in [0, 1]")
        if math.isfinite(x) and (x > 0 or (x == 0 and kind != "cap")):
            return kind, x
        raise ValueError(f"--variants: {name!r} needs a number (boost=F and damp=F with F >= 0, "
                         "cap=C with C > 0)")
    raise ValueError(f"--variants: unknown variant {name!r} (plain, boost=F, damp=F, cap=C, "
                     "merge=T, ask, needles)")


def variant_weights(name, scores, ind, spans, ask, keep):
    """(weights, bonus) of variant `name` (see the module doc): per layer [Hkv, S] factors the
    selection multiplies the scores [L, 1, Hkv, S] by, and amounts it adds after (None: none)."""
    kind, x = parse_variant(name)
    L, _, hkv, S = scores.shape
    if kind in ("plain", "merge"):
        return None, None
    if kind in ("boost", "damp"):
        factor = [1 + x * ind[l] for l in range(L)]  # [Hkv] per layer
        if kind == "damp":
            factor = [1 / f for f in factor]
        return [f.unsqueeze(-1).expand(hkv, S).clone() for f in factor], None
    if kind == "cap":
        cap = int(x * keep * S)
        rank = scores[:, 0].argsort(-1, descending=True).argsort(-1)  # [L, Hkv, S]
        return [(rank[l] < cap).float() for l in range(L)], None
    pos = spans[ask][0] if kind == "ask" else sorted(i for t, _, _ in spans.values() for i in t)
    b = torch.zeros(hkv, S)
    b[:, pos] = 1e3  # above any probability: kept unless the budget runs out
    return None, [b] * L


def merge_values(keys, values, valid, threshold):
    """Values [Hkv, S, D] with each evicted entry (valid False) merged into the kept entry of its
    head whose key has the largest cosine similarity c with its own, where c >= threshold: a
    kept value v becomes (v + sum c_j v_j) / (1 + sum c_j) over the entries merged into it.
    Kept entries' keys and evicted entries' values are left as they are (the latter unused)."""
    out = values.clone()
    kn = torch.nn.functional.normalize(keys.float(), dim=-1)
    for h in range(keys.shape[0]):
        kept = valid[h].nonzero().flatten()
        gone = (~valid[h]).nonzero().flatten()
        if kept.numel() == 0 or gone.numel() == 0:
            continue
        sim = kn[h, gone] @ kn[h, kept].T  # [evicted, kept]
        c, to = sim.max(-1)
        take = c >= threshold
        if not bool(take.any()):
            continue
        c, to, src = c[take], to[take], gone[take]
        w = c.unsqueeze(-1).to(values.dtype)
        num = values[h, kept].clone()
        den = torch.ones(kept.numel(), 1, dtype=values.dtype)
        num.index_add_(0, to, w * values[h, src])
        den.index_add_(0, to, w)
        out[h, kept] = num / den
    return out


def _ablation(M, model, doc, lin, spans):
    """[2, L, Hkv] log-probability drops of the answer's first digit (needle, digit) or None
    when the full cache does not answer the document."""
    p, qs, ans = doc["prompt"], doc["question_start"], doc["answer"]
    seq = p[qs:] + ans[:-1]
    full = M.full_cache(lin)
    lg = M.forward_rows(model, [full], seq, qs, len(ans))
    if lg[0].argmax(-1).tolist() != ans:
        return None
    # ans[1]: the number's first digit (SmolLM2 gives " 12345" as " " and one token a digit)
    base = torch.log_softmax(lg[0, 1], -1)[ans[1]]
    every, _, digits = spans[doc["meta"]["key"]]
    L, hkv = len(lin), lin[0].keys.shape[1]
    out = torch.zeros(2, L, hkv)
    for mode, pos in enumerate((every, digits[:1])):
        rows = []
        for l in range(L):
            for h in range(hkv):
                layers = []
                for li, (k, v, m) in enumerate(full.layers):
                    if li == l:
                        m = m.clone()
                        m[h, pos] = False
                    layers.append((k, v, m))
                rows.append(M.RowCache(layers))
        lgs = torch.cat([M.forward_rows(model, rows[i:i + 30], seq, qs, len(ans))
                         for i in range(0, len(rows), 30)])
        out[mode] = (base - torch.log_softmax(lgs[:, 1], -1)[:, ans[1]]).reshape(L, hkv)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m kvc.bench.heads",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="SmolLM2 directory (default: kvc-smollm2's)")
    ap.add_argument("--docs", type=int, default=40, help="multi-key documents")
    ap.add_argument("--seed", type=int, default=11, help="documents' seed (the harness's)")
    ap.add_argument("--length", type=int, default=1000, help="context tokens")
    ap.add_argument("--keep", type=float, default=0.1)
    ap.add_argument("--top", type=int, default=16, help="kvzip top=K (1: KVzipPress's score)")
    ap.add_argument("--min-induction", type=float, default=0.1,
                    help="induction score from which a head is listed as retrieving")
    ap.add_argument("--ablate", type=int, default=0, help="documents for the ablation table")
    ap.add_argument("--variants", default="",
                    help="comma-separated selections to score: plain, boost=F, damp=F, cap=C, "
                    "merge=T, ask, needles")
    ap.add_argument("--out", default=None,
                    help="CSV of the variants' per-document results (document, row, correct)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not 0 < args.keep < 1 or args.top < 1 or args.docs < 1:
        ap.error("--keep must be in (0, 1), --top and --docs at least 1")
    variants = [v for v in args.variants.split(",") if v]
    try:
        parsed = [parse_variant(v) for v in variants]  # (kind, number)
    except ValueError as e:
        ap.error(str(e))

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    from . import model as M, presses as P, recon as R, sidebyside as SB
    from kvc.models import smollm2
    model_dir = args.model or str(smollm2.default_dir())
    tok, model, shadow = M.load(model_dir, threads=args.threads)
    eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    hkv = model.config.num_key_value_heads
    ind = kv_head_scores(induction_scores(eager), hkv)
    del eager
    heads = [(l, h) for l in range(ind.shape[0]) for h in range(hkv)
             if ind[l, h] >= args.min_induction]
    heads.sort(key=lambda lh: -float(ind[lh]))
    print(f"induction heads (score >= {args.min_induction}), layer.head:score:",
          " ".join(f"{l}.{h}:{float(ind[l, h]):.2f}" for l, h in heads))

    docs = SB.build_docs(tok, f"multikey:{args.docs}", args.length, args.seed, 64)
    share_sum, held, kept_digit, n_abl = 0, [], torch.zeros(len(heads)), 0
    abl = torch.zeros(2, ind.shape[0], hkv)
    per_doc = []  # per document: 1/0 for the full cache and each variant
    for i, d in enumerate(docs):
        print(f"[{i + 1}/{len(docs)}] {d['id']}", file=sys.stderr, flush=True)
        p, qs = d["prompt"], d["question_start"]
        capture = M.Capture(model, p[:-1])
        lin, ids = capture.prefix(qs), p[:qs]
        rec = R.Reconstruction(tok, shadow, ids, P.fp32_layers(lin))
        valid = rec.kvpress_valid(shadow, args.keep, False, top=args.top)
        share_sum = share_sum + head_shares(valid)
        held.append(budget_held(valid, heads))
        spans = needle_spans(tok, ids)
        digit = spans[d["meta"]["key"]][2][0]
        kept_digit += torch.tensor([float(valid[l][h, digit]) for l, h in heads])
        if variants:
            scores = rec.top_scores(args.top) if args.top > 1 else rec.scores
            rows = [M.full_cache(lin)]
            for v, (kind, t) in zip(variants, parsed):
                w, b = variant_weights(v, scores, ind, spans, d["meta"]["key"], args.keep)
                m = valid if w is None and b is None else rec.kvpress_valid(
                    shadow, args.keep, False, weights=w, top=args.top, bonus=b)
                rows.append(M.RowCache([
                    (x.keys[0], merge_values(x.keys[0], x.values[0], k, t) if kind == "merge"
                     else x.values[0], k) for x, k in zip(lin, m)]))
            ans = d["answer"]
            pred = M.forward_rows(model, rows, p[qs:] + ans[:-1], qs, len(ans)).argmax(-1)
            per_doc.append([float(pred[j].tolist() == ans) for j in range(len(rows))])
        if n_abl < args.ablate:
            a = _ablation(M, model, d, lin, spans)
            if a is not None:
                abl += a
                n_abl += 1
    share = share_sum / len(docs)
    print(f"\n{len(docs)} documents, keep {args.keep}, top={args.top}: the induction heads "
          f"({len(heads)} of {share.numel()}) hold {sum(held) / len(held):.2f} of the kept "
          f"entries (min {min(held):.2f}, max {max(held):.2f})")
    print("head  induction  share kept  asked first digit kept")
    for (l, h), k in zip(heads, kept_digit.tolist()):
        print(f"{l:>2}.{h}   {float(ind[l, h]):9.2f}  {float(share[l, h]):10.2f}  "
              f"{k / len(docs):.2f}")
    others = [float(share[l, h]) for l in range(share.shape[0]) for h in range(hkv)
              if (l, h) not in heads]
    if others:
        print(f"other heads: mean share kept {sum(others) / len(others):.3f}")
    if variants:
        print(f"\nexact match on {len(docs)} documents (keep {args.keep}, top={args.top}):")
        correct = [sum(r[j] for r in per_doc) for j in range(1 + len(variants))]
        for name, c in zip(["full cache"] + variants, correct):
            print(f"  {name:14s} {c / len(docs):.2f} ({int(c)}/{len(docs)})")
        if args.out:
            import csv
            with open(args.out, "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["document", "row", "correct"])
                for d, r in zip(docs, per_doc):
                    for name, hit in zip(["full cache"] + variants, r):
                        w.writerow([d["id"], name, int(hit)])
        from .goals import paired
        base = {i: r[1] for i, r in enumerate(per_doc)}
        for j, name in enumerate(variants[1:], start=2):
            diff, (lo, hi), _ = paired({i: r[j] for i, r in enumerate(per_doc)}, base)
            print(f"  {name} - {variants[0]}: {diff:+.2f} [{lo:+.2f}, {hi:+.2f}] (paired, "
                  f"bootstrap 95%; {sum(r[j] > r[1] for r in per_doc)} documents gained, "
                  f"{sum(r[j] < r[1] for r in per_doc)} lost)")
    if args.ablate:
        print(f"\nablation on {n_abl} documents the full cache answers: mean drop of the "
              "first digit's log-probability (heads with a drop >= 0.05)")
        print("head  needle removed  digit removed")
        for l in range(abl.shape[1]):
            for h in range(hkv):
                a = abl[:, l, h] / max(n_abl, 1)
                if a.max() >= 0.05:
                    print(f"{l:>2}.{h}   {float(a[0]):14.2f}  {float(a[1]):13.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

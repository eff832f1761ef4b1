"""kvc-qstats: query statistics of a model, for the query-free use of expected attention and ThinK.

vLLM gives a KV connector no attention queries. kvcd's expected attention can score tokens from
query statistics instead (TENSOR_Q_STATS: per query head the mean and covariance of the
un-rotated queries), and ThinK's channel score reads only mean_t q_c^2 of the (rotated) queries.
This tool measures both once on calibration text with transformers and writes them to a file
that KvcConnector ("query_stats" in kv_connector_extra_config) and kvc's own Python flow read:

    kvc-qstats --model DIR --text FILE [--text FILE...] [--max-tokens 4096] --out stats.npz

The file (numpy .npz) holds q_stats float32 [layers, q_heads, D + D*D] (mean, then covariance,
row-major), q_sq float32 [layers, q_heads, D] (mean of the squared rotated queries), and meta (a
JSON string: model fingerprint, tokens, shape). `load` checks it against the serving model.
"""

import argparse
import json
import sys

import numpy as np

from .model import fingerprint, head_dim_of
from .spec import SpecError


class QueryStats:
    def __init__(self, q_stats, q_sq, meta):
        self.q_stats, self.q_sq, self.meta = q_stats, q_sq, meta

    def think_rows(self, layer, num_kv_heads):
        """The synthetic observation window for ThinK: one row per query head whose squares are
        mean_t q_c^2, as NHD [1, q_heads, D] (W = 1)."""
        return np.sqrt(np.maximum(self.q_sq[layer], 0.0))[None, :, :]


def load(path, *, num_layers, num_q_heads, head_dim, model_fingerprint):
    """Reads a kvc-qstats file and checks it fits the model (SpecError otherwise)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            q_stats, q_sq, meta = f["q_stats"], f["q_sq"], json.loads(str(f["meta"]))
    except (OSError, KeyError, ValueError) as e:
        raise SpecError(f"query_stats: cannot read {path}: {e}")
    want = (num_layers, num_q_heads, head_dim + head_dim * head_dim)
    if q_stats.shape != want or q_sq.shape != want[:2] + (head_dim,):
        raise SpecError(f"query_stats: {path} holds shapes {q_stats.shape} / {q_sq.shape}, the "
                        f"model needs {want} / {want[:2] + (head_dim,)}")
    if meta.get("fingerprint") != model_fingerprint:
        raise SpecError(f"query_stats: {path} was measured on model {meta.get('fingerprint')}, "
                        f"this instance serves {model_fingerprint}")
    if not (np.isfinite(q_stats).all() and np.isfinite(q_sq).all()):
        raise SpecError(f"query_stats: {path} holds non-finite values")
    return QueryStats(q_stats.astype(np.float32), q_sq.astype(np.float32), meta)


def measure(model_dir, texts, max_tokens=4096, dtype="float32"):
    """(q_stats, q_sq, meta) of a Hugging Face Llama-family model over `texts`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama import modeling_llama

    cfg = AutoConfig.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()
    L, Hq, D = cfg.num_hidden_layers, cfg.num_attention_heads, head_dim_of(cfg)
    sums = np.zeros((L, Hq, D), np.float64)
    outer = np.zeros((L, Hq, D, D), np.float64)
    sq = np.zeros((L, Hq, D), np.float64)
    count = 0
    captured = {}

    def hook(layer):
        def fn(module, args, out):
            captured[layer] = out.detach()
        return fn
    handles = [blk.self_attn.q_proj.register_forward_hook(hook(i))
               for i, blk in enumerate(model.model.layers)]
    try:
        for text in texts:
            ids = tok(text, return_tensors="pt").input_ids[:, :max_tokens]
            T = ids.shape[1]
            if T < 2:
                continue
            with torch.no_grad():
                model(ids)
                pos = torch.arange(T)[None]
                cos, sin = model.model.rotary_emb(captured[0], pos)
            for layer in range(L):
                q = captured[layer].view(1, T, Hq, D).transpose(1, 2).float()  # [1, Hq, T, D]
                qr, _ = modeling_llama.apply_rotary_pos_emb(q, q, cos, sin)
                qn = q[0].double().numpy()
                sums[layer] += qn.sum(axis=1)
                outer[layer] += np.einsum("htd,hte->hde", qn, qn)
                sq[layer] += (qr[0].double().numpy() ** 2).sum(axis=1)
            count += T
    finally:
        for h in handles:
            h.remove()
    if count == 0:
        raise SpecError("kvc-qstats: no calibration tokens (texts empty or one token each)")
    mean = sums / count
    cov = outer / count - np.einsum("lhd,lhe->lhde", mean, mean)
    q_stats = np.concatenate([mean, cov.reshape(L, Hq, D * D)], axis=2).astype(np.float32)
    meta = {"fingerprint": fingerprint(cfg, model_dir), "tokens": count, "layers": L,
            "q_heads": Hq, "head_dim": D}
    return q_stats, (sq / count).astype(np.float32), meta


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvc-qstats", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face model directory")
    ap.add_argument("--text", action="append", required=True, help="calibration text file")
    ap.add_argument("--max-tokens", type=int, default=4096, help="tokens read per text file")
    ap.add_argument("--out", required=True, help="output .npz file")
    args = ap.parse_args(argv)
    texts = []
    for path in args.text:
        with open(path, encoding="utf-8", errors="replace") as f:
            texts.append(f.read())
    q_stats, q_sq, meta = measure(args.model, texts, args.max_tokens)
    with open(args.out, "wb") as f:
        np.savez(f, q_stats=q_stats, q_sq=q_sq, meta=np.array(json.dumps(meta)))
    print(f"kvc-qstats: {args.out}: {meta['tokens']} tokens, {meta['layers']} layers, "
          f"fingerprint {meta['fingerprint']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

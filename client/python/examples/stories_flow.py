"""Prefill -> kvcd -> paged decode, end to end, on a llama2.c model in torch.

The flow a vLLM/SGLang connector takes, without the engine: the prefill side runs the prompt,
captures each layer's K, V (post-RoPE) and its last W queries and pushes them to kvcd with
compression on; the decode side fetches the engine-ready cache (kept tokens re-rotated into slots
0..K-1), scatters it into a paged block table (block size 16, NHD or HND) and decodes the
continuation at positions K, K+1, ... with plain paged attention. Reports top-1 agreement and KL
against decoding with the full cache, the numbers kvcfidelity reports for the same spec.

    PYTHONPATH=client/python:build/python:client/python/examples python3 \\
        client/python/examples/stories_flow.py --kvcd 127.0.0.1:50051 \\
        --model ../shared/models/stories260K.bin --policy snapkv --keep_ratio 0.5
"""

import argparse
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kvc  # noqa: E402
from kvc import paged  # noqa: E402
from llama2c import Llama2c  # noqa: E402

ROPE = {"theta": 10000, "style": "ROPE_INTERLEAVED"}  # llama2.c's convention


def prefill_and_push(client, model, cache_id, prompt, window, compression):
    """Prefill side: run the prompt, push K, V and the last `window` queries of every layer."""
    _, layers = model.prefill(prompt)
    return client.put(cache_id, [(k, v, q[:, len(prompt) - window:]) for q, k, v in layers],
                      compression=compression, overwrite=True)


def decode_from_kvcd(client, model, cache_id, continuation, layout, block_size=16):
    """Decode side: fetch into paged blocks, decode `continuation` teacher-forced.

    Returns logits [len(continuation), vocab] and K (the kept tokens per head)."""
    cache = paged.PagedKvCache(model.n_layers, num_blocks=64, num_kv_heads=model.n_kv_heads,
                               head_dim=model.head_dim, block_size=block_size, layout=layout)
    table, kept, _ = paged.fetch_into_blocks(client, cache_id, cache, ROPE,
                                             extra_slots=len(continuation))
    out = []
    for t, token in enumerate(continuation):
        pos = kept + t  # a stock engine's position: the number of cached tokens

        def attend(layer, q, k, v):
            cache.write_slots(layer, table, pos, k[:, None], v[:, None])
            return paged.paged_attention(cache, layer, table, pos + 1, q)
        out.append(model.decode_step(token, pos, attend))
    cache.allocator.free(table)
    return torch.stack(out), kept


def compare(ref_logits, logits):
    """(top-1 agreement, mean KL(ref || ours), steps) as kvcfidelity computes them."""
    ref = torch.log_softmax(ref_logits.double(), -1)
    ours = torch.log_softmax(logits.double(), -1)
    kl = (ref.exp() * (ref - ours)).sum(-1).clamp(min=0)
    agree = (ref_logits.argmax(-1) == logits.argmax(-1)).double()
    return float(agree.mean()), float(kl.mean()), len(kl)


def run(client, model, sequences, prefix, window, compression, layout, id_prefix="flow"):
    """Per sequence: full-cache reference, push, fetch, paged decode; metrics over all steps."""
    refs, ours, kept = [], [], []
    for i, seq in enumerate(sequences):
        # Decoding token seq[p] at position p predicts seq[p + 1]: the full pass's row p.
        full_logits, _ = model.prefill(seq)
        refs.append(full_logits[prefix:])
        cache_id = f"{id_prefix}/{i}"
        prefill_and_push(client, model, cache_id, seq[:prefix], window, compression)
        logits, k = decode_from_kvcd(client, model, cache_id, seq[prefix:], layout)
        ours.append(logits)
        kept.append(k)
        client.delete(cache_id)
    top1, kl, steps = compare(torch.cat(refs), torch.cat(ours))
    return {"top1_agreement": top1, "mean_kl": kl, "steps": steps, "kept": kept}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvcd", default="127.0.0.1:50051")
    ap.add_argument("--model", default=os.path.join("..", "shared", "models", "stories260K.bin"))
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--keep_ratio", type=float, default=0.5)
    ap.add_argument("--prefix", type=int, default=96)
    ap.add_argument("--continuation", type=int, default=16)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--layout", choices=["NHD", "HND"], default="NHD")
    ap.add_argument("--tokens", help="file of token sequences (kvcfidelity --dump_sequences); "
                    "default: greedy continuations of BOS")
    args = ap.parse_args()
    model = Llama2c(args.model)
    n = args.prefix + args.continuation
    if args.tokens:
        sequences = [[int(x) for x in line.split()] for line in open(args.tokens) if line.strip()]
    else:
        seq = [1]
        while len(seq) < n:
            logits, _ = model.prefill(seq)
            seq.append(int(logits[-1].argmax()))
        sequences = [seq]
    compression = {"eviction": {"policy": args.policy, "keep_ratio": args.keep_ratio}}
    with kvc.Client(args.kvcd) as client:
        r = run(client, model, sequences, args.prefix, args.window, compression, args.layout)
    print(f"{args.policy}@{args.keep_ratio:.2f} {args.layout}: kept {r['kept'][0]} of "
          f"{args.prefix}, top-1 agreement {r['top1_agreement']:.4f}, mean KL "
          f"{r['mean_kl']:.6e} over {r['steps']} steps")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()

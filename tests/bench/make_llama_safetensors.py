#!/usr/bin/env python3
"""Writes a synthetic Llama-3-8B-shaped KV cache as safetensors for kvcctl put.

Usage: make_llama_safetensors.py TOKENS LAYERS OUT.safetensors

Per layer: layer.{l}.k and layer.{l}.v [8, TOKENS, 128] and layer.{l}.q_obs [32, 32, 128], fp16,
Gaussian values (seeded). Compressed sizes depend only on the shape and the spec, not the values.
"""
import json
import random
import struct
import sys

KV_HEADS, Q_HEADS, HEAD_DIM, WINDOW = 8, 32, 128, 32


def main():
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    tokens, layers, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    rnd = random.Random(1)
    header, blobs, offset = {}, [], 0
    for layer in range(layers):
        for name, shape in (("k", [KV_HEADS, tokens, HEAD_DIM]), ("v", [KV_HEADS, tokens, HEAD_DIM]),
                            ("q_obs", [Q_HEADS, WINDOW, HEAD_DIM])):
            count = shape[0] * shape[1] * shape[2]
            data = struct.pack("<%de" % count, *(rnd.gauss(0.0, 1.0) for _ in range(count)))
            header[f"layer.{layer}.{name}"] = {"dtype": "F16", "shape": shape,
                                               "data_offsets": [offset, offset + len(data)]}
            blobs.append(data)
            offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for data in blobs:
            f.write(data)


if __name__ == "__main__":
    main()

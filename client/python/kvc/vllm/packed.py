"""Reading kvc's compact layer blob (GetCache FORMAT_PACKED) into dense keys and values.

A full-length cache (every token kept, quantized and/or with pruned key channels) travels as
its compact bytes, 2-4x smaller than the dense cache, and is expanded here on the decode node:
dequantized (code * scale + zero in float32, as kvcd does), pruned channels zero, the recent
full-precision block appended. The format is kernels/core/include/kvc/compact.h (little-endian;
a 64-byte LayerHeader, one 32-byte HeadDesc per KV head, then per head its 16-byte aligned
blocks: positions, key_idx, value_idx, old keys (or scales, zeros, codes), recent keys, old
values (or scales, zeros, codes), recent values). Every size is checked against the blob, so a
corrupt blob raises ValueError, never reads out of bounds.
"""

import struct

import numpy as np
import torch

MAGIC, VERSION = 0x4C43564B, 1
_HEADER = struct.Struct("<IHBBiiiiiBB34x")
_DESC = struct.Struct("<iiiiQQ")
_DTYPES = {0: (torch.float32, 4), 1: (torch.float16, 2), 2: (torch.bfloat16, 2)}
_ALIGN = 16


def _align(x):
    return (x + _ALIGN - 1) & ~(_ALIGN - 1)


def _groups(n, g):
    return 0 if n <= 0 else 1 + (n - 1) // g


class _Section:
    def __init__(self, blob, start, size):
        self.blob, self.start, self.end, self.off = blob, start, start + size, 0

    def take(self, nbytes):
        at = self.start + self.off
        if at + nbytes > self.end:
            raise ValueError(f"compact layer: head section overruns its {self.end - self.start} "
                             f"bytes")
        self.off = _align(self.off + nbytes)
        return self.blob[at:at + nbytes]


def _codes(raw, rows, t, bits):
    """uint8 [rows, ceil(t*bits/8)] -> float32 [rows, t] codes (element 0 in the lowest bits)."""
    rb = (t * bits + 7) // 8
    a = np.frombuffer(raw, np.uint8).reshape(rows, rb)
    if bits == 8:
        return a[:, :t].astype(np.float32)
    b = np.unpackbits(a, axis=1, bitorder="little").reshape(rows, rb * 8 // bits, bits)
    weights = (1 << np.arange(bits, dtype=np.uint8)).astype(np.float32)
    return (b.astype(np.float32) @ weights)[:, :t]


def _tensor(raw, dtype, esz, shape):
    n = int(np.prod(shape))
    if len(raw) != n * esz:
        raise ValueError("compact layer: block size mismatch")
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(bytearray(raw), dtype=dtype).view(*shape)


def unpack_layer(blob):
    """(k, v, positions) of one compact layer: k, v torch [H, n, D] in the cache's dtype (pruned
    channels zero, quantized blocks dequantized), positions int32 numpy [H, n]. All heads must
    keep the same count n (ValueError otherwise)."""
    blob = bytes(memoryview(blob).cast("B"))
    if len(blob) < _HEADER.size:
        raise ValueError("compact layer: shorter than its header")
    magic, version, dt, bits, _, H, D, seq_len, G, _, _ = _HEADER.unpack_from(blob, 0)
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"compact layer: magic {magic:#x} version {version}, expected "
                         f"{MAGIC:#x} {VERSION}")
    if dt not in _DTYPES or bits not in (0, 2, 4, 8) or not 1 <= H <= 1024 or not 1 <= D <= 512:
        raise ValueError(f"compact layer: dtype {dt}, bits {bits}, heads {H}, head_dim {D}")
    if bits and G < 1:
        raise ValueError(f"compact layer: quant group {G}")
    dtype, esz = _DTYPES[dt]
    if len(blob) < _HEADER.size + H * _DESC.size:
        raise ValueError("compact layer: shorter than its head table")
    ks, vs, ps = [], [], []
    for h in range(H):
        n, r, tk, tv, off, size = _DESC.unpack_from(blob, _HEADER.size + h * _DESC.size)
        if not (0 <= r <= n <= seq_len and 1 <= tk <= D and 1 <= tv <= D) or \
                off + size > len(blob):
            raise ValueError(f"compact layer: head {h} descriptor out of range")
        if ks and n != ks[0].shape[0]:
            raise ValueError("compact layer: heads keep different token counts")
        sec = _Section(blob, off, size)
        m = n - r
        pos = np.frombuffer(sec.take(4 * n), np.int32)
        kidx = np.frombuffer(sec.take(4 * tk), np.int32).astype(np.int64)
        vidx = np.frombuffer(sec.take(4 * tv), np.int32).astype(np.int64)
        if (kidx >= D).any() or (vidx >= D).any() or (kidx < 0).any() or (vidx < 0).any():
            raise ValueError(f"compact layer: head {h} channel index out of range")
        k = torch.zeros(n, D, dtype=dtype)
        v = torch.zeros(n, D, dtype=dtype)
        if bits == 0:
            k[:m, kidx] = _tensor(sec.take(m * tk * esz), dtype, esz, (m, tk))
        else:
            g = _groups(m, G)
            scale = np.frombuffer(sec.take(4 * g * tk), np.float32).reshape(g, tk)
            zero = np.frombuffer(sec.take(4 * g * tk), np.float32).reshape(g, tk)
            codes = _codes(sec.take(m * ((tk * bits + 7) // 8)), m, tk, bits)
            rows = np.arange(m) // G
            k[:m, kidx] = torch.from_numpy(codes * scale[rows] + zero[rows]).to(dtype)
        k[m:] = _tensor(sec.take(r * D * esz), dtype, esz, (r, D))
        if bits == 0:
            v[:m, vidx] = _tensor(sec.take(m * tv * esz), dtype, esz, (m, tv))
        else:
            g = _groups(tv, G)
            scale = np.frombuffer(sec.take(4 * m * g), np.float32).reshape(m, g)
            zero = np.frombuffer(sec.take(4 * m * g), np.float32).reshape(m, g)
            codes = _codes(sec.take(m * ((tv * bits + 7) // 8)), m, tv, bits)
            cols = np.arange(tv) // G
            v[:m, vidx] = torch.from_numpy(codes * scale[:, cols] + zero[:, cols]).to(dtype)
        v[m:] = _tensor(sec.take(r * D * esz), dtype, esz, (r, D))
        ks.append(k)
        vs.append(v)
        ps.append(pos)
    return torch.stack(ks), torch.stack(vs), np.stack(ps)

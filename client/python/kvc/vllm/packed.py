"""Reading kvc's compact layer blob (GetCache FORMAT_PACKED) into dense keys and values.

A full-length cache (every token kept, quantized and/or with pruned key channels) travels as
its compact bytes, 2-4x smaller than the dense cache, and is expanded here on the decode node:
dequantized (code * scale + zero in float32, as kvcd does), pruned channels zero, the recent
full-precision block appended. The format is kernels/core/include/kvc/compact.h (little-endian;
a 64-byte LayerHeader, one 32-byte HeadDesc per KV head, then per head its 16-byte aligned
blocks: positions, key_idx, value_idx, old keys (or scales, zeros, codes), recent keys, old
values (or scales, zeros, codes), recent values). Version 2 blobs give the values their own
bits (the header byte after channel_policy). Every size is checked against the blob, so a
corrupt blob raises ValueError, never reads out of bounds.
"""

import struct
import warnings

import numpy as np
import torch

MAGIC, VERSIONS = 0x4C43564B, (1, 2)  # 2: the values' bits differ from the keys'
_HEADER = struct.Struct("<IHBBiiiiiBBB33x")
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
    """uint8 [rows, ceil(t*bits/8)] -> uint8 [rows, t] codes (element 0 in the lowest bits)."""
    rb = (t * bits + 7) // 8
    a = np.frombuffer(raw, np.uint8).reshape(rows, rb)
    if bits == 8:
        return a[:, :t]
    per, mask = 8 // bits, (1 << bits) - 1
    out = np.empty((rows, rb, per), np.uint8)
    for j in range(per):
        np.bitwise_and(np.right_shift(a, j * bits), mask, out=out[:, :, j])
    return out.reshape(rows, rb * per)[:, :t]


def _tensor(raw, dtype, esz, shape):
    n = int(np.prod(shape))
    if len(raw) != n * esz:
        raise ValueError("compact layer: block size mismatch")
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    with warnings.catch_warnings():  # read-only source: only copied from
        warnings.simplefilter("ignore")
        return torch.frombuffer(raw, dtype=dtype).view(*shape)


def _dequant(codes, scale, zero, group, per_row, out):
    """out[i, c] = codes[i, c] * scale + zero (float32), the group's scale/zero: per_row (keys,
    groups of `group` rows per channel) or per column (values, groups of `group` channels)."""
    m, t = codes.shape
    if per_row:
        full = (m // group) * group
        if full:
            c3, o3 = codes[:full].reshape(-1, group, t), out[:full].reshape(-1, group, t)
            np.multiply(c3, scale[:full // group, None, :], out=o3)
            np.add(o3, zero[:full // group, None, :], out=o3)
        if full < m:
            np.multiply(codes[full:], scale[full // group], out=out[full:])
            np.add(out[full:], zero[full // group], out=out[full:])
    elif t % group == 0:
        c3, o3 = codes.reshape(m, -1, group), out.reshape(m, -1, group)
        np.multiply(c3, scale[:, :, None], out=o3)
        np.add(o3, zero[:, :, None], out=o3)
    else:
        cols = np.arange(t) // group
        np.multiply(codes, scale[:, cols], out=out)
        np.add(out, zero[:, cols], out=out)


def _block(dst, m, idx, D, dtype, esz, sec, bits, G, per_row):
    """Fills dst[:m] (torch [n, D]) from the old block of one head's keys or values."""
    t = len(idx)
    full = t == D and bool((idx == np.arange(D)).all())
    if not full:
        dst[:m].zero_()
    if bits == 0:
        src = _tensor(sec.take(m * t * esz), dtype, esz, (m, t))
        if full:
            dst[:m] = src
        else:
            dst[:m, torch.from_numpy(idx)] = src
        return
    g = _groups(m, G) if per_row else _groups(t, G)
    shape = (g, t) if per_row else (m, g)
    scale = np.frombuffer(sec.take(4 * g * (t if per_row else m)), np.float32).reshape(shape)
    zero = np.frombuffer(sec.take(4 * g * (t if per_row else m)), np.float32).reshape(shape)
    codes = _codes(sec.take(m * ((t * bits + 7) // 8)), m, t, bits)
    if full and dtype == torch.float32:
        _dequant(codes, scale, zero, G, per_row, dst[:m].numpy())
        return
    deq = np.empty((m, t), np.float32)
    _dequant(codes, scale, zero, G, per_row, deq)
    if full:
        dst[:m] = torch.from_numpy(deq)
    else:
        dst[:m, torch.from_numpy(idx)] = torch.from_numpy(deq).to(dtype)


def unpack_layer(blob):
    """(k, v, positions) of one compact layer: k, v torch [H, n, D] in the cache's dtype (pruned
    channels zero, quantized blocks dequantized), positions int32 numpy [H, n]. All heads must
    keep the same count n (ValueError otherwise)."""
    blob = memoryview(blob).cast("B")
    if len(blob) < _HEADER.size:
        raise ValueError("compact layer: shorter than its header")
    magic, version, dt, bits, _, H, D, seq_len, G, _, _, vbits = _HEADER.unpack_from(blob, 0)
    if magic != MAGIC or version not in VERSIONS:
        raise ValueError(f"compact layer: magic {magic:#x} version {version}, expected "
                         f"{MAGIC:#x} {' or '.join(map(str, VERSIONS))}")
    if dt not in _DTYPES or bits not in (0, 2, 4, 8) or not 1 <= H <= 1024 or not 1 <= D <= 512:
        raise ValueError(f"compact layer: dtype {dt}, bits {bits}, heads {H}, head_dim {D}")
    if version == 1:
        if vbits:
            raise ValueError(f"compact layer: value bits {vbits} in a version 1 blob")
        vbits = bits
    elif not bits or vbits not in (2, 4, 8) or vbits == bits:
        raise ValueError(f"compact layer: value bits {vbits} with key bits {bits}")
    if bits and G < 1:
        raise ValueError(f"compact layer: quant group {G}")
    dtype, esz = _DTYPES[dt]
    if len(blob) < _HEADER.size + H * _DESC.size:
        raise ValueError("compact layer: shorter than its head table")
    descs = [_DESC.unpack_from(blob, _HEADER.size + h * _DESC.size) for h in range(H)]
    n = descs[0][0]
    if any(d[0] != n for d in descs):
        raise ValueError("compact layer: heads keep different token counts")
    k = torch.empty(H, n, D, dtype=dtype)
    v = torch.empty(H, n, D, dtype=dtype)
    ps = np.empty((H, n), np.int32)
    for h, (n, r, tk, tv, off, size) in enumerate(descs):
        if not (0 <= r <= n <= seq_len and 1 <= tk <= D and 1 <= tv <= D) or \
                off + size > len(blob):
            raise ValueError(f"compact layer: head {h} descriptor out of range")
        sec = _Section(blob, off, size)
        m = n - r
        ps[h] = np.frombuffer(sec.take(4 * n), np.int32)
        kidx = np.frombuffer(sec.take(4 * tk), np.int32).astype(np.int64)
        vidx = np.frombuffer(sec.take(4 * tv), np.int32).astype(np.int64)
        if (kidx >= D).any() or (vidx >= D).any() or (kidx < 0).any() or (vidx < 0).any():
            raise ValueError(f"compact layer: head {h} channel index out of range")
        _block(k[h], m, kidx, D, dtype, esz, sec, bits, G, per_row=True)
        k[h, m:] = _tensor(sec.take(r * D * esz), dtype, esz, (r, D))
        _block(v[h], m, vidx, D, dtype, esz, sec, vbits, G, per_row=False)
        v[h, m:] = _tensor(sec.take(r * D * esz), dtype, esz, (r, D))
    return k, v, ps

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
import sys

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
    """One head's blocks: `take` hands out the next block as a slice of the blob's uint8
    tensor (blocks start 16-byte aligned, so a slice can be viewed as any element type)."""

    def __init__(self, u8, start, size):
        self.u8, self.start, self.end, self.off = u8, start, start + size, 0

    def take(self, nbytes):
        at = self.start + self.off
        if at + nbytes > self.end:
            raise ValueError(f"compact layer: head section overruns its {self.end - self.start} "
                             f"bytes")
        self.off = _align(self.off + nbytes)
        return self.u8[at:at + nbytes]


def _tensor(raw, dtype, esz, shape):
    """The uint8 slice `raw` as a dtype tensor of `shape` (a view, no copy)."""
    n = int(np.prod(shape))
    if raw.numel() != n * esz:
        raise ValueError("compact layer: block size mismatch")
    if n == 0:
        return torch.zeros(shape, dtype=dtype)
    return raw.view(dtype).view(*shape)


# Codes to bytes in element order, on little-endian hosts: each code byte widened to 16 (4-bit)
# or 32 bits (2-bit) with its codes moved into consecutive bytes, so that a byte view of the
# wide integers lists them element by element (element 0 was in the lowest bits).
_LITTLE = sys.byteorder == "little"


def _codes(raw, rows, t, bits):
    """uint8 [rows, ceil(t*bits/8)] -> uint8 torch [rows, t] codes (element 0 in the lowest
    bits)."""
    rb = (t * bits + 7) // 8
    a = _tensor(raw, torch.uint8, 1, (rows, rb))
    if bits == 8:
        return a[:, :t]
    if _LITTLE and bits == 4:
        x = a.to(torch.int16)
        y = (x & 0x0F) | ((x & 0xF0) << 4)
    elif _LITTLE:
        x = a.to(torch.int32)
        y = (x & 0x03) | ((x & 0x0C) << 6) | ((x & 0x30) << 12) | ((x & 0xC0) << 18)
    else:
        per, mask = 8 // bits, (1 << bits) - 1
        y = torch.stack([(a >> (j * bits)) & mask for j in range(per)], dim=-1)
    return y.view(torch.uint8).view(rows, rb * (8 // bits))[:, :t]


def _dequant(codes, scale, zero, group, per_row):
    """codes[i, c] * scale + zero as a new float32 [m, t] tensor, the group's scale/zero:
    per_row (keys, groups of `group` rows per channel) or per column (values, groups of `group`
    channels). A multiply, then an add, each rounded, as kvcd's own export computes it. Done in
    a contiguous tensor: torch's loops over a strided destination with these broadcasts ran
    several times slower."""
    m, t = codes.shape
    out = codes.to(torch.float32)
    if per_row:
        full = (m // group) * group
        if full:
            o3 = out[:full].view(full // group, group, t)
            o3.mul_(scale[:full // group, None, :]).add_(zero[:full // group, None, :])
        if full < m:
            out[full:].mul_(scale[full // group]).add_(zero[full // group])
    elif t % group == 0:
        o3 = out.view(m, t // group, group)
        o3.mul_(scale[:, :, None]).add_(zero[:, :, None])
    else:
        cols = torch.arange(t) // group
        out.mul_(scale[:, cols]).add_(zero[:, cols])
    return out


def _block(dst, m, idx, D, dtype, esz, sec, bits, G, per_row):
    """Fills dst[:m] (torch [n, D], any row stride) from the old block of one head's keys or
    values."""
    t = len(idx)
    full = t == D and bool((idx == np.arange(D)).all())
    if not full:
        dst[:m].zero_()
    if bits == 0:
        src = _tensor(sec.take(m * t * esz), dtype, esz, (m, t))
    else:
        g = _groups(m, G) if per_row else _groups(t, G)
        shape = (g, t) if per_row else (m, g)
        scale = _tensor(sec.take(4 * g * (t if per_row else m)), torch.float32, 4, shape)
        zero = _tensor(sec.take(4 * g * (t if per_row else m)), torch.float32, 4, shape)
        codes = _codes(sec.take(m * ((t * bits + 7) // 8)), m, t, bits)
        src = _dequant(codes, scale, zero, G, per_row)
    if full:
        dst[:m].copy_(src)  # rounded to the cache's dtype here
    else:
        dst[:m, torch.from_numpy(idx)] = src.to(dtype)


def _as_u8(blob):
    """The blob as a flat uint8 tensor: shared with a writable numpy array (what the client
    hands over), copied from anything else (bytes), so that torch never views read-only
    memory."""
    if isinstance(blob, np.ndarray) and blob.dtype == np.uint8 and blob.ndim == 1 and \
            blob.flags.writeable and blob.flags.c_contiguous:
        return torch.from_numpy(blob)
    return torch.from_numpy(np.frombuffer(memoryview(blob).cast("B"), np.uint8).copy())


def unpack_layer(blob, out=None, tokens=None):
    """(k, v, positions) of one compact layer: k, v torch [H, n, D] in the cache's dtype (pruned
    channels zero, quantized blocks dequantized), positions int32 numpy [H, n]. All heads must
    keep the same count n (ValueError otherwise). k and v are views of token-major [n, H, D]
    storage, so that their transpose(0, 1), the [tokens, heads, head_dim] a paged cache update
    takes, is contiguous without a copy. `out`: that storage from an earlier call, (k, v) [n, H,
    D], overwritten and returned when this layer has the same shape and dtype (a reader of many
    layers then writes into memory it has touched before, not into fresh pages). `tokens`: the
    count the caller expects, checked before anything is allocated."""
    u8 = _as_u8(blob)
    blob = u8.numpy()
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
    if tokens is not None and n != tokens:
        raise ValueError(f"compact layer: {n} tokens, expected {tokens}")
    # Every descriptor before the output is allocated: a section holds at least its positions,
    # so the dense layer a blob can ask for is bounded by the blob's own size.
    for h, (n, r, tk, tv, off, size) in enumerate(descs):
        if not (0 <= r <= n <= seq_len and 1 <= tk <= D and 1 <= tv <= D) or \
                off + size > len(blob) or off % _ALIGN or 4 * n > size:
            raise ValueError(f"compact layer: head {h} descriptor out of range")
    if out is not None and all(t.shape == (n, H, D) and t.dtype == dtype and t.is_contiguous()
                               for t in out):
        k, v = out[0].transpose(0, 1), out[1].transpose(0, 1)
    else:
        k = torch.empty(n, H, D, dtype=dtype).transpose(0, 1)
        v = torch.empty(n, H, D, dtype=dtype).transpose(0, 1)
    ps = np.empty((H, n), np.int32)
    for h, (n, r, tk, tv, off, size) in enumerate(descs):
        sec = _Section(u8, off, size)
        m = n - r
        ps[h] = _tensor(sec.take(4 * n), torch.int32, 4, (n,)).numpy()
        kidx = _tensor(sec.take(4 * tk), torch.int32, 4, (tk,)).numpy().astype(np.int64)
        vidx = _tensor(sec.take(4 * tv), torch.int32, 4, (tv,)).numpy().astype(np.int64)
        if (kidx >= D).any() or (vidx >= D).any() or (kidx < 0).any() or (vidx < 0).any():
            raise ValueError(f"compact layer: head {h} channel index out of range")
        _block(k[h], m, kidx, D, dtype, esz, sec, bits, G, per_row=True)
        k[h, m:] = _tensor(sec.take(r * D * esz), dtype, esz, (r, D))
        _block(v[h], m, vidx, D, dtype, esz, sec, vbits, G, per_row=False)
        v[h, m:] = _tensor(sec.take(r * D * esz), dtype, esz, (r, D))
    return k, v, ps

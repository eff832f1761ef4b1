"""vLLM's paged KV cache as the running attention backend lays it out, learned at run time.

Nothing here assumes an order inside a block. Writes go through the attention layer's own
`impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)`, which is what vLLM calls
in every forward pass (on the CPU: `cpu_attn_reshape_and_cache` with the layer's `isa`, so the
`vec`, `vec16` and `amx` orders all come out as vLLM's kernels read them). Reads need the
inverse: `PagedLayout` writes index codes through that same call into a one-block scratch
cache of the layer's shape and dtype, finds where every (slot, head, channel) of the keys and
of the values landed, and turns that into element offsets into the real cache tensor (through
its own strides, so any physical order of vLLM's logical [blocks, heads, slots, 2 * head_size]
view works). Gathering a request's tokens is then one indexed read.

Needs torch; `vllm` only through the layer objects it is given.
"""

import math

import torch

from .spec import SpecError

_DIGIT = 16  # index codes are written digit by digit, so they stay exact even in bfloat16


class PagedLayout:
    """Key and value positions of one attention layer's paged cache.

    layer: vLLM's attention layer (has .impl with do_kv_cache_update, .attn_backend, and on the
    CPU the .isa vLLM picked); kv_cache: the layer's registered cache tensor.
    Raises SpecError when the layout cannot be mapped (a backend writing elsewhere than one
    block, or a quantized cache).
    """

    def __init__(self, layer, kv_cache, num_kv_heads, head_size):
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(impl, "do_kv_cache_update"):
            raise SpecError(f"attention backend {type(impl).__name__}: no do_kv_cache_update, "
                            f"so KvcConnector cannot write vLLM's cache through it")
        self.layer, self.impl = layer, impl
        self.dtype = kv_cache.dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise SpecError(f"KV cache dtype {self.dtype}: KvcConnector takes float32, float16 "
                            f"or bfloat16 caches")
        self.H, self.D = num_kv_heads, head_size
        backend = getattr(layer, "attn_backend", None)
        self.backend_name = backend.get_name() if backend is not None else type(impl).__name__
        shape = tuple(kv_cache.shape)
        # vLLM's per-layer view is logically [num_blocks, num_kv_heads, block_size, 2 * head_size]
        # for every backend (keys and values share the content dimension); the strides say
        # where each axis physically is, and the order inside a block is learned below.
        if len(shape) != 4 or shape[1] != self.H or shape[3] != 2 * self.D:
            raise SpecError(f"{self.backend_name}: KV cache shape {shape} is not [num_blocks, "
                            f"{self.H}, block_size, {2 * self.D}]")
        self.block_dim = 0
        self.num_blocks, self.block_size = shape[0], shape[2]
        self.isa = getattr(layer, "isa", None)
        self.key_offsets, self.value_offsets = self._learn(kv_cache)
        self.block_stride = kv_cache.stride(self.block_dim)
        # Where the learned positions are an affine function of (slot, head, channel) (vLLM's
        # vec and vec16 orders are), a strided view reads them at memory speed; amx's tiles
        # are not, and go through the element-wise gather.
        self.affine = [_affine(t) for t in (self.key_offsets, self.value_offsets)]
        if None in self.affine:
            self.affine = None

    # -- learning ------------------------------------------------------------------------------

    def _write(self, scratch, key, value):
        slots = torch.arange(self.block_size, dtype=torch.int64)
        self.impl.do_kv_cache_update(self.layer, key, value, scratch, slots)

    def _learn(self, kv_cache):
        bs, H, D = self.block_size, self.H, self.D
        shape = list(kv_cache.shape)
        shape[self.block_dim] = 1
        scratch = torch.zeros(shape, dtype=self.dtype)
        t = torch.arange(bs).view(bs, 1, 1).expand(bs, H, D)
        h = torch.arange(H).view(1, H, 1).expand(bs, H, D)
        d = torch.arange(D).view(1, 1, D).expand(bs, H, D)
        zero = torch.zeros(bs, H, D, dtype=self.dtype)
        found = {}
        for which in ("k", "v"):
            coords = {}
            for name, idx, size in (("t", t, bs), ("h", h, H), ("d", d, D)):
                value = torch.zeros(scratch.numel(), dtype=torch.int64)
                where = None
                for p in range(max(1, math.ceil(math.log(max(size, 2), _DIGIT)))):
                    digit = (idx // (_DIGIT ** p)) % _DIGIT + 1
                    code = digit.to(self.dtype)
                    scratch.zero_()
                    self._write(scratch, code if which == "k" else zero,
                                code if which == "v" else zero)
                    flat = scratch.reshape(-1).to(torch.float32)
                    nz = flat != 0
                    if where is None:
                        where = nz
                    elif not torch.equal(where, nz):
                        raise SpecError(f"{self.backend_name}: the cache update wrote different "
                                        f"elements for equal shapes; layout not learnable")
                    value += (flat.round().to(torch.int64) - 1).clamp(min=0) * (_DIGIT ** p)
                coords[name] = (where, value)
            where = coords["t"][0]
            n = int(where.sum())
            if n != bs * H * D:
                raise SpecError(f"{self.backend_name}: the cache update wrote {n} elements for "
                                f"{bs * H * D} {which} values (isa {self.isa})")
            pos = where.nonzero().view(-1)
            tt, hh, dd = (coords[c][1][pos] for c in ("t", "h", "d"))
            key = (tt * H + hh) * D + dd
            if key.unique().numel() != n or tt.max() >= bs or hh.max() >= H or dd.max() >= D:
                raise SpecError(f"{self.backend_name}: {which} positions are not a permutation")
            # Scratch element index -> offset in the real tensor (its strides, block 0).
            multi = []
            rest = pos.clone()
            for size in reversed(shape):
                multi.append(rest % size)
                rest = rest // size
            multi.reverse()
            offset = torch.zeros_like(pos)
            for dim, m in enumerate(multi):
                offset += m * kv_cache.stride(dim)
            table = torch.empty(bs * H * D, dtype=torch.int64)
            table[key] = offset
            found[which] = table.view(bs, H, D)
        if torch.isin(found["k"], found["v"]).any():
            raise SpecError(f"{self.backend_name}: keys and values overlap in a block")
        return found["k"], found["v"]

    # -- use -----------------------------------------------------------------------------------

    def _flat(self, kv_cache):
        span = 1 + sum((s - 1) * st for s, st in zip(kv_cache.shape, kv_cache.stride()))
        return kv_cache.as_strided((span,), (1,), kv_cache.storage_offset())

    def gather(self, kv_cache, slots):
        """Keys and values [T, H, D] (the cache's dtype) of the token slots `slots` (int64 [T];
        slot = block_id * block_size + offset)."""
        blocks = slots // self.block_size
        off = slots % self.block_size
        if self.affine is not None:
            out = []
            for o0, st, sh, sd in self.affine:
                view = kv_cache.as_strided(
                    (self.num_blocks, self.block_size, self.H, self.D),
                    (self.block_stride, st, sh, sd), kv_cache.storage_offset() + o0)
                out.append(view[blocks, off])
            return out[0], out[1]
        base = (blocks * self.block_stride).view(-1, 1, 1)
        flat = self._flat(kv_cache)
        return flat[self.key_offsets[off] + base], flat[self.value_offsets[off] + base]

    def write(self, kv_cache, slots, key, value):
        """Writes key, value [T, H, D] into `slots` through vLLM's own cache update."""
        self.impl.do_kv_cache_update(self.layer, key.to(self.dtype).contiguous(),
                                     value.to(self.dtype).contiguous(), kv_cache, slots)


def _affine(table):
    """(o0, st, sh, sd) when table[t, h, d] == o0 + st*t + sh*h + sd*d everywhere, else None."""
    bs, H, D = table.shape
    o0 = int(table[0, 0, 0])
    st = int(table[1, 0, 0]) - o0 if bs > 1 else 0
    sh = int(table[0, 1, 0]) - o0 if H > 1 else 0
    sd = int(table[0, 0, 1]) - o0 if D > 1 else 0
    if min(st, sh, sd) < 0:
        return None
    pred = (o0 + st * torch.arange(bs).view(bs, 1, 1) + sh * torch.arange(H).view(1, H, 1) +
            sd * torch.arange(D).view(1, 1, D))
    return (o0, st, sh, sd) if torch.equal(pred, table) else None


def slots_for(block_ids, block_size, start, end):
    """int64 slots of tokens start .. end - 1 of a request whose blocks are `block_ids`."""
    t = torch.arange(start, end, dtype=torch.int64)
    table = torch.as_tensor(block_ids, dtype=torch.int64)
    if end > 0 and (end - 1) // block_size >= len(block_ids):
        raise SpecError(f"tokens up to {end} need {(end - 1) // block_size + 1} blocks, the "
                        f"request has {len(block_ids)}")
    return table[t // block_size] * block_size + t % block_size

"""Paged KV blocks as serving engines keep them, and the decode-node request flow into them.

A serving engine (vLLM, SGLang) stores each layer's cache in fixed-size blocks of `block_size`
token slots and gives each request a block table: slot s of the request lives in block
table[s // block_size], offset s % block_size. Two block layouts are common:
  NHD  [num_blocks, block_size, num_kv_heads, head_dim]   (vLLM flash-attn, FlashInfer NHD)
  HND  [num_blocks, num_kv_heads, block_size, head_dim]   (FlashInfer HND, TensorRT-LLM)

The engine-ready export (format="contiguous") puts kept token j in slot j and lets decoding
continue at position K = kept tokens, which is what these engines assume. `fetch_into_blocks`
is the request flow of a decode-side connector: allocate blocks for K slots, stream the cache
from kvcd and scatter each layer into the blocks as soon as it arrives. `write_slots`,
`gather_slots` and `paged_attention` are the pieces an engine already has; they are here in
plain torch so the flow runs (and is tested) without one.

Needs torch.
"""

import math

import torch


class BlockAllocator:
    """A free list of block ids."""

    def __init__(self, num_blocks):
        self._free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, n):
        if n > len(self._free):
            raise MemoryError(f"paged cache: {n} blocks wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, blocks):
        self._free.extend(reversed(blocks))


class PagedKvCache:
    """Per layer one key and one value block pool in `layout` ("NHD" or "HND")."""

    def __init__(self, num_layers, num_blocks, num_kv_heads, head_dim, block_size=16,
                 layout="NHD", dtype=torch.float32):
        if layout not in ("NHD", "HND"):
            raise ValueError(f"layout: {layout!r} is not 'NHD' or 'HND'")
        self.block_size, self.layout = block_size, layout
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = ((num_blocks, block_size, num_kv_heads, head_dim) if layout == "NHD"
                 else (num_blocks, num_kv_heads, block_size, head_dim))
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.allocator = BlockAllocator(num_blocks)

    def blocks_for(self, slots):
        return math.ceil(slots / self.block_size)

    def _index(self, block_table, start, n):
        slots = torch.arange(start, start + n)
        table = torch.as_tensor(block_table, dtype=torch.long)
        return table[slots // self.block_size], slots % self.block_size

    def write_slots(self, layer, block_table, start, k, v):
        """Scatters k, v [num_kv_heads, n, head_dim] into slots start .. start + n - 1."""
        n = k.shape[1]
        blocks, offsets = self._index(block_table, start, n)
        for pool, x in ((self.k[layer], k), (self.v[layer], v)):
            x = x.to(pool.dtype)
            if self.layout == "NHD":
                pool[blocks, offsets] = x.transpose(0, 1)          # [n, H, D]
            else:
                pool[blocks, :, offsets] = x.transpose(0, 1)       # [n, H, D] per (block, off)

    def gather_slots(self, layer, block_table, n):
        """k, v [num_kv_heads, n, head_dim] of slots 0 .. n - 1."""
        blocks, offsets = self._index(block_table, 0, n)
        if self.layout == "NHD":
            return (self.k[layer][blocks, offsets].transpose(0, 1),
                    self.v[layer][blocks, offsets].transpose(0, 1))
        return (self.k[layer][blocks, :, offsets].transpose(0, 1),
                self.v[layer][blocks, :, offsets].transpose(0, 1))


def paged_attention(cache, layer, block_table, seq_len, q):
    """Softmax attention of q [num_q_heads, head_dim] over slots 0 .. seq_len - 1 (GQA)."""
    k, v = cache.gather_slots(layer, block_table, seq_len)
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, dim=0).to(q.dtype)
    v = v.repeat_interleave(group, dim=0).to(q.dtype)
    scores = torch.einsum("hd,hnd->hn", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), v)


def fetch_into_blocks(client, cache_id, cache, rope, extra_slots=0):
    """Streams the engine-ready cache `cache_id` into newly allocated blocks of `cache`.

    Returns (block_table, kept_tokens, info): decoding continues at position kept_tokens, and
    the table has room for `extra_slots` more tokens. Each layer is written as it arrives.
    """
    stream = client.get_stream(cache_id, format="contiguous", rope=rope, tensors="torch")
    kept = stream.info.kept_tokens[0] if stream.info.kept_tokens else 0
    table = cache.allocator.allocate(cache.blocks_for(kept + extra_slots))
    try:
        for layer in stream:
            cache.write_slots(layer.layer, table, 0, layer.k, layer.v)
    except BaseException:
        cache.allocator.free(table)
        stream.close()
        raise
    return table, kept, stream.info

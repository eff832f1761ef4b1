"""The model side of the side-by-side harness: one prefill per document with every layer's
attention inputs captured, and batched decoding on many compressed caches at once.

Why one prefill serves every row: a press compresses a layer's cache after that layer's attention
ran (kvpress's forward hook), and the next layer's input does not depend on the compressed cache,
so the hidden states, keys and values a press sees during kvpress's own prefill are the ones an
uncompressed prefill produces. `Capture` records them (the attention module's input
`hidden_states`, the RoPE `position_embeddings`, the layer's keys and values) and a press's
`compress` called on them returns what it returns inside kvpress's pipeline
(`python -m kvc.bench.parity` verifies this against kvpress's hooks on real documents).
A prefix of the captured sequence is the capture of that prefix (causal attention), so one
prefill of `prompt[:-1]` gives both scenarios: the context alone (question after) and the whole
prompt but its last token (question inside).

Compressed caches are `RowCache`s: per layer keys and values `[Hkv, n, D]` (RoPE applied at their
original positions) and a validity mask `[Hkv, n]` (head-wise methods keep different counts per
head and are padded). Decoding continues in the same transformers model at the original
positions (as kvpress's pipeline does: position ids from the uncompressed length), many rows in
one batch: rows are padded to a common length and the padding masked out per head through a 4-D
attention mask, which the stock SDPA attention takes as it is.

Speed: with `dtype=bfloat16` the forward passes run in bf16 (AMX/AVX-512 BF16 where the CPU has
them) and scoring runs on an fp32 `shadow` of the same weights, so presses and kvc see the same
bf16-valued keys and values in fp32 arithmetic and never break ties by bf16 rounding.
"""

import copy
import hashlib
import math
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache


def load(model_dir, dtype="bfloat16", threads=1):
    """(tokenizer, model, shadow): shadow is an fp32 copy holding the same (rounded) weights."""
    torch.set_num_threads(threads)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa").eval()
    shadow = model if dtype == "float32" else copy.deepcopy(model).float().eval()
    lm = shadow.model
    for layer in lm.layers:  # kvpress's presses read module.rotary_emb (set by its hooks)
        layer.self_attn.rotary_emb = lm.rotary_emb
    return tok, model, shadow


@dataclass
class LayerInput:
    hidden: torch.Tensor   # [1, S, hidden] the attention module's input (after the layer norm)
    keys: torch.Tensor     # [1, Hkv, S, D] after RoPE, model dtype
    values: torch.Tensor   # [1, Hkv, S, D]
    cos: torch.Tensor      # [1, S, D]
    sin: torch.Tensor      # [1, S, D]

    def prefix(self, n):
        return LayerInput(self.hidden[:, :n], self.keys[:, :, :n], self.values[:, :, :n],
                          self.cos[:, :n], self.sin[:, :n])


class Capture:
    """Per-layer attention inputs of one prefill (see the module doc)."""

    def __init__(self, model, ids):
        self.layers_in = []
        lm = model.model
        store = {}

        def hook(module, args, kwargs, output):
            cos, sin = kwargs["position_embeddings"]
            store[module.layer_idx] = (kwargs["hidden_states"].detach(), cos.detach(),
                                       sin.detach())
            return output

        handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True)
                   for layer in lm.layers]
        cache = DynamicCache()
        try:
            with torch.no_grad():
                out = model(torch.tensor([ids]), past_key_values=cache, logits_to_keep=1)
        finally:
            for h in handles:
                h.remove()
        self.last_logits = out.logits[0, -1].float()
        for i in range(len(lm.layers)):
            h, cos, sin = store[i]
            self.layers_in.append(LayerInput(h, cache.layers[i].keys, cache.layers[i].values,
                                             cos, sin))
        self.length = len(ids)

    def prefix(self, n):
        return [x.prefix(n) for x in self.layers_in]


@dataclass
class RowCache:
    """A compressed cache: per layer (keys, values [Hkv, n, D], valid [Hkv, n] bool)."""
    layers: list
    stored_fraction: float = float("nan")  # bytes stored / bytes of the fp16 full cache

    def length(self):
        return max(k.shape[1] for k, _, _ in self.layers)

    def kept(self):
        """Tokens kept, summed over layers and heads."""
        return int(sum(int(m.sum()) for _, _, m in self.layers))


def full_cache(layers_in):
    row = RowCache([(x.keys[0], x.values[0],
                     torch.ones(x.keys.shape[1], x.keys.shape[2], dtype=torch.bool))
                    for x in layers_in], 1.0)
    S = layers_in[0].keys.shape[2]
    row.positions = [torch.arange(S).expand(x.keys.shape[1], S) for x in layers_in]
    return row


def fingerprint(row):
    """A digest of the cache's content as a set: per layer and head the kept (position, key,
    value) entries in position order. Two rows with equal digests hold the same entries, so
    decoding gives the same result (up to the order of the attention sum); None when the row
    has no positions."""
    pos = getattr(row, "positions", None)
    if pos is None:
        return None
    h = hashlib.sha1()
    for (k, v, m), p in zip(row.layers, pos):
        for head in range(k.shape[0]):
            sel = m[head] & (p[head] >= 0)
            ph = p[head][sel]
            order = ph.argsort()
            h.update(ph[order].numpy().tobytes())
            h.update(k[head][sel][order].float().numpy().tobytes())
            h.update(v[head][sel][order].float().numpy().tobytes())
    return h.hexdigest()


def gather_cache(layers_in, indices):
    """RowCache keeping per layer the positions indices[l] ([Hkv, n] long) of every head."""
    out = []
    for x, idx in zip(layers_in, indices):
        ix = idx.unsqueeze(-1).expand(-1, -1, x.keys.shape[-1])
        out.append((x.keys[0].gather(1, ix), x.values[0].gather(1, ix),
                    torch.ones(idx.shape, dtype=torch.bool)))
    return RowCache(out)


def _batch_cache(rows, dtype):
    """DynamicCache of the rows padded to one length, and the validity [b, Hkv, L]."""
    L = max(r.length() for r in rows)
    cache = DynamicCache()
    valid_layers = []
    for li in range(len(rows[0].layers)):
        ks, vs, ms = [], [], []
        for r in rows:
            k, v, m = r.layers[li]
            pad = L - k.shape[1]
            if pad:
                z = k.new_zeros(k.shape[0], pad, k.shape[2])
                k, v = torch.cat([k, z], 1), torch.cat([v, z], 1)
                m = torch.cat([m, m.new_zeros(m.shape[0], pad)], 1)
            ks.append(k.to(dtype))
            vs.append(v.to(dtype))
            ms.append(m)
        cache.update(torch.stack(ks), torch.stack(vs), li)
        valid_layers.append(torch.stack(ms))
    return cache, valid_layers, L


def _mask(valid, groups, T, past_new=0):
    """Bool [b, Hq, T, L + past_new + T]: the valid cache, then causal over new tokens."""
    b, h, L = valid.shape
    old = valid.repeat_interleave(groups, dim=1).unsqueeze(2).expand(b, h * groups, T, L)
    n = past_new + T
    new = torch.ones(T, n, dtype=torch.bool).tril(past_new)
    new = new.expand(b, h * groups, T, n)
    return torch.cat([old, new], dim=-1)


class _LayerMasks:
    """SDPA takes one 4-D mask per forward while the validity differs per layer (head-wise
    methods): a pre-hook on every attention module swaps its layer's mask in."""

    def __init__(self, model, masks):
        self.masks = masks
        self.handles = [layer.self_attn.register_forward_pre_hook(self.pre, with_kwargs=True)
                        for layer in model.model.layers]

    def pre(self, module, args, kwargs):
        kwargs["attention_mask"] = self.masks[module.layer_idx]
        return args, kwargs

    def remove(self):
        for h in self.handles:
            h.remove()


def _starts(rows, start):
    """Per-row position of the first new token: `start`, less the shift of rows whose keys were
    moved to slots 0..K-1 (CONTIGUOUS downloads)."""
    return torch.tensor([start - getattr(r, "shift", 0) for r in rows])


def forward_rows(model, rows, tokens, start, keep_last):
    """Logits [b, keep_last, vocab] (float32) of teacher-forced `tokens` (list of ids, the same
    for every row) decoded at positions start.. on each row's compressed cache."""
    dtype = next(model.parameters()).dtype
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    cache, valid, L = _batch_cache(rows, dtype)
    b, T = len(rows), len(tokens)
    ids = torch.tensor([tokens] * b)
    pos = torch.arange(T).unsqueeze(0) + _starts(rows, start).unsqueeze(1)
    masks = _LayerMasks(model, [_mask(v, groups, T) for v in valid])
    try:
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=pos, past_key_values=cache,
                        attention_mask=masks.masks[0], logits_to_keep=keep_last,
                        cache_position=torch.arange(L, L + T))
    finally:
        masks.remove()
    return out.logits.float()


def generate_rows(model, rows, tokens, start, max_new, stop_ids):
    """Greedy continuation of `tokens` (decoded at positions start..) on every row, up to
    max_new tokens; a row stops at a token of stop_ids; the batch stops when all rows have.
    Returns the generated ids per row (stop token excluded)."""
    dtype = next(model.parameters()).dtype
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    cache, valid, L = _batch_cache(rows, dtype)
    b = len(rows)
    ids = torch.tensor([tokens] * b)
    out_ids = [[] for _ in range(b)]
    done = [False] * b
    past_new, at = 0, 0
    starts = _starts(rows, start)
    with torch.no_grad():
        for step in range(max_new):
            T = ids.shape[1]
            masks = _LayerMasks(model, [_mask(v, groups, T, past_new) for v in valid])
            try:
                out = model(input_ids=ids, past_key_values=cache, attention_mask=masks.masks[0],
                            position_ids=torch.arange(T).unsqueeze(0) + starts.unsqueeze(1) + at,
                            cache_position=torch.arange(L + past_new, L + past_new + T),
                            logits_to_keep=1)
            finally:
                masks.remove()
            nxt = out.logits[:, -1].argmax(-1)
            for i in range(b):
                if not done[i]:
                    t = int(nxt[i])
                    if t in stop_ids:
                        done[i] = True
                    else:
                        out_ids[i].append(t)
            past_new += T
            at += T
            if all(done):
                break
            ids = nxt.unsqueeze(1)
    return out_ids


def log_softmax_kl(ref_logits, logits):
    """KL(ref || q) per position from logits [..., V] (float32)."""
    lp = torch.log_softmax(ref_logits, -1)
    lq = torch.log_softmax(logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def rope_spec(config):
    """kvc's RopeSpec of a Hugging Face Llama config (default RoPE only)."""
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"rope type {kind!r}: only default RoPE is handled here")
    return {"theta": float(theta), "style": "ROPE_HALF_SPLIT"}


def queries(shadow_attn, x: LayerInput, last):
    """fp32 queries of the last `last` positions: (pre-RoPE, post-RoPE) [Hq, last, D]."""
    h = x.hidden[:, -last:].float() if last else x.hidden[:, :0].float()
    D = shadow_attn.head_dim
    q = shadow_attn.q_proj(h).view(1, h.shape[1], -1, D).transpose(1, 2)[0]
    cos, sin = x.cos[0, -last:].float(), x.sin[0, -last:].float()
    half = D // 2
    rot = torch.cat([-q[..., half:], q[..., :half]], -1)
    return q, q * cos + rot * sin


def query_stats(shadow_attn, x: LayerInput, skip=0):
    """Mean and covariance of the pre-RoPE queries of positions skip.. (float32
    [Hq, D + D*D], kvc's TENSOR_Q_STATS), computed as kvpress's ExpectedAttentionPress does."""
    S = x.hidden.shape[1]
    q, _ = queries(shadow_attn, x, S - skip)
    mu = q.mean(1)
    c = q - mu.unsqueeze(1)
    cov = torch.einsum("hsi,hsj->hij", c, c) / c.shape[1]
    return torch.cat([mu, cov.reshape(cov.shape[0], -1)], 1).contiguous()


def nan_to_none(x):
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else x

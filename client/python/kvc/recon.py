"""Reconstruction queries for kvcd's `kvzip` policy (KVzip-style context reconstruction).

kvzip scores a cached token by the largest attention it receives from the queries of a pass in
which the model repeats the context: the prompt "\\n\\nRepeat the previous context exactly.",
a newline, then the context itself. A prefill node that runs a Hugging Face Llama-family model
(q_proj, RoPE, no query norm) gets those queries with one more forward pass:

    import kvc.spec
    from kvc.recon import reconstruction_inputs
    q, lse = reconstruction_inputs(model, tokenizer, context_ids)  # [Hq, W, D], [Hq, W]
    client.put(cache_id, [(k[l], v[l], q[l], lse[l]) for l in range(L)],
               compression=kvc.spec.parse("kvzip:0.1,stats=1,ada=0.2,xlayer=1"))

`lse` (sent as the layer's q_stats with `stats=1`) is each query row's log-sum-exp over the keys
of the pass's own tokens up to it, which kvcd does not hold: KVzip's softmax runs over them too,
and kvcd adds that mass to each row's denominator. Without it (`reconstruction_queries` alone)
kvcd normalises over the context's keys only, which keeps a different set (docs/fidelity-smollm2.md
measures both).

By default (`rows="all"`) the queries are those of every position of the pass, as KVzip scores:
the prompt's and the newline's tokens (9 with SmolLM2's tokenizer) and the S copied context
tokens, so W = len(repeat_ids(...)) = S + 9: more rows than the context has tokens, which kvcd
accepts for kvzip only. `rows="context"` keeps the last S (those of the copied context tokens;
W = S), for a kvcd older than that. The pass costs about twice the prefill of the context (it
attends over the context and itself); with `past_key_values` holding the context's cache it
costs one prefill of S + 9 tokens (the cache grows by those tokens; pass a copy if it is needed
afterwards). Needs torch and transformers, imported here only.
"""

import contextlib

PROMPT = "\n\nRepeat the previous context exactly."
SUFFIX = "\n"


def repeat_ids(tokenizer, context_ids):
    """Token ids of the reconstruction prompt, the newline and the context."""
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ids += tokenizer(SUFFIX, add_special_tokens=False)["input_ids"]
    return ids + [int(t) for t in context_ids]


def post_rope_queries(attn, hidden, cos, sin):
    """Post-RoPE queries [Hq, n, D] (float32) of an attention module's input `hidden` [1, n, E]
    at the positions of `cos`/`sin` [1, n, D] (Llama's rotate-half RoPE)."""
    import torch
    D = attn.head_dim
    w, b = attn.q_proj.weight, attn.q_proj.bias
    q = torch.nn.functional.linear(hidden.float(), w.float(), None if b is None else b.float())
    q = q.view(1, hidden.shape[1], -1, D).transpose(1, 2)[0]
    half = D // 2
    rot = torch.cat([-q[..., half:], q[..., :half]], -1)
    return q * cos[0].float() + rot * sin[0].float()


@contextlib.contextmanager
def capture_last(model, n, keys=0):
    """Hooks every attention module of `model` for one forward pass and yields a dict that then
    holds, per layer index, (hidden_states, cos, sin) of the pass's last `n` positions, and with
    `keys` > 0 a fourth item: the post-RoPE keys [Hkv, keys, D] of the cache's last `keys`
    entries right after the layer ran (the pass needs a cache)."""
    store = {}

    def hook(module, args, kwargs, output):
        cos, sin = kwargs["position_embeddings"]
        item = (kwargs["hidden_states"][:, -n:].detach(), cos[:, -n:].detach(),
                sin[:, -n:].detach())
        if keys:
            cache = kwargs.get("past_key_values") or kwargs.get("past_key_value")
            item += (cache.layers[module.layer_idx].keys[0, :, -keys:].detach(),)
        store[module.layer_idx] = item
        return output

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def row_log_mass(queries, repeat_keys, block=64):
    """Per query row, the log-sum-exp of q . k / sqrt(D) over the pass's own keys up to the
    row: queries [Hq, W, D] are the pass's last W rows, repeat_keys [Hkv, n, D] all n of its
    keys (n >= W); float32 [Hq, W].

    Rows go in blocks of `block`: a block's logits [Hkv, group x block, keys up to its last row]
    stay small enough for the cache, and keys after a block's last row are never computed (half
    the work of the full causal square). ~7x faster than one [Hq, W, n] product at W = n = 2K."""
    import torch
    hq, W, D = queries.shape
    hkv, n, _ = repeat_keys.shape
    g = hq // hkv
    q = queries.float().reshape(hkv, g, W, D) * (D ** -0.5)
    k = repeat_keys.float()
    off = n - W  # row r sits at pass position off + r
    out = torch.empty(hkv, g, W)
    for r0 in range(0, W, block):
        r1 = min(W, r0 + block)
        b, m = r1 - r0, off + r1  # keys 0..m-1 are visible to some row of the block
        a = torch.matmul(q[:, :, r0:r1].reshape(hkv, g * b, D), k[:, :m].transpose(1, 2))
        a = a.view(hkv, g, b, m)
        late = torch.arange(off + r0, m).unsqueeze(0) > torch.arange(off + r0, m).unsqueeze(1)
        a[..., off + r0:].masked_fill_(late, float("-inf"))
        out[:, :, r0:r1] = torch.logsumexp(a, dim=-1)
    return out.reshape(hq, W)


ROWS = ("all", "context")


def _run(model, tokenizer, context_ids, past_key_values, rows):
    import torch
    from transformers import DynamicCache
    if rows not in ROWS:
        raise ValueError(f"reconstruction_queries: rows={rows!r} is not one of {ROWS}")
    S = len(context_ids)
    if S < 1:
        raise ValueError("reconstruction_queries: empty context")
    rep = repeat_ids(tokenizer, context_ids)
    ids = rep if past_key_values is not None else [int(t) for t in context_ids] + rep
    cache = past_key_values if past_key_values is not None else DynamicCache()
    W = len(rep) if rows == "all" else S
    with torch.no_grad(), capture_last(model, W, keys=len(rep)) as store:
        model.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    queries, masses = [], []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            h, cos, sin, keys = store[i]
            q = post_rope_queries(layer.self_attn, h, cos, sin)
            queries.append(q)
            masses.append(row_log_mass(q, keys))
    return queries, masses


def reconstruction_queries(model, tokenizer, context_ids, past_key_values=None, rows="all"):
    """kvzip's Q_obs: per layer the post-RoPE queries [Hq, W, D] (float32) of the reconstruction
    pass over `context_ids` (S tokens): all W = len(repeat_ids(...)) rows of the pass, or with
    rows="context" its last W = S. Without `past_key_values` the pass runs over the context and
    the repetition together; with it (the context's cache, S entries a layer) only the repetition
    runs."""
    return _run(model, tokenizer, context_ids, past_key_values, rows)[0]


def reconstruction_inputs(model, tokenizer, context_ids, past_key_values=None, rows="all"):
    """(queries, log-masses): kvzip's Q_obs as reconstruction_queries returns them and, per
    layer, each row's log-sum-exp over the pass's own keys up to it (float32 [Hq, W]), sent as
    the layer's q_stats with `stats=1`."""
    return _run(model, tokenizer, context_ids, past_key_values, rows)

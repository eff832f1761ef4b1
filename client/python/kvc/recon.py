"""Reconstruction queries for kvcd's `kvzip` policy (KVzip-style context reconstruction).

kvzip scores a cached token by the largest attention it receives from the queries of a pass in
which the model repeats the context: the prompt "\\n\\nRepeat the previous context exactly.",
a newline, then the context itself. A prefill node that runs a Hugging Face Llama-family model
(q_proj, RoPE, no query norm) gets those queries with one more forward pass:

    import kvc.spec
    from kvc.recon import reconstruction_inputs, with_passes
    q, lse = reconstruction_inputs(model, tokenizer, context_ids)  # [Hq, W, D], [Hq, W]
    spec = with_passes("kvzip:0.1,stats=1,ada=0,xlayer=1,top=16", tokenizer, context_ids)
    client.put(cache_id, [(k[l], v[l], q[l], lse[l]) for l in range(L)],
               compression=kvc.spec.parse(spec))

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
costs one prefill of S + 9 tokens.

Contexts longer than `chunk_size` (2,048 tokens, KVzip's and kvpress's chunk) are repeated one
chunk at a time, each pass on top of the context's cache, as KVzip does to bound a pass's memory:
the first chunk after the prompt above, every later one after "\n\nRepeat the part of the
previous context exactly, starting with" and the previous chunk's last 8 tokens (repeat_passes
gives every pass's tokens). The rows of all passes are sent together (W = S plus each pass's
instruction tokens), each row's log-mass over its own pass's tokens. By default kvcd normalises
every row over all S context keys, the attention the model computed in that pass; with the
passes named in the spec's kvzip term (with_passes: ",passes=R0/R1/...,chunk=2048") it normalises
a pass's rows over the sinks and that pass's chunk only, as KVzipPress does, and scores each row
against those keys alone: rows x (chunk + sinks) logits instead of rows x S, which keeps kvzip
within kvcd's work budget at any context length (every row over all keys is refused past ~12K
tokens of a Llama-3-8B-shaped cache by default). The passes together cost about what the one
pass costs. With `past_key_values` the cache is cropped back to its length after each pass
(DynamicCache.crop): it holds the context only afterwards. Needs torch and transformers, imported
here only.
"""

import contextlib

PROMPT = "\n\nRepeat the previous context exactly."
PART_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
SUFFIX = "\n"
CHUNK = 2048  # context tokens repeated by one pass
OVERLAP = 8  # a later pass's prompt ends with the previous chunk's last tokens


def _ids(tokenizer, text):
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def repeat_ids(tokenizer, context_ids):
    """Token ids of the reconstruction prompt, the newline and the context (one pass)."""
    return _ids(tokenizer, PROMPT) + _ids(tokenizer, SUFFIX) + [int(t) for t in context_ids]


def repeat_passes(tokenizer, context_ids, chunk_size=CHUNK):
    """The reconstruction passes of a context: [(start, end, ids)], one per chunk of at most
    `chunk_size` context tokens [start, end); `ids` is what that pass runs on top of the
    context's cache (its instruction, the newline, the chunk). One pass, repeat_ids(...), when
    the context fits in a chunk."""
    ctx = [int(t) for t in context_ids]
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"reconstruction: chunk_size={chunk_size!r} must be an int >= 1")
    if len(ctx) <= chunk_size:
        return [(0, len(ctx), repeat_ids(tokenizer, ctx))]
    suffix = _ids(tokenizer, SUFFIX)
    out = []
    for start in range(0, len(ctx), chunk_size):
        end = min(len(ctx), start + chunk_size)
        if start == 0:
            head = _ids(tokenizer, PROMPT)
        else:
            head = _ids(tokenizer, PART_PROMPT) + ctx[max(0, start - OVERLAP):start]
        out.append((start, end, head + suffix + ctx[start:end]))
    return out


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


def layer_rows(model, store):
    """Per layer (queries [Hq, W, D], log-masses [Hq, W]) of one captured pass."""
    import torch
    queries, masses = [], []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            h, cos, sin, keys = store[i]
            q = post_rope_queries(layer.self_attn, h, cos, sin)
            queries.append(q)
            masses.append(row_log_mass(q, keys))
    return queries, masses


def pass_rows(tokenizer, context_ids, rows="all", chunk_size=CHUNK):
    """Rows each reconstruction pass contributes to Q_obs, in the order reconstruction_queries
    sends them (their sum is W): the pass's whole length with rows="all", its chunk's with
    rows="context"."""
    if rows not in ROWS:
        raise ValueError(f"pass_rows: rows={rows!r} is not one of {ROWS}")
    return [len(ids) if rows == "all" else end - start
            for start, end, ids in repeat_passes(tokenizer, context_ids, chunk_size)]


def passes_option(tokenizer, context_ids, rows="all", chunk_size=CHUNK):
    """The kvzip spec options that make kvcd normalise each pass's rows over the sinks and its
    own chunk (KVzipPress's normalisation; see the module's docstring): ",passes=R0/R1/...,chunk=C"
    to append to a spec that is a kvzip term alone; with_passes places them in a spec of several
    terms ("kvzip:...+q8+r=0")."""
    return format_passes(pass_rows(tokenizer, context_ids, rows, chunk_size), chunk_size)


def format_passes(counts, chunk_size=CHUNK):
    """",passes=R0/R1/...,chunk=C": the spec options of passes with these row counts."""
    return f",passes={'/'.join(str(int(r)) for r in counts)},chunk={chunk_size}"


def add_passes(spec, counts, chunk_size=CHUNK):
    """`spec` with the passes' options (format_passes) in its kvzip term, wherever that term
    stands: "kvzip:0.42,top=16+q8g64+r=0" -> "kvzip:0.42,top=16,passes=...,chunk=2048+q8g64+r=0"
    (appended at the end they would land in the last term). ValueError without a kvzip term."""
    terms = spec.split("+")
    hits = [i for i, t in enumerate(terms) if t.strip().startswith(("kvzip:", "kvzip@"))]
    if len(hits) != 1:
        raise ValueError(f'spec "{spec}": reconstruction passes need its kvzip term')
    terms[hits[0]] = terms[hits[0]].rstrip() + format_passes(counts, chunk_size)
    return "+".join(terms)


def with_passes(spec, tokenizer, context_ids, rows="all", chunk_size=CHUNK):
    """`spec` with the passes of this context named in its kvzip term (add_passes of pass_rows):
    what to send with reconstruction_inputs' queries, whatever other terms the spec has."""
    return add_passes(spec, pass_rows(tokenizer, context_ids, rows, chunk_size), chunk_size)


def _run(model, tokenizer, context_ids, past_key_values, rows, chunk_size):
    import torch
    from transformers import DynamicCache
    if rows not in ROWS:
        raise ValueError(f"reconstruction_queries: rows={rows!r} is not one of {ROWS}")
    S = len(context_ids)
    if S < 1:
        raise ValueError("reconstruction_queries: empty context")
    passes = repeat_passes(tokenizer, context_ids, chunk_size)
    cache = past_key_values if past_key_values is not None else DynamicCache()
    if len(passes) > 1 and not hasattr(cache, "crop"):
        raise TypeError("reconstruction_queries: a context of several chunks needs a cache "
                        f"with crop() (DynamicCache), not {type(cache).__name__}")
    parts = []
    for i, (start, end, rep) in enumerate(passes):
        # Without a cache the first pass runs over the context and its repetition together.
        fresh = past_key_values is None and i == 0
        ids = [int(t) for t in context_ids] + rep if fresh else rep
        base = S if fresh else cache.get_seq_length()
        W = len(rep) if rows == "all" else end - start
        with torch.no_grad(), capture_last(model, W, keys=len(rep)) as store:
            model.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
        parts.append(layer_rows(model, store))
        if hasattr(cache, "crop"):
            cache.crop(base)  # the context's cache only, for the next pass and the caller
    if len(parts) == 1:
        return parts[0]
    L = len(parts[0][0])
    return ([torch.cat([p[0][l] for p in parts], dim=1) for l in range(L)],
            [torch.cat([p[1][l] for p in parts], dim=1) for l in range(L)])


def reconstruction_queries(model, tokenizer, context_ids, past_key_values=None, rows="all",
                           chunk_size=CHUNK):
    """kvzip's Q_obs: per layer the post-RoPE queries [Hq, W, D] (float32) of the reconstruction
    passes over `context_ids` (S tokens): all rows of every pass, W = the total length of
    repeat_passes(...) (len(repeat_ids(...)) for one chunk), or with rows="context" the rows of
    the copied context tokens, W = S. Without `past_key_values` the first pass runs over the
    context and its repetition together; with it (the context's cache, S entries a layer) only
    the repetitions run."""
    return _run(model, tokenizer, context_ids, past_key_values, rows, chunk_size)[0]


def reconstruction_inputs(model, tokenizer, context_ids, past_key_values=None, rows="all",
                          chunk_size=CHUNK):
    """(queries, log-masses): kvzip's Q_obs as reconstruction_queries returns them and, per
    layer, each row's log-sum-exp over the pass's own keys up to it (float32 [Hq, W]), sent as
    the layer's q_stats with `stats=1`."""
    return _run(model, tokenizer, context_ids, past_key_values, rows, chunk_size)

"""Reconstruction queries for kvcd's `kvzip` policy (KVzip-style context reconstruction).

kvzip scores a cached token by the largest attention it receives from the queries of a pass in
which the model repeats the context: the prompt "\\n\\nRepeat the previous context exactly.",
a newline, then the context itself. A prefill node that runs a Hugging Face Llama-family model
(q_proj, RoPE, no query norm) gets those queries with one more forward pass:

    from kvc.recon import reconstruction_queries
    q = reconstruction_queries(model, tokenizer, context_ids)  # per layer [Hq, S, D], post-RoPE
    client.put(cache_id, [(k[l], v[l], q[l]) for l in range(L)],
               compression="kvzip:0.1,ada=0.2,xlayer=1")

The queries are those of the last S positions of the pass (the newline that starts the answer and
the copies of context tokens 0..S-2, i.e. the queries that reproduce tokens 0..S-1), so W = S.
The pass costs about twice the prefill of the context (it attends over the context and itself);
with `past_key_values` holding the context's cache it costs one prefill of S + 9 tokens (the cache
grows by those tokens; pass a copy if it is needed afterwards). Needs torch and transformers,
imported here only.
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
def capture_last(model, n):
    """Hooks every attention module of `model` for one forward pass and yields a dict that then
    holds, per layer index, (hidden_states, cos, sin) of the pass's last `n` positions."""
    store = {}

    def hook(module, args, kwargs, output):
        cos, sin = kwargs["position_embeddings"]
        store[module.layer_idx] = (kwargs["hidden_states"][:, -n:].detach(),
                                   cos[:, -n:].detach(), sin[:, -n:].detach())
        return output

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


def reconstruction_queries(model, tokenizer, context_ids, past_key_values=None):
    """kvzip's Q_obs: per layer the post-RoPE queries [Hq, S, D] (float32) of the reconstruction
    pass over `context_ids` (S tokens). Without `past_key_values` the pass runs over the context
    and the repetition together; with it (the context's cache, S entries a layer) only the
    repetition runs."""
    import torch
    S = len(context_ids)
    if S < 1:
        raise ValueError("reconstruction_queries: empty context")
    rep = repeat_ids(tokenizer, context_ids)
    ids = rep if past_key_values is not None else [int(t) for t in context_ids] + rep
    with torch.no_grad(), capture_last(model, S) as store:
        model.model(input_ids=torch.tensor([ids]), past_key_values=past_key_values,
                    use_cache=past_key_values is not None)
    out = []
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            h, cos, sin = store[i]
            out.append(post_rope_queries(layer.self_attn, h, cos, sin))
    return out

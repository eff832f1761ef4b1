"""Context reconstruction (KVzip): one extra pass per document and scenario that repeats the
context after it, shared by kvpress's KVzipPress rows and kvc's `kvzip` rows.

KVzip (Kim et al., 2025) scores a cached token by how much the model attends to it while it
reproduces the context: the prompt "\\n\\nRepeat the previous context exactly." and the context
itself are run on top of the cache, and a token's score is the largest attention any of those
queries (any head of its group) gives it. kvpress's KVzipPress does this inside its pipeline;
here the pass runs once on the fp32 shadow over the captured keys and values, with two hooks on
every attention module:

- kvpress's own `KVzipPress.forward_hook` (its `score_kvzip`), which fills the press's
  `score_val` [layers, 1, Hkv, S]; each kvpress row then runs the press's `compress_post` (its
  selection: across all layers and heads, or per layer with `layerwise`) on a copy of it and
  reads back `masked_key_indices`, as its attention patch would during decoding;
- kvc.recon's capture of the post-RoPE queries of every position of the pass (the instruction's
  and the newline's 9 tokens, then the S copied context tokens; what a user's prefill node runs
  with kvc.recon), which kvc's `kvzip` rows upload as Q_obs (W = S + 9). kvcd's scorer
  (kernels/cpu/scoring.cc) gives each token the maximum of those queries' softmax over the S
  context keys.

Where the two differ (the parity table in docs/fidelity-smollm2.md measures it): kvpress's
softmax also runs over the reconstruction tokens' own keys, which kvcd does not hold; kvc's rows
with `stats=1` send each row's log-mass over them (`lse`, kvc.recon.row_log_mass) and kvcd adds
it to the denominator, without it kvcd normalises over the context only. (Before kvcd took more
rows than tokens for kvzip, kvc's rows were the last S only, leaving out the instruction's.)

Documents are raw text without a chat template, so the press's prefix is empty and its suffix is
"\\n" (KVzipPress's choice for a model without one). Contexts longer than the press's chunk size
(2,048 tokens) take one pass per chunk (kvc.recon.repeat_passes, checked against the press's own
prepare()): kvpress scores each chunk's tokens with that chunk's pass, normalised over the sinks,
the chunk and the pass; kvc's rows are every pass's queries, each normalised by kvcd over all S
context keys (plus its log-mass over its own pass).
"""

import logging

import torch
from kvpress import KVzipPress
from kvpress.utils import extract_keys_and_values
from transformers import DynamicCache

from kvc.recon import capture_last, layer_rows, repeat_passes

# KVzipPress warns about its cost on every construction; the harness states it once (run.json).
logging.getLogger("kvpress.presses.kvzip_press").setLevel(logging.ERROR)



class Reconstruction:
    """The reconstruction pass of one context: kvpress scores and kvc's Q_obs per layer."""

    def __init__(self, tok, shadow, context_ids, layers_in32, plus=False):
        """`plus`: also score the pass with KVzip+ (scores_plus; it costs a ||v W_O|| per value
        and query head in every layer, so it runs only when asked)."""
        S = len(context_ids)
        self.length = S
        press = KVzipPress(compression_ratio=0.5)
        lm = shadow.model
        cache = DynamicCache()
        for i, x in enumerate(layers_in32):
            cache.update(x.keys.clone(), x.values.clone(), i)
        passes = repeat_passes(tok, context_ids, press.chunk_size)
        # The press's internal state as its __call__ and prepare() set it; its own chunking must
        # give the passes kvc.recon runs (both sides score the same passes).
        press.prefix_length = 0
        press.context_length = S
        press._context_ids = torch.tensor([[int(t) for t in context_ids]])
        press._suffix_ids = torch.tensor([tok("\n", add_special_tokens=False)["input_ids"]])
        theirs = [r[0].tolist() for _, r in press.prepare(shadow, tok)]
        if theirs != [ids for _, _, ids in passes]:
            raise RuntimeError("kvzip rows: kvpress's reconstruction passes differ from kvc.recon's")
        press.score_val = torch.zeros(len(lm.layers), 1, shadow.config.num_key_value_heads, S)
        # KVzip+ (KVzipPress's kvzip_plus_normalization) scores the same pass: a second press
        # whose score_kvzip runs in a hook of its own before the first press's hook, which crops
        # the cache.
        plus_press = None
        hook_fns = [press.forward_hook]
        if plus:
            plus_press = KVzipPress(compression_ratio=0.5, kvzip_plus_normalization=True)
            plus_press.prefix_length, plus_press.context_length = 0, S
            plus_press.score_val = press.score_val.clone()

            def plus_hook(module, args, kwargs, output):
                cache = kwargs.get("past_key_values") or kwargs.get("past_key_value")
                keys, values = extract_keys_and_values(cache, module.layer_idx)
                plus_press.score_kvzip(module, kwargs["hidden_states"], keys, values, None, kwargs)
                return output

            hook_fns.insert(0, plus_hook)

        self.passes = len(passes)
        self.chunk = press.chunk_size
        self.pass_spans = [(start, end, len(ids)) for start, end, ids in passes]
        parts = []
        for start, end, ids in passes:
            press.start_idx, press.end_idx = start, end
            if plus_press is not None:
                plus_press.start_idx, plus_press.end_idx = start, end
            n = len(ids)
            # kvc's capture (kvc.recon, what users run) first, then kvpress's own scoring hook,
            # which also crops the cache back to the context.
            with capture_last(shadow, n, keys=n) as store:
                hooks = [layer.self_attn.register_forward_hook(f, with_kwargs=True)
                         for layer in lm.layers for f in hook_fns]
                try:
                    with torch.no_grad():
                        lm(input_ids=torch.tensor([ids]), past_key_values=cache)
                finally:
                    for h in hooks:
                        h.remove()
            if cache.get_seq_length() != S:
                raise RuntimeError("kvzip rows: the cache was not cropped back to the context")
            parts.append(layer_rows(shadow, store))  # [Hq, n, D] fp32, [Hq, n] (stats=1)
        self.scores = press.score_val.clone()  # [L, 1, Hkv, S]
        self.scores_plus = plus_press.score_val.clone() if plus_press is not None else None
        self.q_obs = [torch.cat([p[0][i] for p in parts], dim=1) for i in range(len(lm.layers))]
        self.lse = [torch.cat([p[1][i] for p in parts], dim=1) for i in range(len(lm.layers))]
        self._keys = [x.keys[0] for x in layers_in32]  # [Hkv, S, D] fp32, for top_scores
        self._top = {}

    def top_scores(self, k):
        """[L, 1, Hkv, S]: KVzipPress's scores with the maximum over the group's rows replaced by
        the mean of the k largest probabilities (kvcd's `top=k`): each pass's rows normalised as
        the press does (over the sinks, the pass's chunk and, by its log-mass, its own tokens),
        a token scored by the rows of the pass that repeats it. k = 1 gives self.scores."""
        if k in self._top:
            return self._top[k]
        sinks = KVzipPress.n_sink  # the press's default (a dataclass field)
        L, (hkv, S, D) = len(self._keys), self._keys[0].shape
        out = torch.zeros(L, 1, hkv, S)
        for li in range(L):
            q, lse, keys = self.q_obs[li], self.lse[li], self._keys[li]
            g = q.shape[0] // hkv
            r0 = 0
            for start, end, rows in self.pass_spans:
                idx = torch.cat([torch.arange(min(sinks, start)), torch.arange(start, end)])
                qp = q[:, r0:r0 + rows].reshape(hkv, g * rows, D)
                lg = torch.matmul(qp, keys[:, idx].transpose(1, 2)) / D ** 0.5
                den = torch.logaddexp(torch.logsumexp(lg, -1),
                                      lse[:, r0:r0 + rows].reshape(hkv, g * rows))
                p = torch.exp(lg - den.unsqueeze(-1))[:, :, len(idx) - (end - start):]
                top = p.topk(min(k, g * rows), dim=1).values  # [Hkv, k', chunk]
                out[li, 0, :, start:end] = top.sum(1) / k
                r0 += rows
        self._top[k] = out
        return out

    def kvpress_valid(self, shadow, keep, layerwise, pool=1, weights=None, plus=False, top=1,
                      bonus=None):
        """Per layer [Hkv, S] kept masks of KVzipPress(compression_ratio=1-keep, layerwise), on
        its KVzip+ scores with `plus`; with pool > 1 (odd), each head's scores are max-pooled over
        `pool` neighbouring tokens first;
        with `weights` (per layer [Hkv, S]), each score is multiplied by its weight first (the
        sinks are still set by the press afterwards); with top > 1, on top_scores(top)."""
        press = KVzipPress(compression_ratio=1.0 - keep, layerwise=layerwise)
        if plus and self.scores_plus is None:
            raise ValueError("kvzip-plus rows: the reconstruction ran without plus=True")
        if top > 1 and plus:
            raise ValueError("kvzip rows: top and plus together are not measured")
        press.score_val = (self.scores_plus if plus else
                           self.top_scores(top) if top > 1 else self.scores).clone()
        if weights is not None:
            w = torch.stack([x.to(press.score_val.dtype) for x in weights])  # [L, Hkv, S]
            press.score_val = press.score_val * w[:, None]
        if bonus is not None:  # per layer [Hkv, S], added after the weights (kvc.bench.heads)
            b = torch.stack([x.to(press.score_val.dtype) for x in bonus])
            press.score_val = press.score_val + b[:, None]
        if pool > 1:
            sv = press.score_val
            pooled = torch.nn.functional.max_pool1d(sv.reshape(-1, 1, sv.shape[-1]).float(), pool,
                                                    stride=1, padding=pool // 2)
            press.score_val = pooled.reshape(sv.shape).to(sv.dtype)
        lm = shadow.model
        for layer in lm.layers:
            layer.self_attn.masked_key_indices = None
        press.compress_post(shadow)
        out = []
        for layer in lm.layers:
            valid = torch.ones(self.scores.shape[2], self.length, dtype=torch.bool)
            m = layer.self_attn.masked_key_indices
            layer.self_attn.masked_key_indices = None
            if m is not None:
                _, h_idx, s_idx = m
                valid[h_idx, s_idx] = False
            out.append(valid)
        return out

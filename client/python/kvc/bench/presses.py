"""kvpress rows: a press's own `score`/`compress` on the captured inputs of one prefill.

Every press runs on the fp32 shadow of the model's attention modules with fp32 copies of the
captured hidden states, keys and values (bf16 values are exact in fp32), the RoPE cos/sin of the
prefill and the keyword arguments kvpress's forward hook passes (`hidden_states`,
`position_embeddings`, `cache_position`). What comes back is the kept positions per layer and
head (`indices`, for the parity report) and a RowCache in the model's dtype:

- ScorerPress subclasses (StreamingLLM, Knorm, SnapKV, KeyDiff, ExpectedAttention, TOVA,
  CriticalKV): indices = scores.topk(compute_n_kept(S, ratio)), exactly ScorerPress.compress.
- AdaKVPress / CriticalAdaKVPress: compress sets module.masked_key_indices (kvpress masks those
  keys during decoding through its attention patch); here they become the RowCache's validity.
- ComposedPress(SnapKV, ThinK): the presses in order on the output of the previous one, as
  ComposedPress's hook does through the cache; ThinK zeroes key channels.
"""

from typing import NamedTuple

import torch
from kvpress import (AdaKVPress, ComposedPress, CriticalAdaKVPress, CriticalKVPress,
                     ExpectedAttentionPress, KeyDiffPress, KnormPress, ScorerPress, SnapKVPress,
                     StreamingLLMPress, ThinKPress, TOVAPress)
from kvpress.utils import compute_n_kept

from .model import RowCache

# name -> press factory of the compression ratio (1 - keep)
PRESSES = {
    "streaming": lambda r: StreamingLLMPress(compression_ratio=r),
    "knorm": lambda r: KnormPress(compression_ratio=r),
    "snapkv": lambda r: SnapKVPress(compression_ratio=r),
    "keydiff": lambda r: KeyDiffPress(compression_ratio=r),
    "expected": lambda r: ExpectedAttentionPress(compression_ratio=r),
    "tova": lambda r: TOVAPress(compression_ratio=r),
    "adakv-snapkv": lambda r: AdaKVPress(SnapKVPress(compression_ratio=r)),
    "adakv-expected": lambda r: AdaKVPress(ExpectedAttentionPress(compression_ratio=r)),
    "criticalkv-snapkv": lambda r: CriticalKVPress(SnapKVPress(compression_ratio=r)),
    "criticaladakv-snapkv": lambda r: CriticalAdaKVPress(SnapKVPress(compression_ratio=r)),
    "snapkv+think0.5": lambda r: ComposedPress([SnapKVPress(compression_ratio=r),
                                                ThinKPress(key_channel_compression_ratio=0.5)]),
}


class ReconPress(NamedTuple):
    """A press that scores by reconstructing the context (recon.py: one extra pass per scenario).
    layerwise: KVzipPress's `layerwise` (False: one selection over all layers and heads, its
    default); pool: a max-pooling kernel over each head's scores before selection (1: none, as
    KVzip); vnorm: each score weighted by its token's value norm first; plus: KVzipPress's scores
    with its `kvzip_plus_normalization` (KVzip+: each attention weight times ||v W_O|| of its
    token over the norm of its query row's attention input); top: each token scored by the mean
    of the `top` largest probabilities its rows give it instead of the largest (kvcd's kvzip
    option top=K, the same selection)."""
    layerwise: bool = False
    pool: int = 1
    vnorm: bool = False
    plus: bool = False
    top: int = 1


# The pooled and weighted rows are experiments (docs/fidelity-smollm2.md, "Pooling KVzip's
# scores"): SnapKV's pooling, and the value-norm weighting of VATP (Guo et al., 2024), applied to
# KVzip's scores; the plus rows are kvpress's KVzip+ ("KVzip+: kvpress's other KVzip"); the top
# rows are kvcd's kvzip top=K on kvpress's side (how K was chosen: "KVzip top rows").
RECON_PRESSES = {"kvzip": ReconPress(), "kvzip-layer": ReconPress(layerwise=True),
                 "kvzip-pool3": ReconPress(pool=3), "kvzip-pool7": ReconPress(pool=7),
                 "kvzip-pool11": ReconPress(pool=11), "kvzip-vnorm": ReconPress(vnorm=True),
                 "kvzip-plus": ReconPress(plus=True),
                 "kvzip-plus-layer": ReconPress(layerwise=True, plus=True),
                 **{f"kvzip-top{k}": ReconPress(top=k) for k in (2, 4, 8, 16, 32)}}


def recon_needs_plus(names):
    """Whether any of the press names is a reconstruction press on KVzip+ scores (the pass then
    computes them too: Reconstruction(plus=True))."""
    return any(name in RECON_PRESSES and RECON_PRESSES[name].plus for name in names)


def _kwargs(x, hs):
    S = hs.shape[1]
    return {"hidden_states": hs, "position_embeddings": (x.cos.float(), x.sin.float()),
            "cache_position": torch.arange(S), "attention_mask": None}


def _scorer_indices(press, module, hs, keys, values, kw):
    scores = press.score(module, hs, keys, values, None, kw)
    n_kept = compute_n_kept(keys.shape[2], press.compression_ratio)
    return scores.topk(n_kept, dim=-1).indices[0]  # [Hkv, n]


def compress_layer(press, module, x):
    """(keys, values, valid, indices) of one layer; keys/values fp32 [Hkv, n, D]; indices
    [Hkv, n] kept positions (None for masked presses: valid marks them)."""
    hs, keys, values = x.hidden.float(), x.keys.float(), x.values.float()
    kw = _kwargs(x, hs)
    S = keys.shape[2]
    if isinstance(press, (AdaKVPress, CriticalAdaKVPress)):
        module.masked_key_indices = None
        press.compress(module, hs, keys, values, None, kw)
        _, h_idx, s_idx = module.masked_key_indices
        module.masked_key_indices = None
        valid = torch.ones(keys.shape[1], S, dtype=torch.bool)
        valid[h_idx, s_idx] = False
        return keys[0], values[0], valid, None
    if isinstance(press, ComposedPress):
        first, *rest = press.presses
        k, v, valid, idx = compress_layer(first, module, x)
        for p in rest:
            if not isinstance(p, ThinKPress):
                raise ValueError(f"ComposedPress: {type(p).__name__} after the first press")
            k2, v2 = p.compress(module, hs, k.unsqueeze(0).clone(), v.unsqueeze(0), None, kw)
            k, v = k2[0], v2[0]
        return k, v, valid, idx
    if isinstance(press, ThinKPress):
        k2, v2 = press.compress(module, hs, keys.clone(), values, None, kw)
        return k2[0], v2[0], torch.ones(keys.shape[1], S, dtype=torch.bool), None
    if not isinstance(press, ScorerPress):
        raise ValueError(f"{type(press).__name__}: not handled by the harness")
    idx = _scorer_indices(press, module, hs, keys, values, kw)
    ix = idx.unsqueeze(-1).expand(-1, -1, keys.shape[-1])
    return (keys[0].gather(1, ix), values[0].gather(1, ix),
            torch.ones(idx.shape, dtype=torch.bool), idx)


class ScoreMemo:
    """Scores of one scenario's captured layers, shared by every press built on the same scorer.

    A ScorerPress's score does not depend on its compression ratio (StreamingLLM's does and is
    left alone), so SnapKV's scores serve SnapKV, AdaKV(SnapKV), CriticalKV(SnapKV) and
    SnapKV+ThinK at every ratio. `wrap` replaces the innermost scorer's `score` by a lookup
    that computes once per (scorer configuration, layer) and returns a copy (presses modify
    scores in place)."""

    def __init__(self):
        self.cache = {}

    @staticmethod
    def _inner(press):
        while isinstance(press, (AdaKVPress, CriticalAdaKVPress, CriticalKVPress)):
            press = press.press
        if isinstance(press, ComposedPress):
            return ScoreMemo._inner(press.presses[0])
        return press

    def wrap(self, press):
        inner = self._inner(press)
        if not isinstance(inner, ScorerPress) or isinstance(inner, StreamingLLMPress):
            return press
        fields = {k: v for k, v in vars(inner).items() if k not in ("compression_ratio", "score")}
        key = (type(inner).__name__, repr(sorted(fields.items())))
        orig = type(inner).score.__get__(inner)

        def score(module, hidden_states, keys, values, attentions, kwargs):
            k = (key, module.layer_idx)
            if k not in self.cache:
                self.cache[k] = orig(module, hidden_states, keys, values, attentions, kwargs)
            return self.cache[k].clone()
        inner.score = score
        return press


def fp32_layers(layers_in):
    """fp32 copies of the captured layers (made once per scenario, shared by every press)."""
    from .model import LayerInput
    return [LayerInput(x.hidden.float(), x.keys.float(), x.values.float(), x.cos.float(),
                       x.sin.float()) for x in layers_in]


def compress(press, shadow, layers_in, dtype):
    """RowCache (model dtype) and the per-layer kept indices (None entries for masked presses)
    of `press` on the captured layers (fp32 copies: fp32_layers)."""
    out, kept, positions = [], [], []
    with torch.no_grad():
        for li, x in enumerate(layers_in):
            module = shadow.model.layers[li].self_attn
            k, v, valid, idx = compress_layer(press, module, x)
            out.append((k.to(dtype), v.to(dtype), valid))
            kept.append(idx)
            positions.append(idx if idx is not None else
                             torch.arange(valid.shape[1]).expand(valid.shape[0], -1))
    row = RowCache(out)
    row.positions = positions
    return row, kept


def compress_recon(name, recon, shadow, layers_in, keep, dtype):
    """RowCache of a reconstruction press (RECON_PRESSES) at keep ratio `keep`."""
    p = RECON_PRESSES[name]
    weights = [x.values[0].float().norm(dim=-1) for x in layers_in] if p.vnorm else None
    valid = recon.kvpress_valid(shadow, keep, p.layerwise, p.pool, weights, p.plus, p.top)
    row = RowCache([(x.keys[0].to(dtype), x.values[0].to(dtype), m)
                    for x, m in zip(layers_in, valid)])
    row.positions = [torch.arange(m.shape[1]).expand(m.shape[0], -1) for m in valid]
    return row


def masked_kept(layers):
    """Per layer [Hkv] counts of valid entries."""
    return [m.sum(1) for _, _, m in layers]

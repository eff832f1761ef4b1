"""What kvc needs to know about the model a vLLM instance serves: its shape, its rotary
embedding (for kvcd's contiguous export and expected attention) and a fingerprint.

The fingerprint identifies the model whose cache a prefill instance stored, so a decode instance
serving another model refuses the cache instead of decoding garbage. It hashes the architecture
fields of the Hugging Face config (layers, heads, sizes, vocabulary, RoPE, norm epsilon, tied
embeddings) and, when the model is a local directory, the header and first MiB of every
safetensors file (fine-tunes of one architecture differ there). A model loaded by hub id is
fingerprinted by its config only; kv_connector_extra_config "fingerprint" overrides both.
Imports neither vLLM nor torch, so tools (kvc-qstats) and tests compute the same value.
"""

import glob
import hashlib
import json
import os

from .spec import SpecError

_CONFIG_FIELDS = ("architectures", "model_type", "num_hidden_layers", "hidden_size",
                  "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "vocab_size", "rms_norm_eps", "tie_word_embeddings", "partial_rotary_factor")


def _get(cfg, key, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def rope_parameters(cfg):
    """(theta, rope_type, factor) of a Hugging Face config (object or dict), old or new style."""
    params = _get(cfg, "rope_parameters")
    if isinstance(params, dict) and params:
        if "rope_theta" not in params and len(params) == 1:  # per-layer-type dicts
            params = next(iter(params.values()))
        theta = params.get("rope_theta", _get(cfg, "rope_theta"))
        kind = params.get("rope_type", params.get("type", "default"))
        return float(theta), kind or "default", float(params.get("factor", 1.0) or 1.0)
    scaling = _get(cfg, "rope_scaling") or {}
    theta = _get(cfg, "rope_theta", 10000.0)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    return float(theta), kind or "default", float(scaling.get("factor", 1.0) or 1.0)


def head_dim_of(cfg):
    d = _get(cfg, "head_dim")
    return int(d) if d else int(_get(cfg, "hidden_size")) // int(_get(cfg, "num_attention_heads"))


def rope_spec(cfg, style="ROPE_HALF_SPLIT"):
    """The model's RopeSpec dict for kvcd, or raises SpecError when kvcd cannot shift it.

    style: Hugging Face Llama-family checkpoints (vLLM's is_neox_style) rotate pairs (i, i + n/2),
    ROPE_HALF_SPLIT; GPT-J style pairs are ROPE_INTERLEAVED (kv_connector_extra_config
    "rope_style").
    """
    theta, kind, factor = rope_parameters(cfg)
    rotary = int(head_dim_of(cfg) * float(_get(cfg, "partial_rotary_factor", 1.0) or 1.0))
    spec = {"theta": theta, "rotary_dims": rotary, "style": style}
    if kind in ("default", None):
        spec["scaling"] = "ROPE_SCALING_NONE"
    elif kind == "linear":
        spec["scaling"], spec["scaling_factor"] = "ROPE_SCALING_LINEAR", factor
    else:
        raise SpecError(f"the model's RoPE scaling '{kind}' cannot be shifted by kvcd (it takes "
                        f"none or linear): evicted caches and expected attention are refused")
    return spec


def config_fingerprint_fields(cfg):
    out = {k: _get(cfg, k) for k in _CONFIG_FIELDS}
    out["head_dim"] = head_dim_of(cfg)
    out["rope"] = list(rope_parameters(cfg))
    return out


def weights_digest(model_dir, max_bytes=1 << 20):
    """sha256 over the header and first `max_bytes` of every *.safetensors in model_dir (sorted),
    or None when there are none."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        return None
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(head)
            h.update(f.read(min(n, 100 << 20)))
            h.update(f.read(max_bytes))
    return h.hexdigest()


def fingerprint(cfg, model_dir=None):
    """The model fingerprint: 24 hex digits."""
    h = hashlib.sha256(json.dumps(config_fingerprint_fields(cfg), sort_keys=True,
                                  default=str).encode())
    if model_dir and os.path.isdir(model_dir):
        digest = weights_digest(model_dir)
        if digest:
            h.update(digest.encode())
    return h.hexdigest()[:24]


class ModelInfo:
    """The served model as kvc sees it, from vLLM's config (both connector roles build one)."""

    def __init__(self, vllm_config, kv_cache_config, extra):
        mc = vllm_config.model_config
        pc = vllm_config.parallel_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise SpecError("KvcConnector: tensor and pipeline parallelism are not supported yet "
                            f"(tp={pc.tensor_parallel_size}, pp={pc.pipeline_parallel_size})")
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise SpecError(f"KvcConnector: the model has {len(groups)} KV-cache groups; only "
                            f"models with one full-attention group (Llama-like) are supported")
        self.layer_names = list(groups[0].layer_names)
        self.num_layers = len(self.layer_names)
        self.num_kv_heads = mc.get_num_kv_heads(pc)
        self.num_q_heads = mc.get_num_attention_heads(pc)
        self.head_dim = mc.get_head_size()
        self.block_size = vllm_config.cache_config.block_size
        cache_dtype = vllm_config.cache_config.cache_dtype
        if cache_dtype not in ("auto", "float32", "float16", "bfloat16", "half"):
            raise SpecError(f"KvcConnector: kv-cache-dtype '{cache_dtype}' is not supported "
                            f"(kvcd stores float32, float16 or bfloat16 caches)")
        self.hf_config = mc.hf_text_config
        self.rope_style = extra.get("rope_style", "ROPE_HALF_SPLIT")
        if self.rope_style not in ("ROPE_HALF_SPLIT", "ROPE_INTERLEAVED"):
            raise SpecError(f"rope_style: '{self.rope_style}' is not ROPE_HALF_SPLIT or "
                            f"ROPE_INTERLEAVED")
        try:
            self.rope = rope_spec(self.hf_config, self.rope_style)
            self.rope_error = None
        except SpecError as e:
            self.rope, self.rope_error = None, str(e)
        fp = extra.get("fingerprint")
        self.fingerprint = str(fp) if fp else fingerprint(self.hf_config, mc.model)

"""Compression specs and kv_transfer_params for kvc inside vLLM (no vLLM or torch import here).

A spec is what kvcd does to a prompt's cache (proto CompressionConfig). The connector takes it
as a spec string (kvc's one-line form, kernels/core/include/kvc/spec.h: terms joined by '+',
e.g. "keydiff:0.5", "expected:0.25", "think:0.5+q4", "q8", "none") or as the CompressionConfig
dict ({"eviction": {"policy": "keydiff", "keep_ratio": 0.5}, "quant": {"bits": 4}}).

vLLM gives a KV connector no attention queries, so a spec must score tokens without the
prompt's observation window (Q_obs):
  - keydiff, knorm, streaming, random and none need nothing;
  - expected scores from query statistics (mean and covariance of the un-rotated queries) read
    from a statistics file (kvc-qstats) instead of Q_obs;
  - think (ThinK key-channel pruning) scores channels with mean_t q_c^2 from the same file
    (one synthetic observation row per query head) instead of the prompt's last queries;
  - h2o, snapkv, keyformer, kvzip (queries of a pass that repeats the context) and
    value-channel pruning (vthink) need Q_obs: refused with SpecError naming the alternatives.
Head-adaptive budgets (ada=) and per-layer budgets (lb=) are refused: the evicted mode needs the
same kept count K in every layer and head.

Modes: a spec whose eviction keeps every token is full length ("full": the decode instance loads
a dense cache of the prompt's length, dequantized, pruned channels zero); one that evicts is
"evicted" (the decode instance loads K tokens as FORMAT_DENSE_CONTIGUOUS and runs a K + 1 token
request; see docs/vllm.md).
"""

import hashlib
import math
import re

PARAMS_VERSION = 1
EVICTION_POLICIES = ("none", "streaming", "h2o", "snapkv", "keyformer", "knorm", "random",
                     "keydiff", "expected", "kvzip")
NEEDS_QOBS = ("h2o", "snapkv", "keyformer", "kvzip")
QUERY_FREE = ("keydiff", "expected (with query statistics)", "knorm", "streaming", "random")
CACHE_ID_RE = re.compile(r"^[A-Za-z0-9._:/-]{1,256}$")


class SpecError(ValueError):
    """A spec or kv_transfer_params that kvc cannot serve inside vLLM; the message says why."""


# ---- Spec strings ----------------------------------------------------------------------------

def _number(what, text, kind=float):
    try:
        v = kind(text)
    except ValueError:
        raise SpecError(f"{what} '{text}' is not {'an integer' if kind is int else 'a number'}")
    if kind is float and not math.isfinite(v):
        raise SpecError(f"{what} '{text}' is not finite")
    return v


def _fraction(what, text):
    v = _number(what, text)
    if not 0.0 <= v < 1.0:
        raise SpecError(f"{what} {text} is outside [0, 1)")
    return v


_EVICTION_KEYS = {
    "sink": ("sink_tokens", int), "recent": ("recent_fraction", float),
    "kernel": ("pool_kernel", int), "pool": ("pool", str), "tau": ("tau", float),
    "seed": ("seed", int), "layer": ("granularity", str), "value": ("value_weight", str),
    "veps": ("value_eps", float), "horizon": ("horizon", int), "lb": ("layer_budgets", str),
    "ada": ("adaptive_floor", float), "stats": ("query_stats", str),
}


def _eviction_term(name, rest, term):
    ev = {"policy": name}
    amount, *options = rest.split(",")
    if amount.startswith("@"):
        budget = _number(f"term \"{term}\": budget", amount[1:], int)
        if budget < 1:
            raise SpecError(f"term \"{term}\": budget {budget} must be >= 1")
        ev["budget"] = budget
    elif amount.startswith(":"):
        keep = _number(f"term \"{term}\": keep", amount[1:])
        if not 0.0 < keep <= 1.0:
            raise SpecError(f"term \"{term}\": keep {amount[1:]} is outside (0, 1]")
        ev["keep_ratio"] = keep
    else:
        raise SpecError(f"term \"{term}\": write {name}:KEEP or {name}@BUDGET")
    for opt in options:
        key, eq, value = opt.partition("=")
        if not eq or key not in _EVICTION_KEYS:
            raise SpecError(f"term \"{term}\": unknown option '{opt}' "
                            f"(keys: {', '.join(_EVICTION_KEYS)})")
        field, kind = _EVICTION_KEYS[key]
        if key == "layer":
            if value not in ("0", "1"):
                raise SpecError(f"term \"{term}\": layer '{value}' is not 0 or 1")
            ev[field] = "GRANULARITY_PER_LAYER" if value == "1" else "GRANULARITY_PER_HEAD"
        elif key == "stats":
            if value not in ("0", "1"):
                raise SpecError(f"term \"{term}\": stats '{value}' is not 0 or 1")
            if value == "1":
                ev["query_stats"] = True
        elif key == "lb":
            ev["layer_budgets"] = [_number("lb entry", b, int) for b in value.split("/")]
        elif key == "ada":
            ev["adaptive"] = True
            ev[field] = _number("ada", value)
        elif kind is str:
            ev[field] = value
        else:
            ev[field] = _number(f"term \"{term}\": {key}", value, kind)
    return ev


def parse_spec_string(text):
    """A spec string -> the CompressionConfig dict (proto field names)."""
    if not isinstance(text, str):
        raise SpecError(f"spec: expected a string or a dict, got {type(text).__name__}")
    whole = text.strip()
    if not whole:
        raise SpecError("spec \"\": empty (use 'none' to keep everything)")
    if whole in ("none", "full"):
        return {}
    out, seen = {}, set()
    for term in whole.split("+"):
        term = term.strip()

        def once(kind):
            if kind in seen:
                raise SpecError(f"spec \"{text}\": two {kind} terms")
            seen.add(kind)
        m = re.fullmatch(r"q(\d+)(?:v(\d+))?(?:g(\d+))?", term)
        if m:
            once("quantization")
            bits = int(m.group(1))
            vbits = int(m.group(2)) if m.group(2) else bits
            for what, b in (("bits", bits), ("value bits", vbits)):
                if b not in (2, 4, 8):
                    raise SpecError(f"spec \"{text}\": term \"{term}\": {what} {b} not 2, 4 or 8")
            out["quant"] = {"bits": bits}
            if vbits != bits:
                out["quant"]["value_bits"] = vbits
            if m.group(3):
                out["quant"]["group_size"] = int(m.group(3))
            continue
        if term.startswith("r="):
            once("r=")
            out["recent_tokens"] = _number(f"term \"{term}\": recent tokens", term[2:], int)
            continue
        name = re.match(r"[a-z0-9]*", term).group(0)
        rest = term[len(name):]
        if name in ("think", "l1", "l2", "vthink"):
            if not rest.startswith(":"):
                raise SpecError(f"spec \"{text}\": term \"{term}\": write {name}:LAMBDA")
            lam = _fraction(f"term \"{term}\": lambda", rest[1:])
            ch = out.setdefault("channels", {})
            if name == "vthink":
                once("value-channel")
                ch["prune_values"], ch["value_lambda"] = True, lam
            else:
                once("key-channel")
                ch["key_policy"], ch["key_lambda"] = name, lam
            continue
        if name in EVICTION_POLICIES and name != "none":
            once("eviction")
            out["eviction"] = _eviction_term(name, rest, term)
            continue
        if name in ("none", "full"):
            raise SpecError(f"spec \"{text}\": '{name}' must stand alone")
        raise SpecError(f"spec \"{text}\": unknown term \"{term}\" (eviction: "
                        f"{', '.join(EVICTION_POLICIES)}; channels: think, l1, l2, vthink; "
                        f"qB; r=N)")
    return out


# ---- Specs as vLLM can serve them ------------------------------------------------------------

class Spec:
    """A checked spec: `config` (CompressionConfig dict for kvc.Client), `text` (its string)."""

    def __init__(self, config, text):
        self.config = config
        self.text = text
        ev = config.get("eviction", {})
        ch = config.get("channels", {})
        self.policy = ev.get("policy", "none") or "none"
        self.evicts = self.policy != "none" and not (
            ev.get("keep_ratio", 1.0) >= 1.0 and not ev.get("budget"))
        self.needs_query_stats = self.policy == "expected"
        self.needs_query_squares = ch.get("key_policy") == "think"
        self.lossless = (not self.evicts and ch.get("key_policy", "none") in ("", "none") and
                         not ch.get("prune_values") and not config.get("quant", {}).get("bits"))

    def __repr__(self):
        return f"Spec({self.text!r})"


def canonical_text(config):
    """A readable one-line form of a CompressionConfig dict (for logs and kv_transfer_params)."""
    parts = []
    ev = config.get("eviction", {})
    policy = ev.get("policy", "none") or "none"
    if policy != "none":
        amount = f"@{ev['budget']}" if ev.get("budget") else f":{ev.get('keep_ratio', 1.0):g}"
        opts = "".join(f",{k}={ev[f]}" for k, (f, _) in _EVICTION_KEYS.items()
                       if f in ev and k not in ("layer", "stats", "lb", "ada"))
        if ev.get("granularity") == "GRANULARITY_PER_LAYER":
            opts += ",layer=1"
        parts.append(policy + amount + opts)
    ch = config.get("channels", {})
    if ch.get("key_policy", "none") not in ("", "none"):
        parts.append(f"{ch['key_policy']}:{ch.get('key_lambda', 0.0):g}")
    if ch.get("prune_values"):
        parts.append(f"vthink:{ch.get('value_lambda', 0.0):g}")
    q = config.get("quant", {})
    if q.get("bits"):
        vb = q.get("value_bits") or q["bits"]
        parts.append(f"q{q['bits']}" + (f"v{vb}" if vb != q["bits"] else "")
                     + (f"g{q['group_size']}" if q.get("group_size") else ""))
    if "recent_tokens" in config:
        parts.append(f"r={config['recent_tokens']}")
    return "+".join(parts) or "none"


def parse_spec(value, *, have_query_stats=False):
    """A spec string or CompressionConfig dict -> Spec, refusing what vLLM cannot serve.

    have_query_stats: a query-statistics file is configured (needed by expected and think).
    Raises SpecError with the reason.
    """
    from .._pb import pb  # the proto checks field names and enum values
    from google.protobuf import json_format

    if value is None:
        value = "none"
    if isinstance(value, dict):
        try:
            msg = json_format.ParseDict(value, pb.CompressionConfig())
        except json_format.ParseError as e:
            raise SpecError(f"spec: {e}")
        config = json_format.MessageToDict(msg, preserving_proto_field_name=True)
    else:
        config = parse_spec_string(value)
        try:
            json_format.ParseDict(config, pb.CompressionConfig())
        except json_format.ParseError as e:
            raise SpecError(f"spec \"{value}\": {e}")
    ev = config.get("eviction", {})
    ch = config.get("channels", {})
    policy = ev.get("policy", "") or "none"
    if policy not in EVICTION_POLICIES:
        raise SpecError(f"spec: eviction policy '{policy}' is not one of "
                        f"{', '.join(EVICTION_POLICIES)}")
    if policy in NEEDS_QOBS:
        raise SpecError(f"spec: {policy} scores tokens with the prompt's observation queries "
                        f"(Q_obs), which vLLM does not give KV connectors; use a query-free "
                        f"policy: {', '.join(QUERY_FREE)}")
    if ch.get("prune_values"):
        raise SpecError("spec: value-channel pruning (vthink) scores channels with the "
                        "prompt's observation queries (Q_obs), which vLLM does not give KV "
                        "connectors; prune key channels (think with query statistics, l1, l2)")
    if ev.get("adaptive"):
        raise SpecError("spec: head-adaptive budgets (ada=) give heads different token counts; "
                        "vLLM's paged cache needs the same count in every head")
    if ev.get("layer_budgets"):
        raise SpecError("spec: per-layer budgets (lb=) give layers different token counts; "
                        "vLLM's paged cache needs the same count in every layer")
    if ev.get("query_stats"):
        raise SpecError("spec: query_stats is set by the connector itself (expected reads the "
                        "configured statistics file); leave it out")
    if policy == "expected" and not have_query_stats:
        raise SpecError("spec: expected attention needs query statistics (vLLM gives KV "
                        "connectors no queries): set \"query_stats\" in kv_connector_extra_config "
                        "to a file made by kvc-qstats")
    if ch.get("key_policy") == "think" and not have_query_stats:
        raise SpecError("spec: think scores key channels with queries (vLLM gives KV connectors "
                        "none): set \"query_stats\" in kv_connector_extra_config to a file made "
                        "by kvc-qstats, or prune by magnitude (l1, l2)")
    return Spec(config, canonical_text(config))


# ---- Request data -----------------------------------------------------------------------------

def prompt_hash(token_ids):
    """A short digest of token ids, so the decode side checks it continues the same prompt."""
    h = hashlib.sha256()
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in token_ids))
    return h.hexdigest()[:32]


def sanitize_id(text):
    """`text` with every character outside kvcd's cache-id alphabet replaced by '_'."""
    return re.sub(r"[^A-Za-z0-9._:/-]", "_", text)


def _field(d, key, kind, what, *, optional=False, check=None):
    if key not in d or d[key] is None:
        if optional:
            return None
        raise SpecError(f"kv_transfer_params.kvc.{key}: missing ({what})")
    v = d[key]
    if kind is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise SpecError(f"kv_transfer_params.kvc.{key}: {v!r} is not an integer")
    if kind is str and not isinstance(v, str):
        raise SpecError(f"kv_transfer_params.kvc.{key}: {v!r} is not a string")
    if check is not None and not check(v):
        raise SpecError(f"kv_transfer_params.kvc.{key}: {v!r} is not {what}")
    return v


class LoadParams:
    """The kvc part of a decode request's kv_transfer_params, checked (SpecError otherwise).

    Written by the prefill side's request_finished ({"do_remote_prefill": True, "kvc": {...}});
    the proxy passes it on unchanged. Fields: v, cache_id, replica, seq_len (S, the prompt tokens
    stored: the prompt minus its last token), kept_tokens (K), mode ("full" | "evicted"), spec
    (its text), fingerprint (the model's), prompt_hash (of the S tokens), last_token, and
    optional error (the prefill side could not store the cache: the decode side follows its
    failure policy), load ("async" | "sync"), placeholder (evicted: the token id of the K
    placeholders).
    """

    def __init__(self, params):
        if not isinstance(params, dict):
            raise SpecError(f"kv_transfer_params: expected an object, got {type(params).__name__}")
        d = params.get("kvc")
        if not isinstance(d, dict):
            raise SpecError("kv_transfer_params.kvc: missing or not an object")
        self.raw = d
        v = _field(d, "v", int, f"version {PARAMS_VERSION}", check=lambda x: x == PARAMS_VERSION)
        self.version = v
        self.error = _field(d, "error", str, "a message", optional=True)
        self.seq_len = _field(d, "seq_len", int, "a token count >= 0", check=lambda x: x >= 0)
        self.prompt_hash = _field(d, "prompt_hash", str, "a digest",
                                  check=lambda x: re.fullmatch(r"[0-9a-f]{32}", x) is not None)
        self.fingerprint = _field(d, "fingerprint", str, "a model fingerprint",
                                  check=lambda x: 0 < len(x) <= 128)
        self.last_token = _field(d, "last_token", int, "a token id", check=lambda x: x >= 0)
        self.load = _field(d, "load", str, "'async' or 'sync'", optional=True,
                           check=lambda x: x in ("async", "sync"))
        if self.error is not None:
            self.cache_id = d.get("cache_id") if isinstance(d.get("cache_id"), str) else None
            self.mode, self.kept_tokens, self.replica, self.spec = "full", self.seq_len, None, None
            self.placeholder = None
            return
        self.cache_id = _field(d, "cache_id", str, "a cache id of [A-Za-z0-9._:/-], 1-256 long",
                               check=lambda x: CACHE_ID_RE.match(x) is not None)
        self.replica = _field(d, "replica", str, "a host:port address",
                              check=lambda x: 0 < len(x) <= 512)
        self.mode = _field(d, "mode", str, "'full' or 'evicted'",
                           check=lambda x: x in ("full", "evicted"))
        self.kept_tokens = _field(d, "kept_tokens", int, "a count in [1, seq_len]",
                                  check=lambda x: 1 <= x <= self.seq_len)
        self.spec = _field(d, "spec", str, "a spec string")
        if self.mode == "full" and self.kept_tokens != self.seq_len:
            raise SpecError(f"kv_transfer_params.kvc: mode 'full' with kept_tokens "
                            f"{self.kept_tokens} != seq_len {self.seq_len}")
        if self.mode == "evicted" and self.kept_tokens >= self.seq_len:
            raise SpecError(f"kv_transfer_params.kvc: mode 'evicted' with kept_tokens "
                            f"{self.kept_tokens} >= seq_len {self.seq_len}")
        self.placeholder = _field(d, "placeholder", int, "a token id", optional=True,
                                  check=lambda x: x >= 0)
        self.lossless = self.spec == "none"

    def check_prompt(self, prompt_token_ids):
        """Raises SpecError unless the request's prompt is the one this cache continues."""
        ids = list(prompt_token_ids or ())
        if self.mode == "evicted":
            k = self.kept_tokens
            if len(ids) != k + 1:
                raise SpecError(f"evicted cache: the decode request must have kept_tokens + 1 = "
                                f"{k + 1} prompt tokens (placeholders, then the prompt's last "
                                f"token), it has {len(ids)}; send it through kvc-pd-proxy")
            if ids[-1] != self.last_token:
                raise SpecError("evicted cache: the request's last token is not the prompt's")
            if self.placeholder is not None and any(t != self.placeholder for t in ids[:k]):
                raise SpecError("evicted cache: the first kept_tokens tokens must all be the "
                                "placeholder token")
            return
        s = self.seq_len
        if len(ids) < s + 1:
            raise SpecError(f"the request's prompt has {len(ids)} tokens; the cache holds the "
                            f"first {s} of a {s + 1}-token prompt")
        if prompt_hash(ids[:s]) != self.prompt_hash:
            raise SpecError(f"the request's first {s} prompt tokens are not those the cache "
                            f"was made from")
        if ids[s] != self.last_token:
            raise SpecError("the request's prompt does not continue with the cached prompt's "
                            "last token")

"""Spec strings (the grammar of kvc's tools, kernels/core/include/kvc/spec.h) as CompressionConfig
dicts for kvc.Client.put:

    kvc.spec.parse("snapkv:0.25,kernel=5,pool=avg+think:0.5+q4")
    -> {"eviction": {"policy": "snapkv", "keep_ratio": 0.25, "pool_kernel": 5, "pool": "avg"},
        "channels": {"key_policy": "think", "key_lambda": 0.5}, "quant": {"bits": 4}}

Terms joined by '+', each kind at most once: POLICY:KEEP[,key=value...] or POLICY@BUDGET[,...]
(eviction), think:L | l1:L | l2:L (key channels), vthink:L (value channels), qB[vV][gG]
(quantization: B bits, the values V bits when given, groups of G), r=N (recent tokens), or
'full' / 'none' alone. Eviction keys: sink, recent, kernel, pool, tau, seed, layer, lb, ada,
xlayer, value, veps, horizon, stats, passes and chunk (kvzip's reconstruction passes:
kvc.recon.with_passes), and top (kvzip: a token's score is the mean of the largest `top`
probabilities its reconstruction rows give it). Errors are ValueError naming the term.
kvcd validates the result against the cache's shape as it does for every request.
"""

_POLICIES = ("streaming", "h2o", "snapkv", "keyformer", "knorm", "random", "keydiff",
             "expected", "kvzip")
_CHANNELS = ("think", "l1", "l2")


def _number(what, text, cast=float):
    try:
        return cast(text)
    except ValueError:
        raise ValueError(f"{what} {text!r} is not a number") from None


def _set_eviction_option(ev, key, value):
    if key == "sink":
        ev["sink_tokens"] = _number("sink", value, int)
    elif key == "recent":
        ev["recent_fraction"] = _number("recent", value)
    elif key == "kernel":
        ev["pool_kernel"] = _number("kernel", value, int)
    elif key == "pool":
        if value not in ("max", "avg"):
            raise ValueError(f"pool {value!r} is not max or avg")
        ev["pool"] = value
    elif key == "tau":
        ev["tau"] = _number("tau", value)
    elif key == "seed":
        ev["seed"] = str(_number("seed", value, int))
    elif key == "layer":
        if value not in ("0", "1"):
            raise ValueError(f"layer {value!r} is not 0 or 1")
        ev["granularity"] = "GRANULARITY_PER_LAYER" if value == "1" else "GRANULARITY_PER_HEAD"
    elif key == "lb":
        ev["layer_budgets"] = [_number("lb entry", b, int) for b in value.split("/")]
    elif key == "ada":
        ev["adaptive"] = True
        ev["adaptive_floor"] = _number("ada", value)
    elif key == "xlayer":
        if value not in ("0", "1"):
            raise ValueError(f"xlayer {value!r} is not 0 or 1")
        ev["layer_adaptive"] = value == "1"
    elif key == "value":
        if value not in ("auto", "off", "mul", "add"):
            raise ValueError(f"value {value!r} is not auto, off, mul or add")
        ev["value_weight"] = value
    elif key == "veps":
        ev["value_eps"] = _number("veps", value)
    elif key == "horizon":
        ev["horizon"] = _number("horizon", value, int)
    elif key == "stats":
        if value not in ("0", "1"):
            raise ValueError(f"stats {value!r} is not 0 or 1")
        ev["query_stats"] = value == "1"
    elif key == "passes":
        rows = [_number("passes entry", r, int) for r in value.split("/")]
        if any(r < 1 for r in rows):
            raise ValueError(f"passes {value!r}: every entry must be >= 1")
        ev["pass_rows"] = rows
    elif key == "chunk":
        ev["pass_tokens"] = _number("chunk", value, int)
        if ev["pass_tokens"] < 1:
            raise ValueError(f"chunk {value!r} must be >= 1")
    elif key == "top":
        ev["top_rows"] = _number("top", value, int)
        if not 1 <= ev["top_rows"] <= 64:
            raise ValueError(f"top {value!r} is outside [1, 64]")
    else:
        raise ValueError(f"unknown option {key!r}")


def _eviction(term):
    head, *options = term.split(",")
    sep = min((i for i in (head.find(":"), head.find("@")) if i >= 0), default=-1)
    name = head if sep < 0 else head[:sep]
    if name not in _POLICIES:
        raise ValueError(f"unknown term {name!r} (eviction policies: {', '.join(_POLICIES)}; "
                         f"channels: think, l1, l2, vthink; qB; r=N)")
    if sep < 0:
        raise ValueError(f"{name} needs an amount: {name}:KEEP or {name}@BUDGET")
    ev = {"policy": name}
    amount = head[sep + 1:]
    if head[sep] == ":":
        keep = _number("keep", amount)
        if not 0.0 < keep <= 1.0:
            raise ValueError(f"keep {amount} is outside (0, 1]")
        ev["keep_ratio"] = keep
    else:
        budget = _number("budget", amount, int)
        if budget < 1:
            raise ValueError(f"budget {budget} must be >= 1")
        ev["budget"] = budget
    for opt in options:
        key, eq, value = opt.partition("=")
        if not key or not eq or not value:
            raise ValueError(f"option {opt!r} is not key=value")
        _set_eviction_option(ev, key, value)
    return ev


def parse(text):
    """The CompressionConfig dict of a spec string; ValueError names the bad term."""
    whole = text.strip()
    if not whole:
        raise ValueError('spec "": empty (use \'full\' to keep everything)')
    if whole in ("full", "none"):
        return {}
    out, seen = {}, set()

    def once(kind, what):
        if kind in seen:
            raise ValueError(f"a second {what} term")
        seen.add(kind)

    for raw in whole.split("+"):
        term = raw.strip()
        try:
            if term in ("", "full", "none"):
                raise ValueError("empty term" if not term else "'full' and 'none' stand alone")
            name, colon, rest = term.partition(":")
            if colon and name in _CHANNELS + ("vthink",):
                lam = _number("lambda", rest)
                if not 0.0 <= lam < 1.0:
                    raise ValueError(f"lambda {rest} is outside [0, 1)")
                ch = out.setdefault("channels", {})
                if name == "vthink":
                    once("v", "value pruning")
                    ch.update(prune_values=True, value_lambda=lam)
                else:
                    once("k", "key channel")
                    ch.update(key_policy=name, key_lambda=lam)
            elif term.startswith("r="):
                once("r", "r=")
                out["recent_tokens"] = _number("recent_tokens", term[2:], int)
            elif len(term) >= 2 and term[0] == "q" and term[1].isdigit():
                once("q", "quantization")
                bits, g, group = term[1:].partition("g")
                bits, v, vbits = bits.partition("v")
                quant = {"bits": _number("bits", bits, int)}
                if quant["bits"] not in (2, 4, 8):
                    raise ValueError(f"bits {bits} is not 2, 4 or 8")
                if v:
                    if not vbits:
                        raise ValueError("value bits missing after 'v' (e.g. q8v4)")
                    value_bits = _number("value bits", vbits, int)
                    if value_bits not in (2, 4, 8):
                        raise ValueError(f"value bits {vbits} is not 2, 4 or 8")
                    if value_bits != quant["bits"]:
                        quant["value_bits"] = value_bits
                if g:
                    quant["group_size"] = _number("group", group, int)
                out["quant"] = quant
            else:
                once("e", "eviction")
                out["eviction"] = _eviction(term)
        except ValueError as e:
            raise ValueError(f'spec "{whole}": term "{term}": {e}') from None
    return out


def needs_queries(config):
    """Whether kvcd reads Q_obs for this config (attention scores, ThinK, value channels)."""
    ev = config.get("eviction", {})
    ch = config.get("channels", {})
    return (ev.get("policy") in ("h2o", "snapkv", "keyformer", "kvzip")
            or (ev.get("policy") == "expected" and not ev.get("query_stats"))
            or ch.get("key_policy") == "think" or bool(ch.get("prune_values")))

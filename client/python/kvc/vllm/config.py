"""kv_connector_extra_config of KvcConnector, checked at start (a bad value stops vLLM with the
key and the reason).

    --kv-transfer-config '{"kv_connector": "KvcConnector", "kv_connector_module_path": "kvc.vllm",
      "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_load_failure_policy": "fail",
      "kv_connector_extra_config": {"target": "kvcd:50051", "spec": "keydiff:0.5", ...}}'

| key | default | meaning |
| --- | --- | --- |
| target | 127.0.0.1:50051 | kvcd: "host:port", "a:1,b:2" or "dns:///name:port" (replicas, rendezvous by cache id) |
| token / token_file | none | bearer token (token_file: read once at start, stripped) |
| tls, ca_file, cert_file, key_file, server_name_override | off | TLS / mutual TLS to kvcd |
| spec | "none" | default compression spec (string or CompressionConfig dict); a request overrides it with kv_transfer_params {"kvc": {"spec": ...}} |
| query_stats | none | statistics file of kvc-qstats, needed by expected and think |
| ttl_seconds | 0 | cache lifetime in kvcd (0: kvcd's default) |
| load | "async" | "async": the decode request waits outside the batch while its cache loads; "sync": loaded layer by layer during the request's first forward pass (wait_for_layer_load) |
| evicted | "accept" with policy fail | "accept" or "refuse" evicted caches (a K + 1 token request cannot be recomputed, so "accept" needs kv_load_failure_policy "fail") |
| cache_id_prefix | "vllm/" | prefix of the cache ids this instance writes |
| stat_timeout | 5 | seconds for StatCache (decode lookup, prefill confirmation) |
| save_timeout | 60 | seconds the prefill step waits for kvcd to confirm a stored cache |
| load_timeout | 120 | seconds for one cache load, whole stream |
| stream_timeout | 600 | seconds one PutCache stream may stay open (chunked prefill) |
| max_chunk_bytes | 4 MiB | largest PutCache piece (<= kvcd's limit) |
| rope_style | ROPE_HALF_SPLIT | the model's RoPE pairs (ROPE_INTERLEAVED for GPT-J style) |
| fingerprint | computed | overrides the model fingerprint (e.g. a name and revision) |
"""

import math

from .spec import SpecError

_CLIENT_KEYS = ("tls", "ca_file", "cert_file", "key_file", "server_name_override",
                "max_chunk_bytes")
_KEYS = {"target", "token", "token_file", "spec", "query_stats", "ttl_seconds", "load",
         "evicted", "cache_id_prefix", "stat_timeout", "save_timeout", "load_timeout",
         "stream_timeout", "rope_style", "fingerprint", *_CLIENT_KEYS}


def _seconds(extra, key, default):
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
            not 0 < v <= 86400:
        raise SpecError(f"kv_connector_extra_config.{key}: {v!r} is not a number of seconds in "
                        f"(0, 86400]")
    return float(v)


class ConnectorConfig:
    """The checked extra config. policy: vLLM's kv_load_failure_policy."""

    def __init__(self, extra, policy):
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _KEYS)
        if unknown:
            raise SpecError(f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)} "
                            f"(known: {', '.join(sorted(_KEYS))})")
        self.extra = extra
        self.policy = policy
        self.target = extra.get("target", "127.0.0.1:50051")
        if not isinstance(self.target, str) or not self.target.strip():
            raise SpecError("kv_connector_extra_config.target: empty")
        token = extra.get("token", "")
        if extra.get("token_file"):
            if token:
                raise SpecError("kv_connector_extra_config: token and token_file both set")
            try:
                with open(extra["token_file"]) as f:
                    token = f.read().strip()
            except OSError as e:
                raise SpecError(f"kv_connector_extra_config.token_file: {e}")
        self.client_options = {k: extra[k] for k in _CLIENT_KEYS if k in extra}
        if token:
            self.client_options["token"] = token
        self.stat_timeout = _seconds(extra, "stat_timeout", 5)
        self.save_timeout = _seconds(extra, "save_timeout", 60)
        self.load_timeout = _seconds(extra, "load_timeout", 120)
        self.stream_timeout = _seconds(extra, "stream_timeout", 600)
        self.client_options.setdefault("timeout", self.stat_timeout)
        self.client_options.setdefault("stream_timeout", self.load_timeout)
        self.client_options.setdefault("max_attempts", 1)
        self.ttl_seconds = extra.get("ttl_seconds", 0)
        if isinstance(self.ttl_seconds, bool) or not isinstance(self.ttl_seconds, int) or \
                not 0 <= self.ttl_seconds <= 2**32 - 1:
            raise SpecError(f"kv_connector_extra_config.ttl_seconds: {self.ttl_seconds!r} is not "
                            f"an integer in [0, 2^32)")
        self.load = extra.get("load", "async")
        if self.load not in ("async", "sync"):
            raise SpecError(f"kv_connector_extra_config.load: {self.load!r} is not 'async' or "
                            f"'sync'")
        self.evicted = extra.get("evicted", "accept" if policy == "fail" else "refuse")
        if self.evicted not in ("accept", "refuse"):
            raise SpecError(f"kv_connector_extra_config.evicted: {self.evicted!r} is not "
                            f"'accept' or 'refuse'")
        if self.evicted == "accept" and policy != "fail":
            raise SpecError("kv_connector_extra_config.evicted: 'accept' needs "
                            "kv_load_failure_policy 'fail': an evicted cache is decoded from a "
                            "request of placeholder tokens, which cannot be recomputed after a "
                            "failed load; set \"evicted\": \"refuse\" or the policy to 'fail'")
        self.cache_id_prefix = extra.get("cache_id_prefix", "vllm/")
        if not isinstance(self.cache_id_prefix, str) or len(self.cache_id_prefix) > 64:
            raise SpecError("kv_connector_extra_config.cache_id_prefix: not a string of at most "
                            "64 characters")
        self.query_stats = extra.get("query_stats")
        self.default_spec = extra.get("spec", "none")

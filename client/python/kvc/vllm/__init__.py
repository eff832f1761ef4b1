"""kvc inside vLLM: the KV connector and the prefill/decode proxy (docs/vllm.md).

    --kv-transfer-config '{"kv_connector": "KvcConnector", "kv_connector_module_path": "kvc.vllm",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'
    kvc-pd-proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

KvcConnector is imported on first use, so the proxy, the spec checks and kvc-qstats run without
vLLM installed.
"""


def __getattr__(name):
    if name == "KvcConnector":
        from .connector import KvcConnector
        return KvcConnector
    raise AttributeError(f"module 'kvc.vllm' has no attribute {name!r}")


__all__ = ["KvcConnector"]

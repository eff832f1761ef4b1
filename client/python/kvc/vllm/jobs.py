"""What the scheduler-side connector hands the worker-side connector each engine step.

vLLM pickles the metadata object from the engine-core process to the worker process before each
forward pass (build_connector_meta -> bind_connector_metadata); these plain dataclasses are all
that crosses. Block ids are vLLM's KV-cache-manager blocks (cache_config.block_size slots each).
"""

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata, KVConnectorWorkerMetadata)


@dataclasses.dataclass
class SaveJob:
    """Send prompt tokens [start, end) of request req_id to its PutCache stream this step."""
    req_id: str
    cache_id: str
    replica: str
    spec: dict            # CompressionConfig dict
    seq_len: int          # S: the tokens the cache holds (the prompt minus its last token)
    start: int
    end: int
    block_ids: list
    first: bool           # open the stream (header) before sending
    final: bool           # end == seq_len: close the stream in wait_for_save and wait for kvcd


@dataclasses.dataclass
class LoadJob:
    """Load tokens [start, end) of a stored cache into the request's blocks (or fail it)."""
    req_id: str
    cache_id: str
    replica: str
    mode: str             # "full" or "evicted"
    seq_len: int
    kept_tokens: int
    start: int
    end: int
    block_ids: list
    sync: bool            # loaded during this step's forward pass (wait_for_layer_load)
    fmt: str = "dense"    # GetCache format: "dense" (lossless), "packed" (full length, lossy:
                          # expanded here), "contiguous" (evicted: keys re-rotated by kvcd)
    fail: str = None      # fail the load without fetching, with this reason


@dataclasses.dataclass
class KvcConnectorMetadata(KVConnectorMetadata):
    saves: list = dataclasses.field(default_factory=list)
    loads: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class KvcWorkerMetadata(KVConnectorWorkerMetadata):
    """Per finished load: req_id -> (tokens written, bytes fetched, seconds, error or None)."""
    loads: dict = dataclasses.field(default_factory=dict)

    def aggregate(self, other):
        merged = dict(self.loads)
        merged.update(other.loads)
        return KvcWorkerMetadata(merged)

"""kvc: the Python client of kvcd (KV-cache compression service).

    import kvc
    c = kvc.Client("127.0.0.1:50051")          # or kvc.aio.Client for asyncio
    c.put("req-1", layers, compression={"eviction": {"policy": "snapkv", "budget": 64}})
    cache = c.get("req-1", format="contiguous", rope={"theta": 10000, "style": "ROPE_INTERLEAVED"})

See client/python/README.md.
"""

from . import aio
from ._common import CacheData, Layer, Options
from ._pb import pb
from .client import Client, GetStream
from .errors import KvcError
from .replicas import rendezvous_owner, rendezvous_weight, resolve_target

__all__ = ["aio", "CacheData", "Client", "GetStream", "KvcError", "Layer", "Options", "pb",
           "rendezvous_owner", "rendezvous_weight", "resolve_target"]

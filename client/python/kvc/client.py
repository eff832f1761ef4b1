"""kvc.Client: the synchronous Python client of kvcd, mirroring kvc::Client (C++).

    c = kvc.Client("127.0.0.1:50051")
    c.put("req-1", [(k, v, q_obs) for each layer], compression={"eviction": {"policy": "snapkv",
          "budget": 64}})
    cache = c.get("req-1", format="dense")       # cache.layers[l].k, .v, .positions
    for layer in c.get_stream("req-1", format="contiguous", rope={...}): ...

Replicas, retries and errors are those of the C++ client (client/include/kvc/client.h): a target
"a:1,b:2" or "dns:///name:port" is a replica set and each cache id lives on its rendezvous owner;
stat/delete/list/server_info are retried on UNAVAILABLE and RESOURCE_EXHAUSTED; get is retried
on UNAVAILABLE while nothing has been handed to the caller; put is never retried. Every failure
is a kvc.KvcError carrying the grpc.StatusCode and the message. A Client is thread-safe.
"""

import threading
import time

import grpc

from . import _common, _validate
from ._common import Assembler, CacheData, PutPlan
from ._pb import pb
from .errors import KvcError, from_rpc_error, invalid


class Client(_common.ClientBase):
    def __init__(self, target="127.0.0.1:50051", **options):
        super().__init__(target, aio=False, **options)

    def close(self):
        for ch in self._channels:
            ch.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- PutCache -------------------------------------------------------------------------------

    def put(self, cache_id, layers, *, num_layers=None, layout="HND", dtype=None,
            compression=None, ttl_seconds=0, overwrite=False, rope=None):
        """Uploads one cache and returns the PutCacheResponse.

        layers: per layer (k, v, q_obs) (or a dict with those keys), numpy arrays or torch
        tensors in `layout` (HND: k, v [Hkv, S, D], q_obs [Hq, W, D]; NHD: [S, Hkv, D] and
        [W, Hq, D]); q_obs may be None (no observation window). A sequence, or an iterator (then
        give num_layers): each layer is sent as soon as the iterator yields it, so a prefill loop
        can upload layer l while computing l + 1. The shape and dtype come from the first layer;
        dtype="bf16" marks uint16 numpy arrays as bf16 bits; every tensor must hold the upload's
        dtype (integers are refused, naming the tensor). cache_id: str, or UTF-8 bytes (as
        everywhere in the client). compression: CompressionConfig or
        its dict form, e.g. {"eviction": {"policy": "snapkv", "budget": 64}}. A layer may add
        q_stats (4th item or dict key): float32 [Hq, D + D*D], the mean and covariance of the
        un-rotated queries, for {"eviction": {"policy": "expected"}} without q_obs, or for
        "kvzip" float32 [Hq, W], each query row's log-mass over keys not uploaded
        (kvc.recon.reconstruction_inputs) (query_stats is then set; float16/32/64, converted to
        float32). rope: the model's RopeSpec or its
        dict form (needed by "expected"). An exception the layers raise (any BaseException)
        cancels the upload at once and is re-raised here.
        """
        cache_id = _validate.cache_id(cache_id)
        first, it, n = _common.split_layers(layers, num_layers)
        plan = PutPlan(cache_id, first, n, layout, dtype, compression, ttl_seconds, overwrite,
                       rope)
        max_chunk = self.options.max_chunk_bytes

        # What the layers raised (the caller's own exception, KeyboardInterrupt and SystemExit
        # included): the call is cancelled at once and the exception re-raised here. gRPC's
        # request thread only sees the iteration end.
        failed = []
        call_ready = threading.Event()
        holder = {}

        def requests():
            try:
                call_ready.wait()
                yield pb.PutCacheRequest(header=plan.header)
                count = 0
                for i, layer in enumerate(it):
                    if i >= n:
                        raise invalid(f"layers: more than num_layers={n}")
                    yield from plan.chunks(i, layer, max_chunk)
                    count += 1
                if count != n:
                    raise invalid(f"layers: {count} given, num_layers={n}")
            except BaseException as e:  # noqa: B036 - handed to the caller's thread below
                if isinstance(e, GeneratorExit):
                    raise  # gRPC closed the generator (the call ended): nothing of the caller's
                failed.append(e)
                holder["call"].cancel()

        _, put, _ = self._stubs[self.replica_for(cache_id)]
        call = put.future(requests(), timeout=self.options.stream_timeout,
                          metadata=self.options.metadata())
        holder["call"] = call
        call_ready.set()
        try:
            return call.result()
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            if failed:
                raise failed[0] from None
            if isinstance(e, grpc.FutureCancelledError):
                raise KvcError(grpc.StatusCode.CANCELLED, "put: cancelled") from None
            raise from_rpc_error(e) from None
        except BaseException:
            call.cancel()  # e.g. KeyboardInterrupt while waiting: the upload must not go on
            raise

    # ---- GetCache -------------------------------------------------------------------------------

    def get_stream(self, cache_id, *, format="packed", layer_begin=0, layer_end=None, rope=None,
                   tensors="auto"):
        """A GetStream: iterate it for each Layer as soon as its bytes have arrived; its `info`
        (CacheInfo) is read before this returns. format: "packed", "dense" or "contiguous" (the
        engine-ready export; needs rope, a RopeSpec or its dict form). tensors: "numpy",
        "torch", or "auto" (numpy; bf16 as torch.bfloat16 when torch is installed)."""
        req = _common.get_request(cache_id, format, layer_begin, layer_end, rope)
        _validate.tensor_kind(tensors)
        _, _, get = self._stubs[self.replica_for(req.cache_id)]
        deadline = time.monotonic() + self.options.stream_timeout
        for attempt in range(self.options.max_attempts):
            stream = GetStream(get, req, format, tensors, deadline, self.options.metadata())
            try:
                stream._start()
                return stream
            except KvcError as e:
                last = attempt + 1 == self.options.max_attempts
                if e.code != grpc.StatusCode.UNAVAILABLE or last:
                    raise
                self._sleep(attempt, deadline)

    def get(self, cache_id, **kwargs):
        """The whole cache (or a layer range) as CacheData(info, layers); see get_stream."""
        stream = self.get_stream(cache_id, **kwargs)
        return CacheData(stream.info, list(stream))

    # ---- Unary calls ----------------------------------------------------------------------------

    def _sleep(self, attempt, deadline):
        backoff = min(self.options.initial_backoff * (2 ** attempt), self.options.max_backoff)
        time.sleep(max(0.0, min(backoff, deadline - time.monotonic())))

    def _unary(self, replica, name, request):
        stub = self._stubs[replica][0]
        deadline = time.monotonic() + self.options.timeout
        for attempt in range(self.options.max_attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                raise KvcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: deadline exceeded")
            try:
                return getattr(stub, name)(request, timeout=left,
                                           metadata=self.options.metadata())
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if err.code not in _common.RETRYABLE or attempt + 1 == self.options.max_attempts:
                    raise err
            self._sleep(attempt, deadline)

    def stat(self, cache_id):
        """CacheInfo of a stored cache."""
        cache_id = _validate.cache_id(cache_id)
        return self._unary(self.replica_for(cache_id), "StatCache",
                           pb.StatCacheRequest(cache_id=cache_id))

    def delete(self, cache_id):
        """Deletes a cache; returns the bytes freed."""
        cache_id = _validate.cache_id(cache_id)
        return self._unary(self.replica_for(cache_id), "DeleteCache",
                           pb.DeleteCacheRequest(cache_id=cache_id)).freed_bytes

    def list(self, prefix=""):
        """CacheInfo of every cache whose id starts with prefix, from every replica, by id."""
        prefix = _validate.prefix(prefix)
        out = []
        for r in range(len(self._replicas)):
            token = ""
            while True:
                resp = self._unary(r, "ListCaches", pb.ListCachesRequest(
                    prefix=prefix, page_size=1000, page_token=token))
                out.extend(resp.caches)
                token = resp.next_page_token
                if not token:
                    break
        return sorted(out, key=lambda c: c.cache_id)

    def server_info(self, replica=0):
        if not 0 <= replica < len(self._replicas):
            raise invalid(f"replica: {replica} is outside [0, {len(self._replicas)})")
        return self._unary(replica, "GetServerInfo", pb.GetServerInfoRequest())


class GetStream:
    """An open GetCache stream: `info`, then iterate for Layers. close() cancels it."""

    def __init__(self, method, request, fmt, kind, deadline, metadata):
        self._method, self._request, self._metadata = method, request, metadata
        self._deadline = deadline
        self._asm = Assembler(fmt, kind, request)
        self._call = None
        self.info = None

    def _start(self):
        timeout = max(0.001, self._deadline - time.monotonic())
        self._call = self._method(self._request, timeout=timeout, metadata=self._metadata)
        try:
            for raw in self._call:
                self._asm.add(raw)
                if self._asm.info is not None:
                    break
        except grpc.RpcError as e:
            raise from_rpc_error(e)
        if self._asm.info is None:
            raise KvcError(grpc.StatusCode.INTERNAL, "GetCache stream: ended without info")
        self.info = self._asm.info

    def __iter__(self):
        try:
            for raw in self._call:
                layer = self._asm.add(raw)
                if layer is not None:
                    yield layer
        except grpc.RpcError as e:
            raise from_rpc_error(e)
        finally:
            self._call.cancel()
        self._asm.finish()

    def close(self):
        if self._call is not None:
            self._call.cancel()

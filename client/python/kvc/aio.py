"""kvc.aio.Client: the asyncio client (grpc.aio), the same calls as kvc.Client, awaited.

    async with kvc.aio.Client("127.0.0.1:50051") as c:
        await c.put("req-1", layers)                  # layers: a sequence or an async iterator
        async for layer in c.get_stream("req-1", format="dense"): ...

Create and use it inside one running event loop.
"""

import asyncio
import time

import grpc
import grpc.aio

from . import _common, _validate
from ._common import Assembler, CacheData, PutPlan
from ._pb import pb
from .errors import KvcError, from_rpc_error, invalid


async def _aiter_layers(layers, num_layers):
    """(first layer, async iterator over all layers, num_layers) for any kind of `layers`."""
    if hasattr(layers, "__aiter__"):
        if num_layers is None:
            raise invalid("num_layers: required when layers is an async iterator")
        it = layers.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            raise invalid("layers: empty")

        async def chained():
            yield first
            async for x in it:
                yield x
        return first, chained(), num_layers
    first, sync_it, n = _common.split_layers(layers, num_layers)

    async def wrapped():
        for x in sync_it:
            yield x
    return first, wrapped(), n


class Client(_common.ClientBase):
    def __init__(self, target="127.0.0.1:50051", **options):
        super().__init__(target, aio=True, **options)

    async def close(self):
        for ch in self._channels:
            await ch.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def put(self, cache_id, layers, *, num_layers=None, layout="HND", dtype=None,
                  compression=None, ttl_seconds=0, overwrite=False, rope=None):
        """See kvc.Client.put; `layers` may also be an async iterator (give num_layers)."""
        cache_id = _validate.cache_id(cache_id)
        first, it, n = await _aiter_layers(layers, num_layers)
        plan = PutPlan(cache_id, first, n, layout, dtype, compression, ttl_seconds, overwrite,
                       rope)
        max_chunk = self.options.max_chunk_bytes
        # What the layers raised (any BaseException): the call is cancelled at once and the
        # exception re-raised here.
        failed = []
        holder = {}

        async def requests():
            try:
                yield pb.PutCacheRequest(header=plan.header)
                i = 0
                async for layer in it:
                    if i >= n:
                        raise invalid(f"layers: more than num_layers={n}")
                    for c in plan.chunks(i, layer, max_chunk):
                        yield c
                    i += 1
                if i != n:
                    raise invalid(f"layers: {i} given, num_layers={n}")
            except BaseException as e:  # noqa: B036 - handed to the awaiting caller below
                if isinstance(e, GeneratorExit):
                    raise  # the call closed the generator (it ended): nothing of the caller's
                failed.append(e)
                holder["call"].cancel()

        _, put, _ = self._stubs[self.replica_for(cache_id)]
        call = put(requests(), timeout=self.options.stream_timeout,
                   metadata=self.options.metadata())
        holder["call"] = call
        try:
            return await call
        except grpc.RpcError as e:
            if failed:
                raise failed[0] from None
            raise from_rpc_error(e) from None
        except (Exception, asyncio.CancelledError):
            # grpc.aio ends a cancelled call with CancelledError: report the caller's exception.
            if failed:
                raise failed[0] from None
            raise

    async def get_stream(self, cache_id, *, format="packed", layer_begin=0, layer_end=None,
                         rope=None, tensors="auto"):
        """An AsyncGetStream with `info` read; `async for layer in stream`. See kvc.Client."""
        req = _common.get_request(cache_id, format, layer_begin, layer_end, rope)
        _validate.tensor_kind(tensors)
        _, _, get = self._stubs[self.replica_for(req.cache_id)]
        deadline = time.monotonic() + self.options.stream_timeout
        for attempt in range(self.options.max_attempts):
            stream = AsyncGetStream(get, req, format, tensors, deadline, self.options.metadata())
            try:
                await stream._start()
                return stream
            except KvcError as e:
                last = attempt + 1 == self.options.max_attempts
                if e.code != grpc.StatusCode.UNAVAILABLE or last:
                    raise
                await self._sleep(attempt, deadline)

    async def get(self, cache_id, **kwargs):
        stream = await self.get_stream(cache_id, **kwargs)
        return CacheData(stream.info, [layer async for layer in stream])

    async def _sleep(self, attempt, deadline):
        backoff = min(self.options.initial_backoff * (2 ** attempt), self.options.max_backoff)
        await asyncio.sleep(max(0.0, min(backoff, deadline - time.monotonic())))

    async def _unary(self, replica, name, request):
        stub = self._stubs[replica][0]
        deadline = time.monotonic() + self.options.timeout
        for attempt in range(self.options.max_attempts):
            left = deadline - time.monotonic()
            if left <= 0:
                raise KvcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"{name}: deadline exceeded")
            try:
                return await getattr(stub, name)(request, timeout=left,
                                                 metadata=self.options.metadata())
            except grpc.RpcError as e:
                err = from_rpc_error(e)
                if err.code not in _common.RETRYABLE or attempt + 1 == self.options.max_attempts:
                    raise err from None
            await self._sleep(attempt, deadline)

    async def stat(self, cache_id):
        cache_id = _validate.cache_id(cache_id)
        return await self._unary(self.replica_for(cache_id), "StatCache",
                                 pb.StatCacheRequest(cache_id=cache_id))

    async def delete(self, cache_id):
        cache_id = _validate.cache_id(cache_id)
        resp = await self._unary(self.replica_for(cache_id), "DeleteCache",
                                 pb.DeleteCacheRequest(cache_id=cache_id))
        return resp.freed_bytes

    async def list(self, prefix=""):
        prefix = _validate.prefix(prefix)
        out = []
        for r in range(len(self._replicas)):
            token = ""
            while True:
                resp = await self._unary(r, "ListCaches", pb.ListCachesRequest(
                    prefix=prefix, page_size=1000, page_token=token))
                out.extend(resp.caches)
                token = resp.next_page_token
                if not token:
                    break
        return sorted(out, key=lambda c: c.cache_id)

    async def server_info(self, replica=0):
        if not 0 <= replica < len(self._replicas):
            raise invalid(f"replica: {replica} is outside [0, {len(self._replicas)})")
        return await self._unary(replica, "GetServerInfo", pb.GetServerInfoRequest())


class AsyncGetStream:
    def __init__(self, method, request, fmt, kind, deadline, metadata):
        self._method, self._request, self._metadata = method, request, metadata
        self._deadline = deadline
        self._asm = Assembler(fmt, kind, request)
        self._call = None
        self.info = None

    async def _start(self):
        timeout = max(0.001, self._deadline - time.monotonic())
        self._call = self._method(self._request, timeout=timeout, metadata=self._metadata)
        try:
            while self._asm.info is None:
                raw = await self._call.read()
                if raw is grpc.aio.EOF:
                    break
                self._asm.add(raw)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        if self._asm.info is None:
            raise KvcError(grpc.StatusCode.INTERNAL, "GetCache stream: ended without info")
        self.info = self._asm.info

    async def __aiter__(self):
        try:
            while True:
                raw = await self._call.read()
                if raw is grpc.aio.EOF:
                    break
                layer = self._asm.add(raw)
                if layer is not None:
                    yield layer
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None
        finally:
            self._call.cancel()
        self._asm.finish()

    def close(self):
        if self._call is not None:
            self._call.cancel()

"""kvcd connections of the connector: one kvc.Client per replica, and a PutCache stream that
the prefill side feeds piece by piece while vLLM's forward pass produces the layers.

`Upload` opens PutCache with the header at once and sends each piece as soon as `send` is
called: a piece is the bytes of tokens [a, b) of one layer's K or V in NHD layout ([S, H, D]),
placed at byte offset a * H * D * element size of that tensor, so chunked prefill (a prompt
computed over several engine steps) streams its steps in order and kvcd compresses each layer
when its last piece arrives. `finish` closes the stream and waits for PutCacheResponse with a
deadline; `cancel` ends it (kvcd stores nothing for a cancelled upload).
"""

import queue
import threading
import time

import grpc

from .. import _common
from ..client import Client
from ..errors import KvcError, from_rpc_error
from .._pb import pb
from ..replicas import rendezvous_owner, resolve_target

_END = object()


class Replicas:
    """kvcd replicas from the extra config: target forms of kvc.Client ("host:port",
    "a:1,b:2", "dns:///name:port"), TLS, token; a Client per replica address, opened lazily."""

    def __init__(self, target, options):
        self.target = target
        self.options = dict(options)
        _common.Options(target=target, **self.options).validate()  # a bad option fails at start
        self._clients = {}
        self._put_calls = {}
        self._lock = threading.Lock()
        self._addresses = None

    def addresses(self):
        # Resolved on first use, not at start: a dns:/// name may not resolve before kvcd runs.
        if self._addresses is None:
            self._addresses = resolve_target(self.target)
        return self._addresses

    def owner(self, cache_id):
        addrs = self.addresses()
        return addrs[0] if len(addrs) == 1 else addrs[rendezvous_owner(cache_id, addrs)]

    def choose(self, replica, cache_id):
        """The address to read cache_id from: the replica the prefill side wrote it to when this
        instance knows it, else this instance's only replica or its rendezvous owner."""
        addrs = self.addresses()
        if replica in addrs:
            return replica
        return self.owner(cache_id)

    def client(self, address):
        with self._lock:
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = Client(address, **self.options)
            return c

    def put_call(self, address):
        with self._lock:
            call = self._put_calls.get(address)
            if call is None:
                opts = _common.Options(target=address, **self.options)
                _, channels, stubs = _common.open_channels(opts)
                call = self._put_calls[address] = (stubs[0][1], opts, channels[0])
            return call

    def reset(self, address, error=None):
        """After a call to `address` failed with `error`: when kvcd was unreachable, open new
        channels on next use, so a restarted kvcd is reached at once instead of after gRPC's
        reconnect backoff (up to minutes). Calls in flight keep their old channel."""
        if error is not None and getattr(error, "code", None) not in (
                grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return
        with self._lock:
            self._clients.pop(address, None)
            self._put_calls.pop(address, None)

    def close(self):
        with self._lock:
            for c in self._clients.values():
                c.close()
            for _, _, ch in self._put_calls.values():
                ch.close()
            self._clients.clear()
            self._put_calls.clear()


class Upload:
    """One PutCache stream, fed from the forward pass (see the module comment).

    Thread-safe: `send` from the forward thread, `finish`/`cancel` from any thread. Errors of the
    stream surface in `finish` (or `error()`); `send` after a failure drops the piece.
    """

    def __init__(self, replicas, address, header, max_chunk_bytes, stream_timeout):
        call, opts, _ = replicas.put_call(address)
        self.header = header
        self.address = address
        self.max_chunk = max_chunk_bytes
        self._q = queue.SimpleQueue()
        self._failed = []
        self.bytes_sent = 0
        self.started = time.monotonic()
        self._future = call.future(self._requests(), timeout=stream_timeout,
                                   metadata=opts.metadata())

    def _requests(self):
        yield pb.PutCacheRequest(header=self.header)
        while True:
            item = self._q.get()
            if item is _END:
                return
            yield item

    def send(self, layer, kind, offset, data):
        """Queues `data` (bytes-like, kept alive until sent) at byte `offset` of the tensor."""
        if self._future.done():
            return
        mv = memoryview(data).cast("B")
        for off in range(0, len(mv), self.max_chunk):
            piece = mv[off:off + self.max_chunk]
            chunk = pb.ChunkHeader(layer=layer, tensor=kind, offset=offset + off)
            self._q.put((chunk.SerializeToString(), piece))
            self.bytes_sent += len(piece)

    def finish(self, timeout):
        """Closes the stream and returns the PutCacheResponse; KvcError on failure or timeout."""
        self._q.put(_END)
        try:
            return self._future.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            self._future.cancel()
            raise KvcError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"PutCache {self.header.cache_id}: no answer from {self.address} "
                           f"within {timeout:g} s")
        except grpc.RpcError as e:
            raise from_rpc_error(e) from None

    def cancel(self):
        self._q.put(_END)
        self._future.cancel()

    def done(self):
        return self._future.done()

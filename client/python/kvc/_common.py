"""What the synchronous and asyncio clients share: options, request building, stream assembly."""

import dataclasses
import itertools

import grpc
import numpy as np
from google.protobuf import json_format

from . import _validate, tensors
from ._pb import pb, pb_grpc
from .errors import KvcError, invalid
from .replicas import rendezvous_owner, resolve_target

# The order of a layer's tensors on the wire (see tensors_of).
_SEND_ORDER = {pb.TENSOR_Q_OBS: 0, pb.TENSOR_Q_STATS: 1, pb.TENSOR_K: 2, pb.TENSOR_V: 3}

PUT_METHOD = "/kvcache.v1.KvCache/PutCache"
GET_METHOD = "/kvcache.v1.KvCache/GetCache"

FORMATS = {"packed": pb.FORMAT_PACKED, "dense": pb.FORMAT_DENSE,
           "contiguous": pb.FORMAT_DENSE_CONTIGUOUS}
LAYOUTS = {"HND": pb.LAYOUT_HND, "NHD": pb.LAYOUT_NHD}
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclasses.dataclass
class Options:
    """Client options; the same meaning and defaults as kvc::ClientOptions (C++)."""
    target: str = "127.0.0.1:50051"
    timeout: float = 10.0          # seconds, each unary call with all its attempts
    stream_timeout: float = 300.0  # seconds, each PutCache / GetCache stream
    max_attempts: int = 3          # idempotent unary calls (stat, delete, list, server_info)
    initial_backoff: float = 0.05
    max_backoff: float = 1.0
    # Seconds. During a call, ping a connection silent for keepalive_time; drop it when a ping or
    # written data stays unacknowledged for keepalive_timeout (also the socket's TCP_USER_TIMEOUT):
    # a server that vanished or stopped reading fails the call then instead of at its deadline.
    keepalive_time: float = 30.0     # [10, 7200]: kvcd answers more frequent pings with GOAWAY
    keepalive_timeout: float = 20.0  # [1, 600]
    max_chunk_bytes: int = 4 << 20   # must not exceed the server's limits.max_chunk_bytes
    max_message_bytes: int = 16 << 20
    token: str = ""                # sent as "authorization: Bearer <token>"
    tls: bool = False
    ca_file: str = ""              # empty: the system roots
    cert_file: str = ""            # client certificate (mutual TLS), with key_file
    key_file: str = ""
    server_name_override: str = ""

    def validate(self):
        if not self.target:
            raise invalid("target: empty")
        # Finite: an infinite or NaN timeout would fail every call at once.
        _validate.seconds(self.timeout, "timeout")
        _validate.seconds(self.stream_timeout, "stream_timeout")
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or \
                not 1 <= self.max_attempts <= 10:
            raise invalid(f"max_attempts: {self.max_attempts!r} is outside [1, 10]")
        _validate.seconds(self.initial_backoff, "initial_backoff", positive=False)
        _validate.seconds(self.max_backoff, "max_backoff", positive=False)
        if self.max_backoff < self.initial_backoff:
            raise invalid("initial_backoff/max_backoff: need 0 <= initial <= max")
        for field, lo, hi in (("keepalive_time", 10, 7200), ("keepalive_timeout", 1, 600)):
            value = _validate.seconds(getattr(self, field), field)
            if not lo <= value <= hi:
                raise invalid(f"{field}: {value} s is outside [{lo}, {hi}]")
        if not 4096 <= self.max_chunk_bytes <= (64 << 20):
            raise invalid(f"max_chunk_bytes: {self.max_chunk_bytes} is outside [4096, 64 MiB]")
        if not self.max_chunk_bytes + 4096 <= self.max_message_bytes <= (1 << 30):
            raise invalid(f"max_message_bytes: {self.max_message_bytes} is outside "
                          f"[max_chunk_bytes + 4096, 1 GiB]")
        if any(not 0x20 <= ord(c) <= 0x7E for c in self.token):
            raise invalid("token: must be printable ASCII")
        if not self.tls and (self.ca_file or self.cert_file or self.key_file or
                             self.server_name_override):
            raise invalid("tls: must be true when any TLS file or server name is set")
        if bool(self.cert_file) != bool(self.key_file):
            raise invalid("cert_file: required with key_file" if not self.cert_file
                          else "key_file: required with cert_file")

    def metadata(self):
        return (("authorization", "Bearer " + self.token),) if self.token else None

    def channel_options(self):
        opts = [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.keepalive_time_ms", int(self.keepalive_time * 1000)),
                ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout * 1000))]
        if self.server_name_override:
            opts.append(("grpc.ssl_target_name_override", self.server_name_override))
        return opts

    def credentials(self):
        def read(field, path):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                raise invalid(f"{field}: cannot read {path}")
            if b"-----BEGIN " not in data:
                raise invalid(f"{field}: {path} is not PEM")
            return data
        root = read("ca_file", self.ca_file) if self.ca_file else None
        chain = read("cert_file", self.cert_file) if self.cert_file else None
        key = read("key_file", self.key_file) if self.key_file else None
        return grpc.ssl_channel_credentials(root_certificates=root, private_key=key,
                                            certificate_chain=chain)


def open_channels(options, aio=False):
    """The one channel set-up of kvc.Client (aio=False: grpc) and kvc.aio.Client (grpc.aio).

    Validates `options`, resolves its target into replica addresses and opens one channel per
    replica with the options' message limits, TLS credentials and server name. Returns
    (addresses, channels, stubs); stubs[i] is (KvCacheStub, PutCache call, GetCache call) on
    channels[i], the two streaming calls with kvc's own (de)serializers (see serialize_put and
    parse_get_response).
    """
    options.validate()
    addresses = resolve_target(options.target)
    if aio:
        from grpc import aio as module
    else:
        module = grpc
    creds = options.credentials() if options.tls else None
    channels, stubs = [], []
    for address in addresses:
        opts = options.channel_options()
        ch = (module.secure_channel(address, creds, options=opts) if creds
              else module.insecure_channel(address, options=opts))
        channels.append(ch)
        stubs.append((
            pb_grpc.KvCacheStub(ch),
            ch.stream_unary(PUT_METHOD, request_serializer=serialize_put,
                            response_deserializer=pb.PutCacheResponse.FromString),
            ch.unary_stream(GET_METHOD, request_serializer=pb.GetCacheRequest.SerializeToString,
                            response_deserializer=identity)))
    return addresses, channels, stubs


class ClientBase:
    """What kvc.Client and kvc.aio.Client share: options, channels (open_channels) and the
    replica that owns a cache id."""

    def __init__(self, target, aio, **options):
        self.options = Options(target=target, **options)
        self._replicas, self._channels, self._stubs = open_channels(self.options, aio=aio)

    @property
    def replicas(self):
        """The replica addresses, sorted."""
        return list(self._replicas)

    def replica_for(self, cache_id):
        """The index in `replicas` of the replica that owns cache_id (rendezvous hashing)."""
        cache_id = _validate.cache_id(cache_id)
        return 0 if len(self._replicas) == 1 else rendezvous_owner(cache_id, self._replicas)


def message(cls, value, field):
    """A protobuf message from an instance, a dict (proto JSON names) or None."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, dict):
        try:
            return json_format.ParseDict(value, cls())
        except json_format.ParseError as e:
            raise invalid(f"{field}: {e}")
    raise invalid(f"{field}: expected {cls.__name__} or dict, got {type(value).__name__}")


# ---- PutCache -----------------------------------------------------------------------------------

def _varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def serialize_put(item):
    """PutCacheRequest bytes: a header message, or (ChunkHeader bytes, data memoryview).

    A chunk is written by hand (field 2, then field 15) so its payload is copied once, straight
    from the caller's tensor into the message.
    """
    if isinstance(item, pb.PutCacheRequest):
        return item.SerializeToString()
    chunk, data = item
    return b"".join((b"\x12", _varint(len(chunk)), chunk, b"\x7a", _varint(len(data)), data))


def _layer_tuple(layer, i):
    """(k, v, q_obs, q_stats); q_obs and q_stats may be None."""
    if isinstance(layer, dict):
        return layer.get("k"), layer.get("v"), layer.get("q_obs"), layer.get("q_stats")
    try:
        k, v, *rest = layer
    except (TypeError, ValueError):
        raise invalid(f"layers[{i}]: expected (k, v, q_obs[, q_stats]) or a dict with k, v, q_obs")
    if len(rest) > 2:
        raise invalid(f"layers[{i}]: at most (k, v, q_obs, q_stats)")
    rest = rest + [None] * (2 - len(rest))
    return k, v, rest[0], rest[1]


class PutPlan:
    """Builds the header from the first layer and checks every layer against it."""

    def __init__(self, cache_id, first, num_layers, layout, dtype, compression, ttl_seconds,
                 overwrite, rope=None):
        cache_id = _validate.cache_id(cache_id)
        if layout not in LAYOUTS:
            raise invalid(f"layout: {layout!r} is not 'HND' or 'NHD'")
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise invalid(f"num_layers: {num_layers!r} must be an int >= 1")
        ttl_seconds = _validate.uint32(ttl_seconds, "ttl_seconds")
        k, v, q, st = _layer_tuple(first, 0)
        if k is None or v is None:
            raise invalid("layers[0]: k and v are required")
        self.dtype = tensors.wire_dtype(k, dtype, "layers[0].k")
        # Where the upload's dtype came from, for messages about tensors that do not match it.
        self.dtype_source = f"dtype={dtype!r}" if dtype is not None else "layers[0].k"
        self.layout = layout
        ks = tensors.shape_of(k)
        if len(ks) != 3:
            raise invalid(f"layers[0].k: shape {ks} is not 3-d ({layout})")
        hkv, s, d = (ks[0], ks[1], ks[2]) if layout == "HND" else (ks[1], ks[0], ks[2])
        # q_stats: float32 per layer (TENSOR_Q_STATS): [Hq, D + D*D] for the "expected" policy,
        # [Hq, W] (each query row's log-mass over keys not uploaded) for "kvzip".
        self.stats_shape = None if st is None else tensors.shape_of(st)
        if st is not None and len(self.stats_shape) != 2:
            raise invalid(f"layers[0].q_stats: shape {self.stats_shape} is not 2-d")
        if q is None:
            hq, w = (hkv if st is None else self.stats_shape[0]), 0
        else:
            qs = tensors.shape_of(q)
            if len(qs) != 3:
                raise invalid(f"layers[0].q_obs: shape {qs} is not 3-d")
            hq, w = (qs[0], qs[1]) if layout == "HND" else (qs[1], qs[0])
        self.kv_shape = ks
        self.q_shape = None if q is None else tensors.shape_of(q)
        comp = message(pb.CompressionConfig, compression, "compression")
        if st is not None:
            cols, what = ((w, "W") if comp.eviction.policy == "kvzip" else (d + d * d, "D + D*D"))
            if self.stats_shape != (hq, cols):
                raise invalid(f"layers[0].q_stats: shape {self.stats_shape} is not [Hq, {what}] "
                              f"= [{hq}, {cols}]")
        h = pb.PutCacheHeader(cache_id=cache_id, dtype=self.dtype, layout=LAYOUTS[layout],
                              ttl_seconds=int(ttl_seconds), overwrite=bool(overwrite))
        h.shape.CopyFrom(pb.ModelShape(num_layers=num_layers, num_kv_heads=hkv, num_q_heads=hq,
                                       head_dim=d, seq_len=s, obs_window=w))
        h.compression.CopyFrom(comp)
        if st is not None:
            h.compression.eviction.query_stats = True
        if rope is not None:
            h.rope.CopyFrom(message(pb.RopeSpec, rope, "rope"))
        self.header = h
        self.num_layers = num_layers

    def tensors_of(self, layer, i):
        """The (kind, bytes) of layer i, checked against the header."""
        k, v, q, st = _layer_tuple(layer, i)
        out = []
        for name, kind, x, want in (("k", pb.TENSOR_K, k, self.kv_shape),
                                    ("v", pb.TENSOR_V, v, self.kv_shape),
                                    ("q_obs", pb.TENSOR_Q_OBS, q, self.q_shape)):
            if want is None:
                if x is not None:
                    raise invalid(f"layers[{i}].q_obs: given, but layers[0] had none")
                continue
            if x is None:
                raise invalid(f"layers[{i}].{name}: missing")
            if tensors.shape_of(x) != want:
                raise invalid(f"layers[{i}].{name}: shape {tensors.shape_of(x)} != {want}")
            field = f"layers[{i}].{name}"
            tensors.check_dtype(x, self.dtype, field, self.dtype_source)
            out.append((kind, tensors.as_bytes(x, self.dtype)))
        if (st is None) != (self.stats_shape is None):
            raise invalid(f"layers[{i}].q_stats: must be given for every layer or for none")
        if st is not None:
            if tensors.shape_of(st) != self.stats_shape:
                raise invalid(f"layers[{i}].q_stats: shape {tensors.shape_of(st)} != "
                              f"{self.stats_shape}")
            out.append((pb.TENSOR_Q_STATS, tensors.stats_bytes(st, f"layers[{i}].q_stats")))
        # Sent queries first, then K, then V: kvcd scores a layer from K and the queries while its
        # V is still arriving.
        return sorted(out, key=lambda kind_data: _SEND_ORDER[kind_data[0]])

    def chunks(self, i, layer, max_chunk):
        for kind, data in self.tensors_of(layer, i):
            for off in range(0, len(data), max_chunk):
                ch = pb.ChunkHeader(layer=i, tensor=kind, offset=off).SerializeToString()
                yield ch, data[off:off + max_chunk]


def split_layers(layers, num_layers):
    """(first layer, iterator over all layers, num_layers) for a sequence or an iterator."""
    if num_layers is None:
        try:
            num_layers = len(layers)
        except TypeError:
            raise invalid("num_layers: required when layers is an iterator")
    it = iter(layers)
    try:
        first = next(it)
    except StopIteration:
        raise invalid("layers: empty")
    return first, itertools.chain([first], it), num_layers


# ---- GetCache -----------------------------------------------------------------------------------

def get_request(cache_id, fmt, layer_begin, layer_end, rope):
    cache_id = _validate.cache_id(cache_id)
    if fmt not in FORMATS:
        raise invalid(f"format: {fmt!r} is not 'packed', 'dense' or 'contiguous'")
    layer_begin = _validate.uint32(layer_begin, "layer_begin")
    req = pb.GetCacheRequest(cache_id=cache_id, format=FORMATS[fmt], layer_begin=layer_begin)
    if layer_end is not None:
        req.layer_end = _validate.uint32(layer_end, "layer_end")
    if rope is not None:
        req.rope.CopyFrom(message(pb.RopeSpec, rope, "rope"))
    elif fmt == "contiguous":
        raise invalid("rope: required with format='contiguous'")
    return req


def identity(b):
    return b


def _read_varint(buf, pos):
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise KvcError(grpc.StatusCode.INTERNAL, "GetCache stream: truncated message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def parse_get_response(buf):
    """(info or None, LayerChunk or None, data memoryview) without copying `data`."""
    mv = memoryview(buf)
    pos, info, chunk, data = 0, None, None, mv[0:0]
    while pos < len(mv):
        tag, pos = _read_varint(mv, pos)
        if tag & 7 != 2:  # every field of GetCacheResponse is length-delimited
            raise KvcError(grpc.StatusCode.INTERNAL, f"GetCache stream: unexpected tag {tag}")
        n, pos = _read_varint(mv, pos)
        field, body = tag >> 3, mv[pos:pos + n]
        pos += n
        if field == 1:
            info = pb.CacheInfo.FromString(body)
        elif field == 2:
            chunk = pb.LayerChunk.FromString(body)
        elif field == 15:
            data = body
    return info, chunk, data


@dataclasses.dataclass
class Layer:
    """One fetched layer. packed: the compact blob (uint8 array); dense / contiguous: k, v
    [num_kv_heads, kept_tokens, head_dim] in the cache's dtype and positions [num_kv_heads,
    kept_tokens] int32 original token positions. With head-adaptive budgets heads keep
    different counts: head h's real rows are its first counts[h]; the rest, up to kept_tokens
    (the largest count), are zero rows with position -1."""
    layer: int
    kept_tokens: int
    packed: object = None
    k: object = None
    v: object = None
    positions: object = None
    counts: object = None  # dense: int array [num_kv_heads], real rows per head


@dataclasses.dataclass
class CacheData:
    info: object   # CacheInfo
    layers: list   # Layer, layer_begin .. layer_end - 1 in order


class Assembler:
    """Turns GetCache messages into whole layers, each handed over as soon as it is complete."""

    def __init__(self, fmt, tensor_kind, request):
        self.dense = fmt != "packed"
        # The parts a layer of this format has; it is complete when each has all its bytes.
        self.parts = (pb.PART_K, pb.PART_V, pb.PART_POSITIONS) if self.dense else (pb.PART_PACKED,)
        self.kind = _validate.tensor_kind(tensor_kind)
        self.request = request  # GetCacheRequest: its layer range says how many layers to expect
        self.info = None
        self.cur = None  # (layer, kept, {part: array}, {part: received})
        self.expected_layer = None
        self.delivered = 0

    def _fail(self, what):
        return KvcError(grpc.StatusCode.INTERNAL, "GetCache stream: " + what)

    def add(self, raw):
        """Returns a finished Layer or None."""
        info, chunk, data = parse_get_response(raw)
        if info is not None:
            if self.info is not None:
                raise self._fail("second info message")
            self.info = info
            return None
        if chunk is None or self.info is None:
            raise self._fail("chunk before info" if chunk else "message without info or chunk")
        if self.cur is None or self.cur[0] != chunk.layer:
            if self.cur is not None:
                raise self._fail(f"layer {chunk.layer} started before layer {self.cur[0]} ended")
            if self.expected_layer is not None and chunk.layer != self.expected_layer:
                raise self._fail(f"layer {chunk.layer} out of order")
            self.cur = (chunk.layer, chunk.kept_tokens, {}, {})
        layer, kept, parts, got = self.cur
        if chunk.kept_tokens != kept:
            raise self._fail(f"layer {layer} kept_tokens changed")
        p = chunk.part
        if p not in parts:
            self._check_total(layer, chunk)
            parts[p] = np.empty(chunk.total_bytes, dtype=np.uint8)
            got[p] = 0
        buf = parts[p]
        if chunk.total_bytes != len(buf) or chunk.offset != got[p] or \
                chunk.offset + len(data) > len(buf):
            raise self._fail(f"layer {layer} part {p}: chunk at {chunk.offset} out of place")
        buf[chunk.offset:chunk.offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        got[p] += len(data)
        if any(q not in parts or got[q] < len(parts[q]) for q in self.parts):
            return None
        self.cur = None
        self.expected_layer = layer + 1
        self.delivered += 1
        return self._layer(layer, kept, parts)

    def _check_total(self, layer, chunk):
        """A part's size follows from the CacheInfo (as the C++ client checks it), before its
        buffer is allocated: a bare total_bytes is never trusted."""
        if chunk.part not in self.parts:
            raise self._fail(f"unexpected part {chunk.part} for layer {layer}")
        if not self.dense:
            cap = self.info.stored_bytes
            if cap and chunk.total_bytes > cap:
                raise self._fail(f"layer {layer} total_bytes {chunk.total_bytes} exceeds "
                                 f"stored_bytes {cap}")
            return
        s = self.info.shape
        if chunk.kept_tokens > s.seq_len:
            raise self._fail(f"layer {layer} kept_tokens {chunk.kept_tokens} outside [0, "
                             f"seq_len {s.seq_len}]")
        if self.info.dtype not in tensors.ELEM_BYTES:
            raise self._fail(f"CacheInfo dtype {self.info.dtype} unknown")
        esz = 4 if chunk.part == pb.PART_POSITIONS else \
            s.head_dim * tensors.ELEM_BYTES[self.info.dtype]
        expected = s.num_kv_heads * chunk.kept_tokens * esz
        if chunk.total_bytes != expected:
            raise self._fail(f"layer {layer} part {chunk.part} total_bytes {chunk.total_bytes} "
                             f"!= expected {expected}")

    def _layer(self, layer, kept, parts):
        if not self.dense:
            return Layer(layer, kept, packed=parts[pb.PART_PACKED])
        s = self.info.shape
        shape = (s.num_kv_heads, kept, s.head_dim)
        size = s.num_kv_heads * kept * s.head_dim * tensors.ELEM_BYTES[self.info.dtype]
        if len(parts[pb.PART_K]) != size or len(parts[pb.PART_V]) != size or \
                len(parts[pb.PART_POSITIONS]) != s.num_kv_heads * kept * 4:
            raise self._fail(f"layer {layer}: part sizes do not match {shape}")
        positions = parts[pb.PART_POSITIONS].view(np.int32).reshape(shape[:2])
        valid = positions >= 0
        counts = valid.sum(axis=1)
        # Padding (-1) only after a head's real rows.
        if kept and not np.array_equal(valid, np.arange(kept)[None, :] < counts[:, None]):
            raise self._fail(f"layer {layer}: position -1 (padding) before a real row")
        return Layer(layer, kept,
                     k=tensors.from_bytes(parts[pb.PART_K], self.info.dtype, shape, self.kind),
                     v=tensors.from_bytes(parts[pb.PART_V], self.info.dtype, shape, self.kind),
                     positions=positions, counts=counts)

    def finish(self):
        if self.info is None:
            raise self._fail("ended without info")
        if self.cur is not None:
            raise self._fail(f"ended inside layer {self.cur[0]}")
        r = self.request
        end = r.layer_end if r.HasField("layer_end") else self.info.shape.num_layers
        want = max(0, end - r.layer_begin)
        if self.delivered != want:
            raise self._fail(f"{self.delivered} of {want} layers received")

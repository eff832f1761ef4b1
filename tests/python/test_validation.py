"""The Python client refuses bad arguments naming them, and hands the layer iterator's own
exception back at once (the hardening review of the Python client, rebuilt as tests)."""

import asyncio
import time

import grpc
import numpy as np
import pytest

import kvc

L, HKV, HQ, S, D, W = 2, 2, 4, 32, 8, 4
STATS_COLS = D + D * D


def layers(seed=0, dtype=np.float32, n=L):
    rng = np.random.default_rng(seed)
    return [tuple(rng.standard_normal(shape).astype(dtype)
                  for shape in ((HKV, S, D), (HKV, S, D), (HQ, W, D))) for _ in range(n)]


def invalid(excinfo, field):
    """The KvcError is INVALID_ARGUMENT and its message starts with the field."""
    e = excinfo.value
    assert e.code == grpc.StatusCode.INVALID_ARGUMENT, e
    assert e.details.startswith(field + ":"), e.details
    return e.details


@pytest.fixture(scope="module")
def server(make_kvcd):
    # A long idle time: an upload whose client hangs would take this long to end server-side.
    return make_kvcd("--stream_idle_seconds=60")


@pytest.fixture(scope="module")
def client(server):
    with kvc.Client(server.address, max_chunk_bytes=4096) as c:
        yield c


def stats_layers(dtype):
    return [{"k": k, "v": v, "q_stats": np.ones((HQ, STATS_COLS), dtype)}
            for k, v, _ in layers(1)]


EXPECTED = {"eviction": {"policy": "expected", "keep_ratio": 0.5}}
ROPE = {"theta": 10000, "style": "ROPE_HALF_SPLIT"}


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.int64])
def test_integer_q_stats_are_refused_naming_the_tensor(client, dtype):
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/v/stats-int", stats_layers(dtype), compression=EXPECTED, rope=ROPE)
    assert "is not a float type" in invalid(e, "layers[0].q_stats")
    with pytest.raises(kvc.KvcError) as e:
        client.stat("py/v/stats-int")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


def test_float64_q_stats_are_sent_as_float32(client):
    client.put("py/v/stats-f64", stats_layers(np.float64), compression=EXPECTED, rope=ROPE)
    assert list(client.stat("py/v/stats-f64").kept_tokens) == [S // 2] * L


def test_tensors_must_hold_the_uploads_dtype(client):
    ints = [tuple(x.astype(np.int32) for x in layer) for layer in layers(2)]
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/v/int", ints)
    assert "numpy int32 is not float32 or float16" in invalid(e, "layers[0].k")
    with pytest.raises(kvc.KvcError) as e:  # a forced dtype does not turn integers into floats
        client.put("py/v/int", [tuple(x.astype(np.int16) for x in layer) for layer in layers(2)],
                   dtype="f16")
    assert "numpy int16 elements do not match dtype='f16'" in invalid(e, "layers[0].k")
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/v/f32-as-f16", layers(2), dtype="f16")
    assert invalid(e, "layers[0].k") == (
        "layers[0].k: numpy float32 elements do not match dtype='f16' "
        "(DTYPE_F16 needs float16)")
    mixed = layers(2)
    mixed[1] = (mixed[1][0], mixed[1][1].astype(np.float16), mixed[1][2])
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/v/mixed", mixed)
    assert "numpy float16 elements do not match layers[0].k" in invalid(e, "layers[1].v")


class Stop(Exception):
    pass


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), Stop("mine")])
def test_the_iterators_own_exception_comes_back_at_once(client, exc):
    def produce():
        yield layers(3)[0]
        raise exc

    start = time.monotonic()
    with pytest.raises(type(exc)) as e:
        client.put("py/v/iter", produce(), num_layers=L)
    took = time.monotonic() - start
    assert e.value is exc
    assert took < 10, f"put took {took:.1f} s: it waited on the server instead of cancelling"
    with pytest.raises(kvc.KvcError) as e:
        client.stat("py/v/iter")
    assert e.value.code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), Stop("mine")])
def test_the_async_iterators_own_exception_comes_back_at_once(server, exc):
    async def main():
        async with kvc.aio.Client(server.address, max_chunk_bytes=4096) as c:
            async def produce():
                yield layers(4)[0]
                raise exc

            start = time.monotonic()
            with pytest.raises(type(exc)) as e:
                await c.put("py/v/aiter", produce(), num_layers=L)
            assert e.value is exc
            assert time.monotonic() - start < 10
            with pytest.raises(kvc.KvcError) as e:
                await c.stat("py/v/aiter")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
    asyncio.run(main())


@pytest.mark.parametrize("field", ["timeout", "stream_timeout", "initial_backoff",
                                   "max_backoff"])
@pytest.mark.parametrize("value", [float("inf"), float("nan"), -1.0])
def test_timeouts_must_be_finite(server, field, value):
    with pytest.raises(kvc.KvcError) as e:
        kvc.Client(server.address, **{field: value})
    assert "must be finite" in invalid(e, field)
    with pytest.raises(kvc.KvcError) as e:
        kvc.aio.Client(server.address, **{field: value})
    invalid(e, field)


@pytest.mark.parametrize("field,value", [("keepalive_time", 9.9), ("keepalive_time", 7201),
                                         ("keepalive_timeout", 0.5), ("keepalive_timeout", 601),
                                         ("keepalive_time", float("nan"))])
def test_keepalive_limits(server, field, value):
    with pytest.raises(kvc.KvcError) as e:
        kvc.Client(server.address, **{field: value})
    invalid(e, field)


def test_keepalive_reaches_the_channel(server):
    with kvc.Client(server.address, keepalive_time=10, keepalive_timeout=1) as c:
        c.list("py/v/keepalive")  # a call on a channel that carries the options
    opts = dict(kvc._common.Options(keepalive_time=10, keepalive_timeout=1).channel_options())
    assert opts["grpc.keepalive_time_ms"] == 10000
    assert opts["grpc.keepalive_timeout_ms"] == 1000


def test_bytes_ids_are_accepted_everywhere(client):
    client.put(b"py/v/bytes", layers(5), overwrite=True)
    assert client.get(b"py/v/bytes", format="dense").info.cache_id == "py/v/bytes"
    assert client.stat(b"py/v/bytes").cache_id == "py/v/bytes"
    assert [c.cache_id for c in client.list(b"py/v/by")] == ["py/v/bytes"]
    assert client.delete(bytearray(b"py/v/bytes")) > 0


@pytest.mark.parametrize("call", ["put", "get", "stat", "delete"])
def test_bad_ids_name_the_field(client, call):
    run = {"put": lambda i: client.put(i, layers(6)), "get": lambda i: client.get(i),
           "stat": client.stat, "delete": client.delete}[call]
    with pytest.raises(kvc.KvcError) as e:
        run(5)
    assert invalid(e, "cache_id") == "cache_id: expected str or bytes, got int"
    with pytest.raises(kvc.KvcError) as e:
        run(b"py/\xff")
    assert "is not valid UTF-8" in invalid(e, "cache_id")
    with pytest.raises(kvc.KvcError) as e:
        run("")
    invalid(e, "cache_id")


def test_every_value_error_names_its_field(client):
    client.put("py/v/fields", layers(7), overwrite=True)
    with pytest.raises(kvc.KvcError) as e:
        client.get("py/v/fields", layer_begin=-1)
    assert invalid(e, "layer_begin") == "layer_begin: -1 is outside [0, 4294967295]"
    with pytest.raises(kvc.KvcError) as e:
        client.get("py/v/fields", layer_end=-1)
    invalid(e, "layer_end")
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/v/ttl", layers(7), ttl_seconds=-1)
    assert invalid(e, "ttl_seconds") == "ttl_seconds: -1 is outside [0, 4294967295]"
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/v/ttl", layers(7), ttl_seconds=1 << 32)
    invalid(e, "ttl_seconds")
    with pytest.raises(kvc.KvcError) as e:
        client.list(7)
    invalid(e, "prefix")


def test_unknown_tensor_kinds_are_refused(client, server):
    client.put("py/v/kind", layers(8), overwrite=True)
    with pytest.raises(kvc.KvcError) as e:
        client.get("py/v/kind", format="dense", tensors="bogus")
    assert invalid(e, "tensors") == "tensors: 'bogus' is not 'numpy', 'torch' or 'auto'"

    async def main():
        async with kvc.aio.Client(server.address) as c:
            with pytest.raises(kvc.KvcError) as e:
                await c.get("py/v/kind", format="dense", tensors="bogus")
            invalid(e, "tensors")
            with pytest.raises(kvc.KvcError) as e:
                await c.stat(5)
            invalid(e, "cache_id")
    asyncio.run(main())


def test_get_stream_sizes_come_from_the_cache_info():
    """A GetCache answer's part sizes are checked against its CacheInfo before any buffer is
    allocated, as the C++ client does: a server's bare total_bytes is never trusted."""
    from kvc._common import Assembler
    from kvc._pb import pb

    info = pb.CacheInfo(cache_id="c", dtype=pb.DTYPE_F16, stored_bytes=5000,
                        shape=pb.ModelShape(num_layers=1, num_kv_heads=2, num_q_heads=4,
                                            head_dim=8, seq_len=32))

    def message(**kw):
        return pb.GetCacheResponse(**kw).SerializeToString()

    def chunk(part, total, kept=32, data=b""):
        return message(chunk=pb.LayerChunk(layer=0, part=part, offset=0, total_bytes=total,
                                           kept_tokens=kept), data=data)

    def fed(fmt, *messages):
        asm = Assembler(fmt, "numpy", pb.GetCacheRequest(cache_id="c"))
        asm.add(message(info=info))
        out = None
        for m in messages:
            out = asm.add(m)
        return out

    def refused(fmt, m, words):
        with pytest.raises(kvc.KvcError) as e:
            fed(fmt, m)
        assert e.value.code == grpc.StatusCode.INTERNAL and words in e.value.details, e.value

    # Dense K of 2 heads x 32 tokens x 8 channels x 2 bytes is 1,024 bytes, nothing else.
    refused("dense", chunk(pb.PART_K, 2**50), "total_bytes 1125899906842624 != expected 1024")
    refused("dense", chunk(pb.PART_K, 2048), "!= expected 1024")
    refused("dense", chunk(pb.PART_POSITIONS, 2**40, kept=2**31), "outside [0, seq_len 32]")
    refused("dense", chunk(pb.PART_PACKED, 100), "unexpected part")
    refused("packed", chunk(pb.PART_PACKED, 2**50), "exceeds stored_bytes 5000")
    refused("packed", chunk(pb.PART_K, 100), "unexpected part")
    # The right sizes assemble: a dense layer of 16 tokens, and a packed one within the bytes.
    k = np.arange(2 * 16 * 8, dtype=np.float16).tobytes()
    pos = np.tile(np.arange(16, dtype=np.int32), 2).tobytes()
    layer = fed("dense", chunk(pb.PART_K, len(k), 16, k), chunk(pb.PART_V, len(k), 16, k),
                chunk(pb.PART_POSITIONS, len(pos), 16, pos))
    assert layer.k.shape == (2, 16, 8) and layer.counts.tolist() == [16, 16]
    assert fed("packed", chunk(pb.PART_PACKED, 5000, 32, bytes(5000))).packed.size == 5000

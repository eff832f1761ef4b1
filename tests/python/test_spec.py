"""kvc.spec: spec strings as CompressionConfig dicts, and the errors of bad ones."""

import pytest

from kvc import spec


def test_full_spec():
    assert spec.parse("snapkv:0.25,kernel=5,pool=avg+think:0.5+q4g64") == {
        "eviction": {"policy": "snapkv", "keep_ratio": 0.25, "pool_kernel": 5, "pool": "avg"},
        "channels": {"key_policy": "think", "key_lambda": 0.5},
        "quant": {"bits": 4, "group_size": 64}}


def test_value_bits():
    assert spec.parse("kvzip:0.5+q8v4g64+r=0")["quant"] == {
        "bits": 8, "value_bits": 4, "group_size": 64}
    assert spec.parse("q2v8")["quant"] == {"bits": 2, "value_bits": 8}
    assert spec.parse("q4v4")["quant"] == {"bits": 4}  # the same bits: the plain term


def test_budget_options_and_alone_terms():
    assert spec.parse("expected@100,stats=1,horizon=512,veps=0,ada=0.2") == {
        "eviction": {"policy": "expected", "budget": 100, "query_stats": True, "horizon": 512,
                     "value_eps": 0.0, "adaptive": True, "adaptive_floor": 0.2}}
    assert spec.parse("h2o:0.5,layer=1,recent=0+r=8")["eviction"]["granularity"] == \
        "GRANULARITY_PER_LAYER"
    assert spec.parse("full") == {} and spec.parse(" none ") == {}
    assert spec.parse("vthink:0.25")["channels"] == {"prune_values": True, "value_lambda": 0.25}
    assert spec.parse("kvzip:0.1,ada=0,xlayer=1") == {
        "eviction": {"policy": "kvzip", "keep_ratio": 0.1, "adaptive": True,
                     "adaptive_floor": 0.0, "layer_adaptive": True}}
    assert spec.parse("kvzip:0.1,stats=1,passes=2057/1040,chunk=2048")["eviction"] == {
        "policy": "kvzip", "keep_ratio": 0.1, "query_stats": True, "pass_rows": [2057, 1040],
        "pass_tokens": 2048}
    assert spec.parse("kvzip:0.1,stats=1,top=4")["eviction"] == {
        "policy": "kvzip", "keep_ratio": 0.1, "query_stats": True, "top_rows": 4}


@pytest.mark.parametrize("bad, words", [
    ("", "empty"),
    ("snapkv", "needs an amount"),
    ("snapkv:0", "outside (0, 1]"),
    ("snapkv:1.5", "outside (0, 1]"),
    ("snapkv@0", "must be >= 1"),
    ("snapkv:x", "not a number"),
    ("nosuch:0.5", "unknown term"),
    ("snapkv:0.5,pool=min", "not max or avg"),
    ("snapkv:0.5,kernel", "not key=value"),
    ("snapkv:0.5,color=red", "unknown option"),
    ("kvzip:0.5,xlayer=2", "not 0 or 1"),
    ("kvzip:0.5,passes=10/0", "must be >= 1"),
    ("kvzip:0.5,passes=10/x", "not a number"),
    ("kvzip:0.5,chunk=0", "must be >= 1"),
    ("kvzip:0.5,top=0", "outside [1, 64]"),
    ("kvzip:0.5,top=65", "outside [1, 64]"),
    ("snapkv:0.5+knorm:0.5", "a second eviction"),
    ("q3", "not 2, 4 or 8"),
    ("q8v", "value bits missing"),
    ("q8v3g64", "value bits 3 is not 2, 4 or 8"),
    ("q8vx", "value bits 'x' is not a number"),
    ("q4+q8", "a second quantization"),
    ("think:1.0", "outside [0, 1)"),
    ("full+q4", "stand alone"),
    ("snapkv:0.5++q4", "empty term"),
])
def test_bad_specs_name_the_term(bad, words):
    with pytest.raises(ValueError) as e:
        spec.parse(bad)
    assert words in str(e.value)


def test_needs_queries():
    assert spec.needs_queries(spec.parse("snapkv:0.5"))
    assert spec.needs_queries(spec.parse("kvzip:0.5"))
    assert spec.needs_queries(spec.parse("expected:0.5"))
    assert not spec.needs_queries(spec.parse("expected:0.5,stats=1"))
    assert not spec.needs_queries(spec.parse("knorm:0.5+q4"))
    assert spec.needs_queries(spec.parse("knorm:0.5+think:0.5"))

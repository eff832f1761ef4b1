#include "kvc/spec.h"

#include <cmath>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

LayerShape Shape(int W = 8) {
  return {.num_kv_heads = 2, .num_q_heads = 4, .seq_len = 100, .head_dim = 64, .obs_window = W};
}

void ExpectInvalid(const CompressionSpec& spec, const std::string& field, int W = 8,
                   int layer = 0) {
  const absl::Status s = ValidateSpec(spec, Shape(W), layer);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field));
}

TEST(ValidateSpecTest, DefaultsAreValid) {
  EXPECT_TRUE(ValidateSpec(CompressionSpec(), Shape(), 0).ok());
  EXPECT_TRUE(ValidateSpec(CompressionSpec(), Shape(0), 0).ok());
}

// Only kvzip's rows (a reconstruction pass after the prompt) may outnumber the prompt's tokens;
// every other reader of Q_obs takes row t as prompt position S - W + t.
TEST(ValidateSpecTest, ObsWindowPastSeqLenOnlyForKVzip) {
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kKVzip;
  EXPECT_TRUE(ValidateSpec(s, Shape(109), 0).ok());
  s.channels.key_policy = ChannelPolicy::kThink;
  s.channels.key_lambda = 0.5;
  s.channels.prune_values = true;
  s.channels.value_lambda = 0.5;
  EXPECT_TRUE(ValidateSpec(s, Shape(109), 0).ok());
  for (EvictionPolicy p : {EvictionPolicy::kNone, EvictionPolicy::kH2O, EvictionPolicy::kSnapKV,
                           EvictionPolicy::kKeyformer, EvictionPolicy::kExpectedAttention}) {
    s = {};
    s.eviction.policy = p;
    ExpectInvalid(s, "shape.obs_window: 109 exceeds seq_len 100", 109);
  }
}

// kvzip's reconstruction passes: one per chunk of pass_tokens context tokens, each with at least
// a row per token of its chunk, summing to the observation rows.
TEST(ValidateSpecTest, KVzipPasses) {
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kKVzip;
  s.eviction.pass_tokens = 40;           // seq_len 100: chunks of 40, 40 and 20
  s.eviction.pass_rows = {49, 40, 20};  // 109 rows
  EXPECT_TRUE(ValidateSpec(s, Shape(109), 0).ok());
  ExpectInvalid(s, "eviction.pass_rows: the passes' rows sum to 109, not shape.obs_window 110",
                110);
  s.eviction.pass_rows = {49, 60};
  ExpectInvalid(s, "eviction.pass_rows: 2 passes, but seq_len 100 in chunks of 40", 109);
  s.eviction.pass_rows = {49, 41, 19};  // the last chunk has 20 tokens
  ExpectInvalid(s, "eviction.pass_rows[2]: 19 rows for a pass that repeats 20", 109);
  s.eviction.pass_rows = {109};
  s.eviction.pass_tokens = 0;
  ExpectInvalid(s, "eviction.pass_tokens: 0 must be >= 1", 109);
  s.eviction.pass_tokens = 100;  // one pass over the whole context
  EXPECT_TRUE(ValidateSpec(s, Shape(109), 0).ok());
  s.eviction.pass_tokens = 1 << 30;  // chunks longer than the context: one pass
  EXPECT_TRUE(ValidateSpec(s, Shape(109), 0).ok());
  s.eviction.policy = EvictionPolicy::kSnapKV;
  ExpectInvalid(s, "eviction.pass_rows: reconstruction passes are read only by kvzip", 8);
}

// kvzip's mean over the top rows: [1, kMaxTopRows], kvzip only (1, the default, anywhere).
TEST(ValidateSpecTest, KVzipTopRows) {
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kKVzip;
  for (int k : {1, 2, 4, kMaxTopRows}) {
    s.eviction.top_rows = k;
    EXPECT_TRUE(ValidateSpec(s, Shape(109), 0).ok()) << k;
  }
  s.eviction.top_rows = 0;
  ExpectInvalid(s, "eviction.top_rows: 0 is outside [1, 64]", 109);
  s.eviction.top_rows = kMaxTopRows + 1;
  ExpectInvalid(s, "eviction.top_rows: 65 is outside [1, 64]", 109);
  s.eviction.top_rows = 4;
  s.eviction.policy = EvictionPolicy::kH2O;
  ExpectInvalid(s, "eviction.top_rows: a mean over the top rows is read only by kvzip, not h2o", 8);
  s.eviction.top_rows = 1;
  EXPECT_TRUE(ValidateSpec(s, Shape(8), 0).ok());
}

TEST(ValidateSpecTest, EvictionLimits) {
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kH2O;
  s.eviction.budget = 100;  // == seq_len is fine
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
  s.eviction.budget = 101;
  ExpectInvalid(s, "eviction.budget");
  s.eviction.budget = -1;
  ExpectInvalid(s, "eviction.budget");
  s = {};
  s.eviction.keep_ratio = 0.0;
  ExpectInvalid(s, "eviction.keep_ratio");
  s.eviction.keep_ratio = 1.0001;
  ExpectInvalid(s, "eviction.keep_ratio");
  s.eviction.keep_ratio = std::nan("");
  ExpectInvalid(s, "eviction.keep_ratio");
  s.eviction.keep_ratio = 1.0;
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
  s.eviction.keep_ratio = 1e-9;
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
  s = {};
  s.eviction.layer_budgets = {10, 100, 101};
  ExpectInvalid(s, "eviction.layer_budgets[2]");
  s.eviction.layer_budgets = {10, -1};
  ExpectInvalid(s, "eviction.layer_budgets[1]");
  s = {};
  s.eviction.policy = static_cast<EvictionPolicy>(kNumPolicies);
  ExpectInvalid(s, "eviction.policy");
  s = {};
  s.eviction.granularity = static_cast<Granularity>(2);
  ExpectInvalid(s, "eviction.granularity");
  s = {};
  s.eviction.sink_tokens = -1;
  ExpectInvalid(s, "eviction.sink_tokens");
  s = {};
  s.eviction.recent_fraction = 1.5;
  ExpectInvalid(s, "eviction.recent_fraction");
  s.eviction.recent_fraction = std::nan("");
  ExpectInvalid(s, "eviction.recent_fraction");
  s.eviction.recent_fraction = 1.0;
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
  s = {};
  s.eviction.pool_kernel = 6;
  ExpectInvalid(s, "eviction.pool_kernel");
  s.eviction.pool_kernel = 0;
  ExpectInvalid(s, "eviction.pool_kernel");
  s.eviction.pool_kernel = 1;
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
  s = {};
  s.eviction.pool = static_cast<PoolKind>(3);
  ExpectInvalid(s, "eviction.pool");
  s = {};
  s.eviction.tau = 0.0;
  ExpectInvalid(s, "eviction.tau");
  s.eviction.tau = -1.0;
  ExpectInvalid(s, "eviction.tau");
  s.eviction.tau = INFINITY;
  ExpectInvalid(s, "eviction.tau");
  s = {};
  ExpectInvalid(s, "layer_index", 8, -1);
}

TEST(ValidateSpecTest, PoliciesThatNeedQueriesRejectEmptyWindow) {
  for (EvictionPolicy p :
       {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV, EvictionPolicy::kKeyformer}) {
    CompressionSpec s;
    s.eviction.policy = p;
    ExpectInvalid(s, "eviction.policy", /*W=*/0);
    EXPECT_TRUE(ValidateSpec(s, Shape(1), 0).ok());
  }
  for (EvictionPolicy p : {EvictionPolicy::kNone, EvictionPolicy::kStreaming,
                           EvictionPolicy::kKNorm, EvictionPolicy::kRandom}) {
    CompressionSpec s;
    s.eviction.policy = p;
    EXPECT_TRUE(ValidateSpec(s, Shape(0), 0).ok()) << PolicyName(p);
  }
  CompressionSpec s;
  s.channels.key_policy = ChannelPolicy::kThink;
  ExpectInvalid(s, "channels.key_policy", 0);
  s.channels.key_policy = ChannelPolicy::kL2;  // magnitude needs no queries
  EXPECT_TRUE(ValidateSpec(s, Shape(0), 0).ok());
  s = {};
  s.channels.prune_values = true;
  ExpectInvalid(s, "channels.prune_values", 0);
}

TEST(ValidateSpecTest, ChannelAndQuantLimits) {
  CompressionSpec s;
  s.channels.key_lambda = 1.0;
  ExpectInvalid(s, "channels.key_lambda");
  s.channels.key_lambda = -0.1;
  ExpectInvalid(s, "channels.key_lambda");
  s.channels.key_lambda = 0.99;
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
  s = {};
  s.channels.value_lambda = 1.0;
  ExpectInvalid(s, "channels.value_lambda");
  s = {};
  s.channels.key_policy = static_cast<ChannelPolicy>(4);
  ExpectInvalid(s, "channels.key_policy");
  for (int bits : {1, 3, 5, 16, -2}) {
    s = {};
    s.quant.bits = bits;
    ExpectInvalid(s, "quant.bits");
  }
  for (int bits : {0, 2, 4, 8}) {
    s = {};
    s.quant.bits = bits;
    EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok()) << bits;
  }
  s = {};
  s.quant.bits = 4;
  s.quant.group_size = 0;
  ExpectInvalid(s, "quant.group_size");
  s.quant.group_size = 48;  // does not divide 64
  ExpectInvalid(s, "quant.group_size");
  s.quant.group_size = 64;
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
  s.quant.bits = 0;  // group size is irrelevant without quantization
  s.quant.group_size = 48;
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
  // The values' own bits: 0 (as the keys), 2, 4 or 8, and only with the keys quantized.
  s = {};
  s.quant.bits = 8;
  for (int vbits : {0, 2, 4, 8}) {
    s.quant.value_bits = vbits;
    EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok()) << vbits;
    EXPECT_EQ(ValueBits(s.quant), vbits == 0 ? 8 : vbits);
    EXPECT_EQ(KeyBits(s.quant), 8);
  }
  for (int vbits : {1, 3, 16, -1}) {
    s.quant.value_bits = vbits;
    ExpectInvalid(s, "quant.value_bits");
  }
  s.quant.bits = 0;
  s.quant.value_bits = 4;
  ExpectInvalid(s, "quant.value_bits");
  s = {};
  s.recent_tokens = -1;
  ExpectInvalid(s, "recent_tokens");
  s.recent_tokens = 0;
  EXPECT_TRUE(ValidateSpec(s, Shape(), 0).ok());
}

TEST(EffectiveBudgetTest, CountRatioAndLayerOverrides) {
  EvictionSpec e;
  e.policy = EvictionPolicy::kH2O;
  e.keep_ratio = 0.25;
  EXPECT_EQ(EffectiveBudget(e, 0, 100), 25);
  e.keep_ratio = 0.001;  // rounds to 0, at least 1 token
  EXPECT_EQ(EffectiveBudget(e, 0, 100), 1);
  e.keep_ratio = 0.255;
  EXPECT_EQ(EffectiveBudget(e, 0, 100), 26);  // round(25.5) = 26
  e.budget = 40;                              // an explicit count wins over the ratio
  EXPECT_EQ(EffectiveBudget(e, 0, 100), 40);
  e.layer_budgets = {0, 7};
  EXPECT_EQ(EffectiveBudget(e, 0, 100), 40);  // 0 entry falls back
  EXPECT_EQ(EffectiveBudget(e, 1, 100), 7);
  EXPECT_EQ(EffectiveBudget(e, 2, 100), 40);  // past the list
  e.policy = EvictionPolicy::kNone;           // keeps everything
  EXPECT_EQ(EffectiveBudget(e, 1, 100), 100);
}

TEST(KeptChannelsTest, FloorOfPrunedFraction) {
  EXPECT_EQ(KeptChannels(0.0, 128), 128);
  EXPECT_EQ(KeptChannels(0.5, 128), 64);
  EXPECT_EQ(KeptChannels(0.4, 128), 77);  // floor(51.2) = 51 pruned
  EXPECT_EQ(KeptChannels(0.99, 8), 1);    // floor(7.92) = 7 pruned
}

TEST(PolicyNamesTest, RoundTripAndUnknown) {
  for (const std::string& n : EvictionPolicyNames()) {
    absl::StatusOr<EvictionPolicy> p = ParseEvictionPolicy(n);
    ASSERT_TRUE(p.ok()) << n;
    EXPECT_EQ(PolicyName(*p), n);
  }
  EXPECT_EQ(EvictionPolicyNames().size(), kNumPolicies);
  for (const std::string& n : ChannelPolicyNames()) {
    absl::StatusOr<ChannelPolicy> p = ParseChannelPolicy(n);
    ASSERT_TRUE(p.ok()) << n;
    EXPECT_EQ(PolicyName(*p), n);
  }
  EXPECT_EQ(ChannelPolicyNames().size(), 4u);
  EXPECT_EQ(*ParseEvictionPolicy("SnapKV"), EvictionPolicy::kSnapKV);
  absl::StatusOr<EvictionPolicy> bad = ParseEvictionPolicy("lru");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("eviction.policy"));
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("lru"));
  EXPECT_THAT(std::string(ParseChannelPolicy("l3").status().message()),
              HasSubstr("channels.key_policy"));
}

}  // namespace
}  // namespace kvc

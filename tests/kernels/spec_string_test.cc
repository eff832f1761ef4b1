#include "kvc/protocol/spec_string.h"

#include <string>

#include "kvc/protocol/convert.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/spec.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

CompressionSpec Parse(const std::string& text) {
  absl::StatusOr<CompressionSpec> s = ParseSpecString(text);
  EXPECT_TRUE(s.ok()) << text << ": " << s.status();
  return s.ok() ? *s : CompressionSpec();
}

void ExpectError(const std::string& text, const std::string& what) {
  absl::StatusOr<CompressionSpec> s = ParseSpecString(text);
  ASSERT_FALSE(s.ok()) << text;
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << text;
  EXPECT_THAT(std::string(s.status().message()), HasSubstr(what)) << text;
}

TEST(SpecStringTest, CombinedSpec) {
  const CompressionSpec s = Parse("keyformer:0.5+think:0.25+q4");
  EXPECT_EQ(s.eviction.policy, EvictionPolicy::kKeyformer);
  EXPECT_EQ(s.eviction.keep_ratio, 0.5);
  EXPECT_EQ(s.eviction.budget, 0);
  EXPECT_EQ(s.channels.key_policy, ChannelPolicy::kThink);
  EXPECT_EQ(s.channels.key_lambda, 0.25);
  EXPECT_FALSE(s.channels.prune_values);
  EXPECT_EQ(s.quant.bits, 4);
  EXPECT_EQ(s.quant.group_size, 32);
  EXPECT_EQ(s.recent_tokens, 32);
}

TEST(SpecStringTest, EvictionOptionsAndOtherTerms) {
  const CompressionSpec s = Parse(
      " snapkv@96,kernel=5,pool=avg,sink=2,recent=0.25,tau=0.5,seed=9,layer=1,lb=10/0/30 + "
      "vthink:0.5 + l2:0.125 + q2g16 + r=8 ");
  EXPECT_EQ(s.eviction.policy, EvictionPolicy::kSnapKV);
  EXPECT_EQ(s.eviction.budget, 96);
  EXPECT_EQ(s.eviction.pool_kernel, 5);
  EXPECT_EQ(s.eviction.pool, PoolKind::kAvg);
  EXPECT_EQ(s.eviction.sink_tokens, 2);
  EXPECT_EQ(s.eviction.recent_fraction, 0.25);
  EXPECT_EQ(s.eviction.tau, 0.5);
  EXPECT_EQ(s.eviction.seed, 9u);
  EXPECT_EQ(s.eviction.granularity, Granularity::kPerLayer);
  EXPECT_EQ(s.eviction.layer_budgets, (std::vector<int>{10, 0, 30}));
  EXPECT_TRUE(s.channels.prune_values);
  EXPECT_EQ(s.channels.value_lambda, 0.5);
  EXPECT_EQ(s.channels.key_policy, ChannelPolicy::kL2);
  EXPECT_EQ(s.channels.key_lambda, 0.125);
  EXPECT_EQ(s.quant.bits, 2);
  EXPECT_EQ(s.quant.group_size, 16);
  EXPECT_EQ(s.quant.value_bits, 0);
  const CompressionSpec kv = Parse("kvzip:0.5+q8v4g64+r=0");
  EXPECT_EQ(kv.quant.bits, 8);
  EXPECT_EQ(kv.quant.value_bits, 4);
  EXPECT_EQ(kv.quant.group_size, 64);
  EXPECT_EQ(Parse("q2v8").quant.value_bits, 8);
  EXPECT_EQ(Parse("q4v4").quant.value_bits, 0);  // the same bits: the plain term
  EXPECT_EQ(s.recent_tokens, 8);
}

// kvzip's reconstruction passes: rows per pass, and the context tokens one pass repeats.
TEST(SpecStringTest, KVzipPasses) {
  const CompressionSpec s = Parse("kvzip:0.25,stats=1,passes=2057/1036,chunk=2048");
  EXPECT_EQ(s.eviction.pass_rows, (std::vector<int>{2057, 1036}));
  EXPECT_EQ(s.eviction.pass_tokens, 2048);
  EXPECT_EQ(Parse("kvzip:0.25").eviction.pass_tokens, kDefaultPassTokens);
  ExpectError("kvzip:0.25,passes=0/4", "passes");
  ExpectError("kvzip:0.25,passes=12,chunk=0", "chunk");
}

// kvzip's mean over the top rows: "top=K", K in [1, 64], written only when it is not 1.
TEST(SpecStringTest, KVzipTopRows) {
  EXPECT_EQ(Parse("kvzip:0.1,top=4").eviction.top_rows, 4);
  EXPECT_EQ(Parse("kvzip:0.1").eviction.top_rows, 1);
  ExpectError("kvzip:0.1,top=0", "top");
  ExpectError("kvzip:0.1,top=65", "top");
  EXPECT_EQ(SpecString(Parse("kvzip:0.1,stats=1,top=4")), "kvzip:0.1,stats=1,top=4");
  EXPECT_EQ(SpecString(Parse("kvzip:0.1,top=1")), "kvzip:0.1");
  absl::StatusOr<kvcache::v1::CompressionConfig> c = ParseSpecConfig("kvzip:0.1,top=4");
  ASSERT_TRUE(c.ok()) << c.status();
  // On the wire: a count past the engine's largest is refused before it is copied, one past 64
  // by validation.
  kvcache::v1::CompressionConfig big = *c;
  big.mutable_eviction()->set_top_rows(4000000000u);
  const LayerShape shape{1, 1, 10, 8, 12};
  absl::StatusOr<CompressionSpec> s = SpecFromProto(big, shape, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("eviction.top_rows: 4000000000 is too large"));
  big.mutable_eviction()->set_top_rows(65);
  s = SpecFromProto(big, shape, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("eviction.top_rows: 65 is outside [1, 64]"));
}

// The wire's limits on the passes, before anything is copied: no more entries than tokens, no
// entry or chunk past the largest count the engine takes.
TEST(SpecStringTest, KVzipPassesOnTheWireAreBounded) {
  const LayerShape shape{1, 1, 10, 8, 12};
  absl::StatusOr<kvcache::v1::CompressionConfig> c =
      ParseSpecConfig("kvzip:0.5,passes=6/6,chunk=5");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE(SpecFromProto(*c, shape, 1).ok());
  kvcache::v1::CompressionConfig many = *c;
  for (int i = 0; i < 9; ++i) many.mutable_eviction()->add_pass_rows(1);  // 11 for 10 tokens
  absl::StatusOr<CompressionSpec> s = SpecFromProto(many, shape, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("eviction.pass_rows: 11 passes for 10"));
  kvcache::v1::CompressionConfig big = *c;
  big.mutable_eviction()->set_pass_rows(0, (1u << 30) + 1);
  s = SpecFromProto(big, shape, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("eviction.pass_rows: 1073741825 is too large"));
  big = *c;
  big.mutable_eviction()->set_pass_tokens(4000000000u);
  s = SpecFromProto(big, shape, 1);
  ASSERT_FALSE(s.ok());
  EXPECT_THAT(std::string(s.status().message()),
              HasSubstr("eviction.pass_tokens: 4000000000 is too large"));
}

TEST(SpecStringTest, FullAndNone) {
  for (const char* text : {"full", "none", " full "}) {
    const CompressionSpec s = Parse(text);
    EXPECT_EQ(s.eviction.policy, EvictionPolicy::kNone);
    EXPECT_EQ(SpecString(s), "full");
  }
}

TEST(SpecStringTest, Errors) {
  ExpectError("", "empty");
  ExpectError("h2o:2", "keep 2 is outside (0, 1]");
  ExpectError("h2o:0", "keep 0 is outside (0, 1]");
  ExpectError("h2o:nan", "not a number");
  ExpectError("h2o@0", "budget 0 must be >= 1");
  ExpectError("h2o", "h2o needs an amount");
  ExpectError("h2o,seed=1:2", "h2o needs an amount");
  ExpectError("bogus:0.5", "unknown term 'bogus'");
  ExpectError("h2o:0.5,color=red", "unknown option 'color'");
  ExpectError("h2o:0.5,seed", "not key=value");
  ExpectError("snapkv:0.5,kernel=4", "kernel 4 must be odd");
  ExpectError("snapkv:0.5,pool=min", "pool 'min'");
  ExpectError("keyformer:0.5,tau=0", "tau 0 must be finite");
  ExpectError("h2o:0.5,recent=1.5", "recent 1.5 is outside [0, 1]");
  ExpectError("h2o:0.5,layer=2", "layer '2'");
  ExpectError("h2o:0.5,lb=4/x", "lb entry 'x'");
  ExpectError("think:1", "lambda 1 is outside [0, 1)");
  ExpectError("think:0.5,seed=1", "channel terms take no options");
  ExpectError("q3", "bits 3 is not 2, 4 or 8");
  ExpectError("q4g", "group '' is not an integer");
  ExpectError("q4g0", "group 0 must be >= 1");
  ExpectError("q8v", "value bits missing after 'v'");
  ExpectError("q8vg64", "value bits missing after 'v'");
  ExpectError("q8v3", "value bits 3 is not 2, 4 or 8");
  ExpectError("q8vx", "value bits");
  ExpectError("r=-1", "recent_tokens -1 must be >= 0");
  ExpectError("h2o:0.5+snapkv:0.5", "a second eviction term");
  ExpectError("think:0.5+l1:0.5", "a second key channel term");
  ExpectError("q4+q2", "a second quantization term");
  ExpectError("h2o:0.5++q4", "empty term");
  ExpectError("full+q4", "stand alone");
  ExpectError("none:0.5", "'none' takes no amount");
  // The message quotes the whole string and the term.
  ExpectError("h2o:0.5+q3", "spec \"h2o:0.5+q3\": term \"q3\"");
}

TEST(SpecStringTest, CanonicalFormRoundTrips) {
  for (const char* text :
       {"full", "h2o:0.5", "snapkv:0.25,kernel=5,pool=avg",
        "keyformer:0.5,tau=0.7,seed=3+think:0.5+q4", "streaming@64,sink=8",
        "knorm:0.333333333333+q2g16+r=0", "random:0.75,seed=42,layer=1",
        "h2o:0.5,recent=0,lb=1/2/3+vthink:0.25", "q8", "l1:0.5", "think:0.5+vthink:0.5",
        "kvzip:0.25,ada=0.2,stats=1,xlayer=1,passes=2057/1036",
        "kvzip:0.1,stats=1,passes=1033/1033/5,chunk=1024",
        "kvzip:0.1,ada=0,stats=1,xlayer=1,passes=1009,top=4", "q8v4", "h2o:0.5+q8v2g16+r=0",
        "q2v8"}) {
    const CompressionSpec s = Parse(text);
    EXPECT_EQ(SpecString(s), text);
    const CompressionSpec again = Parse(SpecString(s));
    EXPECT_EQ(SpecString(again), SpecString(s));
  }
  // Options at their defaults are omitted; terms come out in a fixed order.
  EXPECT_EQ(SpecString(Parse("q4+snapkv:0.5,kernel=7,pool=max,sink=4,tau=1,seed=0,layer=0")),
            "snapkv:0.5+q4");
  EXPECT_EQ(SpecString(Parse("q4v4g16")), "q4g16");
  CompressionSpec third;
  third.eviction.policy = EvictionPolicy::kH2O;
  third.eviction.keep_ratio = 1.0 / 3.0;
  EXPECT_EQ(Parse(SpecString(third)).eviction.keep_ratio, 1.0 / 3.0);
}

}  // namespace
}  // namespace kvc

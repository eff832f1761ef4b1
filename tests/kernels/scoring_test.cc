// ScoreTokens: against a naive double-precision reference, and the per-policy conventions
// (pooling, knorm sign, seeded noise).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <limits>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "cpu/engine.h"
#include "gtest/gtest.h"
#include "kernels/isa_util.h"
#include "kernels/select_util.h"
#include "kvc/noise.h"
#include "kvc/selection.h"

namespace kvc {
namespace {

using testing::RandomLayer;
using testing::ReferenceAttentionScores;
using testing::MakeLayer;
using testing::TestLayer;

// q_stats: kvzip's row log-masses ([Hq, W]; spec.query_stats set by the caller).
void ExpectNearReference(const TestLayer& layer, const EvictionSpec& spec,
                         const float* q_stats = nullptr) {
  LayerInput in = layer.input();
  in.q_stats = q_stats;
  absl::StatusOr<std::vector<float>> got = ScoreTokens(in, spec);
  ASSERT_TRUE(got.ok()) << got.status();
  const std::vector<double> want = ReferenceAttentionScores(layer, spec, q_stats);
  ASSERT_EQ(got->size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR((*got)[i], want[i], 2e-5 * layer.shape.obs_window + 1e-5 * want[i])
        << "index " << i << " policy " << PolicyName(spec.policy);
  }
}

TEST(ScoreTokensTest, H2OMatchesReferenceOverShapes) {
  struct Case {
    int hkv, g, S, D, W;
  };
  for (const Case& c : std::vector<Case>{
           {1, 1, 1, 8, 1}, {2, 4, 37, 16, 5}, {3, 2, 64, 64, 64}, {1, 8, 200, 128, 32}}) {
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      const LayerShape shape{c.hkv, c.hkv * c.g, c.S, c.D, c.W};
      EvictionSpec spec;
      spec.policy = EvictionPolicy::kH2O;
      ExpectNearReference(RandomLayer(shape, 11 + c.S, t), spec);
    }
  }
}

TEST(ScoreTokensTest, KeyformerMatchesReferenceIncludingNoiseAndTau) {
  const LayerShape shape{2, 4, 50, 32, 8};
  TestLayer layer = RandomLayer(shape, 3, DType::kF16);
  layer.layer_index = 5;  // the noise depends on the layer
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kKeyformer;
  spec.seed = 1234;
  spec.tau = 1.0;
  ExpectNearReference(layer, spec);
  spec.tau = 1.7;
  ExpectNearReference(layer, spec);
}

// kvzip: every row sees all S keys (the rows are reconstruction queries from after the context)
// and a key's score is the largest probability any row of the group gives it.
TEST(ScoreTokensTest, KVzipMatchesReferenceOverShapes) {
  struct Case {
    int hkv, g, S, D, W;
  };
  for (const Case& c : std::vector<Case>{
           {1, 1, 1, 8, 1}, {2, 4, 37, 16, 5}, {3, 3, 64, 64, 64}, {1, 2, 1500, 64, 1500},
           // more rows than tokens (the reconstruction prompt's own queries come first)
           {1, 1, 1, 8, 9}, {2, 3, 40, 64, 49}}) {
    for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
      const LayerShape shape{c.hkv, c.hkv * c.g, c.S, c.D, c.W};
      EvictionSpec spec;
      spec.policy = EvictionPolicy::kKVzip;
      ExpectNearReference(RandomLayer(shape, 5 + c.S, t), spec);
    }
  }
}

// kvzip's passes over S tokens in chunks of `chunk`, each with `extra` instruction rows: sets
// spec's pass_tokens and pass_rows, returns W.
int SetPasses(EvictionSpec* spec, int S, int chunk, int extra) {
  spec->pass_tokens = chunk;
  int W = 0;
  for (int lo = 0; lo < S; lo += chunk) {
    spec->pass_rows.push_back(std::min(chunk, S - lo) + extra);
    W += spec->pass_rows.back();
  }
  return W;
}

// kvzip against the reference on every dtype, without and with row log-masses (a fixed pattern
// of `lse_mod` values `lse_step` apart).
void ExpectKVzipNearReference(EvictionSpec spec, const LayerShape& shape, uint32_t seed,
                              float lse_step, int lse_mod) {
  std::vector<float> lse(static_cast<size_t>(shape.num_q_heads) * shape.obs_window);
  for (size_t i = 0; i < lse.size(); ++i) {
    lse[i] = -1.0f + lse_step * static_cast<float>(i % lse_mod);
  }
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(::testing::Message() << DTypeName(t));
    const TestLayer layer = RandomLayer(shape, seed, t);
    spec.query_stats = false;
    ExpectNearReference(layer, spec);
    spec.query_stats = true;
    ExpectNearReference(layer, spec, lse.data());
  }
}

// kvzip with reconstruction passes (KVzip's chunked reconstruction, normalised as KVzipPress
// does): a row of pass p sees the first sink_tokens keys and its pass's chunk only. Chunks
// smaller and larger than the engine's key pieces (1024), sinks inside the first chunk and beyond
// it, passes with instruction rows, with and without the rows' log-masses, every dtype.
TEST(ScoreTokensTest, KVzipPassesMatchReference) {
  struct Case {
    int hkv, g, S, D, chunk, extra, sinks;
  };
  for (const Case& c : std::vector<Case>{{1, 1, 10, 8, 4, 0, 2},
                                         {2, 3, 37, 16, 16, 3, 4},
                                         {1, 1, 1500, 16, 1100, 9, 4},
                                         {2, 2, 300, 64, 64, 5, 100},
                                         {1, 1, 5, 8, 5, 2, 4}}) {
    EvictionSpec spec;
    spec.policy = EvictionPolicy::kKVzip;
    spec.sink_tokens = c.sinks;
    const int W = SetPasses(&spec, c.S, c.chunk, c.extra);
    SCOPED_TRACE(::testing::Message() << "S " << c.S << " chunk " << c.chunk << " sinks "
                                      << c.sinks);
    ExpectKVzipNearReference(spec, LayerShape{c.hkv, c.hkv * c.g, c.S, c.D, W}, 3 + c.S, 0.29f,
                             17);
  }
}

// kvzip with top_rows: the mean of each token's K largest probabilities, against the reference
// over shapes, dtypes, passes (a sink token collects probabilities from every pass) and K past
// the number of rows that see a token (absent ones count zero).
TEST(ScoreTokensTest, KVzipTopRowsMatchReference) {
  struct Case {
    int hkv, g, S, D, W, chunk, top;
  };
  for (const Case& c : std::vector<Case>{{1, 1, 1, 8, 1, 0, 2},
                                         {2, 4, 37, 16, 5, 0, 4},
                                         {2, 3, 40, 64, 49, 0, 3},
                                         {1, 2, 1500, 64, 1509, 0, 8},
                                         {2, 3, 37, 16, 0, 16, 4},
                                         {1, 1, 1500, 16, 0, 1100, 64},
                                         {1, 1, 6, 8, 6, 0, 64}}) {
    EvictionSpec spec;
    spec.policy = EvictionPolicy::kKVzip;
    spec.top_rows = c.top;
    const int W = c.chunk > 0 ? SetPasses(&spec, c.S, c.chunk, 3) : c.W;
    SCOPED_TRACE(::testing::Message() << "S " << c.S << " W " << W << " top " << c.top);
    ExpectKVzipNearReference(spec, LayerShape{c.hkv, c.hkv * c.g, c.S, c.D, W}, 7 + c.S, 0.31f,
                             13);
  }
}

// By hand: two rows give key 0 probabilities 1 and 1/2 (and key 1 the other 1/2): the mean of
// the top 2 is 3/4 for key 0 and 1/4 for key 1; top 1 is KVzip's maximum (1 and 1/2); top 3
// divides by 3.
TEST(ScoreTokensTest, KVzipTopRowsAverageTheLargestByHand) {
  const int S = 2, D = 8, W = 2;
  const LayerShape shape{1, 1, S, D, W};
  std::vector<float> k(static_cast<size_t>(S) * D, 0.0f), v(k.size(), 1.0f);
  std::vector<float> q(static_cast<size_t>(W) * D, 0.0f);
  k[0] = 1.0f;     // key 0 along channel 0
  q[0] = 1000.0f;  // row 0 looks only at key 0; row 1 (all zeros) splits evenly
  const TestLayer layer = MakeLayer(shape, k, v, q);
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kKVzip;
  for (const auto& [top, want0, want1] :
       std::vector<std::tuple<int, double, double>>{{1, 1.0, 0.5}, {2, 0.75, 0.25},
                                                    {3, 0.5, 1.0 / 6}}) {
    spec.top_rows = top;
    absl::StatusOr<std::vector<float>> got = ScoreTokens(layer.input(), spec);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_NEAR((*got)[0], want0, 1e-6) << "top " << top;
    EXPECT_NEAR((*got)[1], want1, 1e-6) << "top " << top;
  }
}

// The same by hand: a row that looks hard at a key of another pass's chunk gives it nothing.
TEST(ScoreTokensTest, KVzipPassRowsSeeTheSinksAndTheirChunkOnly) {
  const int S = 8, D = 8, W = 8;
  const LayerShape shape{1, 1, S, D, W};
  std::vector<float> k(static_cast<size_t>(S) * D, 0.0f), v(k.size(), 1.0f);
  std::vector<float> q(static_cast<size_t>(W) * D, 0.0f);
  k[static_cast<size_t>(6) * D] = 1.0f;  // key 6, in the second pass's chunk [4, 8)
  q[0] = 40.0f;                          // row 0, of the first pass, looks at it
  const TestLayer layer = MakeLayer(shape, k, v, q);
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kKVzip;
  spec.sink_tokens = 1;
  spec.pass_tokens = 4;
  spec.pass_rows = {4, 4};
  absl::StatusOr<std::vector<float>> got = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(got.ok()) << got.status();
  // The first pass's rows see keys 0..3 (all logits 0): 1/4 each. The second pass's see the
  // sink, key 0, and keys 4..7 (all 0 for them): 1/5 each. Key 6 gets no more than that.
  for (int j = 0; j < 4; ++j) EXPECT_NEAR((*got)[j], 0.25, 1e-6) << j;
  for (int j = 4; j < S; ++j) EXPECT_NEAR((*got)[j], 0.2, 1e-6) << j;
  // Without passes row 0 sees key 6 and gives it almost all its mass.
  spec.pass_rows.clear();
  got = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_GT((*got)[6], 0.99);
}

// One pass over the whole context is the unchunked normalisation.
TEST(ScoreTokensTest, KVzipOnePassIsEveryRowOverAllKeys) {
  const LayerShape shape{2, 6, 900, 64, 909};
  const TestLayer layer = RandomLayer(shape, 12, DType::kF16);
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kKVzip;
  absl::StatusOr<std::vector<float>> all = ScoreTokens(layer.input(), spec);
  spec.pass_rows = {909};
  absl::StatusOr<std::vector<float>> one = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(all.ok() && one.ok());
  for (size_t i = 0; i < all->size(); ++i) {
    ASSERT_NEAR((*one)[i], (*all)[i], 1e-6 * (*all)[i] + 1e-9) << i;
  }
}

// What makes kvzip differ from h2o over the same queries: the first row sees the last key (h2o's
// first row sees only S - W + 1 keys), and a key one row attends to strongly keeps a high score
// however little the other rows give it (a maximum, not a mean).
TEST(ScoreTokensTest, KVzipRowsSeeEveryKeyAndTakeTheMaximum) {
  const int S = 16, D = 8, W = 4;
  const LayerShape shape{1, 1, S, D, W};
  std::vector<float> k(static_cast<size_t>(S) * D, 0.0f), v(k.size(), 1.0f);
  std::vector<float> q(static_cast<size_t>(W) * D, 0.0f);
  k[static_cast<size_t>(S - 1) * D] = 1.0f;  // the last key, along channel 0
  q[0] = 40.0f;                              // row 0 looks at it; the other rows look at nothing
  const TestLayer layer = MakeLayer(shape, k, v, q);
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kKVzip;
  absl::StatusOr<std::vector<float>> kvzip = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(kvzip.ok()) << kvzip.status();
  // exp(40 / sqrt(8)) / (exp(40 / sqrt(8)) + 15): row 0's probability of the last key.
  const double p = 1.0 / (1.0 + 15.0 * std::exp(-40.0 / std::sqrt(8.0)));
  EXPECT_NEAR((*kvzip)[S - 1], p, 1e-6);
  for (int j = 0; j + 1 < S; ++j) EXPECT_NEAR((*kvzip)[j], 1.0 / S, 1e-6) << j;  // uniform rows
  spec.policy = EvictionPolicy::kH2O;
  absl::StatusOr<std::vector<float>> h2o = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(h2o.ok()) << h2o.status();
  EXPECT_LT((*h2o)[S - 1], 0.5);  // only the last row sees it under the causal mask
  ExpectNearReference(layer, spec);
}

// kvzip with the rows' log-masses (q_stats [Hq, W]): each row's softmax denominator also holds
// exp(lse), the mass of the keys the upload does not hold; a very negative lse changes nothing.
TEST(ScoreTokensTest, KVzipRowLogMassJoinsTheDenominator) {
  const LayerShape shape{2, 6, 1300, 32, 40};  // two key chunks
  const TestLayer layer = RandomLayer(shape, 8, DType::kF32);
  std::vector<float> lse(static_cast<size_t>(shape.num_q_heads) * shape.obs_window);
  for (size_t i = 0; i < lse.size(); ++i) lse[i] = -2.0f + 0.37f * static_cast<float>(i % 23);
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kKVzip;
  spec.query_stats = true;
  LayerInput in = layer.input();
  in.q_stats = lse.data();
  const int S = shape.seq_len, D = shape.head_dim, W = shape.obs_window;
  const int g = shape.group_size();
  const auto* k = reinterpret_cast<const float*>(layer.k.data());  // f32 HND
  const auto* q = reinterpret_cast<const float*>(layer.q.data());
  std::vector<double> want(static_cast<size_t>(shape.num_kv_heads) * S, 0.0);
  std::vector<double> a(S);
  for (int qh = 0; qh < shape.num_q_heads; ++qh) {
    const int h = qh / g;
    for (int t = 0; t < W; ++t) {
      double den = std::exp(static_cast<double>(lse[static_cast<size_t>(qh) * W + t]));
      for (int j = 0; j < S; ++j) {
        double dot = 0;
        for (int c = 0; c < D; ++c) {
          dot += static_cast<double>(q[(static_cast<size_t>(qh) * W + t) * D + c]) *
                 k[(static_cast<size_t>(h) * S + j) * D + c];
        }
        a[j] = std::exp(dot / std::sqrt(static_cast<double>(D)));
        den += a[j];
      }
      for (int j = 0; j < S; ++j) {
        double& o = want[static_cast<size_t>(h) * S + j];
        o = std::max(o, a[j] / den);
      }
    }
  }
  for (CpuIsa isa : testing_isa::SupportedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    const testing_isa::ScopedIsaCap cap(isa);
    absl::StatusOr<std::vector<float>> got = ScoreTokens(in, spec);
    ASSERT_TRUE(got.ok()) << got.status();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_NEAR((*got)[i], want[i], 1e-5 + 1e-4 * want[i]) << "index " << i;
    }
  }
  // The log-mass matters: without it the same rows give larger probabilities.
  EvictionSpec plain = spec;
  plain.query_stats = false;
  absl::StatusOr<std::vector<float>> without = ScoreTokens(layer.input(), plain);
  ASSERT_TRUE(without.ok()) << without.status();
  double gap = 0;
  for (size_t i = 0; i < want.size(); ++i) gap = std::max(gap, (*without)[i] - want[i]);
  EXPECT_GT(gap, 1e-3);
  // Log-masses handed in without query_stats are not read (kvcd never forwards them then, and an
  // in-process caller must get the same scores).
  LayerInput ignored = in;  // q_stats = lse
  absl::StatusOr<std::vector<float>> unread = ScoreTokens(ignored, plain);
  ASSERT_TRUE(unread.ok()) << unread.status();
  EXPECT_EQ(*unread, *without);
  std::fill(lse.begin(), lse.end(), -1e30f);
  absl::StatusOr<std::vector<float>> tiny = ScoreTokens(in, spec);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR((*tiny)[i], (*without)[i], 1e-6);
  // Without the pointer the spec is refused, naming the input.
  in.q_stats = nullptr;
  EXPECT_THAT(std::string(ScoreTokens(in, spec).status().message()), ::testing::HasSubstr("q_stats"));
}

// Every instruction set this CPU has scores alike: several chunks, a causal staircase, noise; fp16
// layers (sgemm or AMX) and bf16 ones (at avx512bf16 and above, bf16 dot products).
TEST(ScoreTokensTest, EveryInstructionSetMatchesReference) {
  const LayerShape shape{2, 8, 2200, 64, 16};
  for (DType t : {DType::kF16, DType::kBF16}) {
    TestLayer layer = RandomLayer(shape, 9, t);
    layer.layer_index = 3;
    for (CpuIsa isa : testing_isa::SupportedIsas()) {
      SCOPED_TRACE(std::string(CpuIsaName(isa)) + " " + std::string(DTypeName(t)));
      const testing_isa::ScopedIsaCap cap(isa);
      for (EvictionPolicy policy :
           {EvictionPolicy::kH2O, EvictionPolicy::kKeyformer, EvictionPolicy::kKVzip}) {
        EvictionSpec spec;
        spec.policy = policy;
        spec.seed = 77;
        ExpectNearReference(layer, spec);
      }
    }
  }
}

// kvzip's passes on every instruction set this CPU has (sgemm, bf16 dot products, AMX).
TEST(ScoreTokensTest, KVzipPassesMatchReferenceOnEveryInstructionSet) {
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kKVzip;
  spec.pass_tokens = 1000;
  spec.pass_rows = {1009, 1009, 209};
  spec.query_stats = true;
  const LayerShape shape{1, 3, 2200, 64, 2227};
  std::vector<float> lse(static_cast<size_t>(shape.num_q_heads) * shape.obs_window);
  for (size_t i = 0; i < lse.size(); ++i) lse[i] = 0.5f - 0.13f * static_cast<float>(i % 29);
  for (DType t : {DType::kF16, DType::kBF16}) {
    const TestLayer layer = RandomLayer(shape, 31, t);
    const std::vector<double> want = ReferenceAttentionScores(layer, spec, lse.data());
    LayerInput in = layer.input();
    in.q_stats = lse.data();
    for (CpuIsa isa : testing_isa::SupportedIsas()) {
      SCOPED_TRACE(std::string(CpuIsaName(isa)) + " " + std::string(DTypeName(t)));
      const testing_isa::ScopedIsaCap cap(isa);
      absl::StatusOr<std::vector<float>> got = ScoreTokens(in, spec);
      ASSERT_TRUE(got.ok()) << got.status();
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_NEAR((*got)[i], want[i], 2e-5 + 1e-5 * want[i]) << i;
      }
    }
  }
}

// Kept sets a and b (head by head) are equal, or the tokens in one and not the other all have
// scores (b's, [H, S]) within rel_tol of each other: ties at the cut that float rounding broke
// differently.
void ExpectSameSelectionUpToTies(const std::vector<float>& scores, const LayerShape& shape,
                                 const TokenSelection& a, const TokenSelection& b,
                                 double rel_tol) {
  ASSERT_EQ(a.num_kv_heads, b.num_kv_heads);
  for (int h = 0; h < shape.num_kv_heads; ++h) {
    const std::vector<int32_t> pa = testing::HeadPositions(a, h), pb = testing::HeadPositions(b, h);
    ASSERT_EQ(pa.size(), pb.size()) << "head " << h;
    std::vector<int32_t> diff;
    std::set_symmetric_difference(pa.begin(), pa.end(), pb.begin(), pb.end(),
                                  std::back_inserter(diff));
    if (diff.empty()) continue;
    const float* s = scores.data() + static_cast<size_t>(h) * shape.seq_len;
    float lo = s[diff[0]], hi = s[diff[0]];
    for (int32_t t : diff) {
      lo = std::min(lo, s[t]);
      hi = std::max(hi, s[t]);
    }
    EXPECT_LE(hi - lo, 2 * rel_tol * std::max(std::abs(lo), std::abs(hi)))
        << "head " << h << ": " << diff.size() << " tokens differ, not at a tie";
  }
}

// Scores of a 4K-token layer of type t at instruction-set level `fast` (whose logits path must be
// `path`) against sgemm's (the portable level's): equal to float rounding (1e-5 relative), not
// bit-identical (else the path was not taken), and the kept sets at keep 0.25 the same, or
// different only between tokens whose sgemm scores tie to that rounding at the cut.
void ExpectSgemmSelections(DType t, CpuIsa fast, cpu::LogitsPath path) {
  const LayerShape shape{2, 8, 4100, 128, 32};
  TestLayer layer = RandomLayer(shape, 31, t);
  layer.layer_index = 7;
  for (EvictionPolicy policy : {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV,
                                EvictionPolicy::kKeyformer, EvictionPolicy::kKVzip}) {
    SCOPED_TRACE(PolicyName(policy));
    EvictionSpec spec;
    spec.policy = policy;
    spec.seed = 5;
    spec.keep_ratio = 0.25;
    CompressionSpec full;
    full.eviction = spec;
    absl::StatusOr<std::vector<float>> got, fp32;
    absl::StatusOr<TokenSelection> got_sel, fp32_sel;
    {
      const testing_isa::ScopedIsaCap cap(fast);
      ASSERT_EQ(cpu::ScoringLogitsPath(t, 128), path);
      got = ScoreTokens(layer.input(), spec);
      got_sel = SelectTokens(layer.input(), full);
    }
    {
      const testing_isa::ScopedIsaCap cap(CpuIsa::kPortable);
      ASSERT_EQ(cpu::ScoringLogitsPath(t, 128), cpu::LogitsPath::kSgemm);
      fp32 = ScoreTokens(layer.input(), spec);
      fp32_sel = SelectTokens(layer.input(), full);
    }
    ASSERT_TRUE(got.ok() && fp32.ok() && got_sel.ok() && fp32_sel.ok());
    ASSERT_EQ(got->size(), fp32->size());
    int differ = 0;
    for (size_t i = 0; i < got->size(); ++i) {
      ASSERT_NEAR((*got)[i], (*fp32)[i], 1e-5 * std::abs((*fp32)[i]) + 1e-9) << "index " << i;
      differ += (*got)[i] != (*fp32)[i];
    }
    EXPECT_GT(differ, 0) << "the two paths gave bit-identical scores: was " << LogitsPathName(path)
                         << " taken?";
    ExpectSameSelectionUpToTies(*fp32, shape, *got_sel, *fp32_sel, 1e-5);
  }
}

// On bf16 layers the bf16 dot-product path (cpu/amx_logits.h) computes exact products and differs
// from sgemm only in the order of fp32 additions.
TEST(ScoreTokensTest, Bf16DotProductsKeepTheSgemmSelections) {
  if (!testing_isa::Supported(CpuIsa::kAvx512Bf16)) {
    GTEST_SKIP() << "this CPU lacks avx512bf16 (it has " << CpuIsaName(DetectedCpuIsa()) << ": "
                 << CpuFeatureList() << ")";
  }
  ExpectSgemmSelections(DType::kBF16, CpuIsa::kAvx512Bf16, cpu::LogitsPath::kBf16Dot);
}

// fp16 layers from AVX2 up without AMX (and bf16 ones below AVX-512 BF16) take the fp32
// multiply-adds of cpu/f32_logits.h: the same exact fp32 operands as sgemm, summed in another
// order. Each kernel: AVX2, and AVX-512 where the CPU has it.
TEST(ScoreTokensTest, F32MultiplyAddsKeepTheSgemmSelections) {
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!testing_isa::Supported(isa)) {
      GTEST_SKIP() << "this CPU lacks " << CpuIsaName(isa) << " (it has "
                   << CpuIsaName(DetectedCpuIsa()) << ": " << CpuFeatureList() << ")";
    }
    for (DType t : {DType::kF16, DType::kBF16}) {
      SCOPED_TRACE(std::string(CpuIsaName(isa)) + " " + std::string(DTypeName(t)));
      ExpectSgemmSelections(t, isa, cpu::LogitsPath::kF32Fma);
    }
  }
}

// The body of IntegerScoringKeepsNearlyTheExactSelections at the current level; `coarse` is 2
// for the AVX2 kernel, whose query step is twice VNNI's, and widens the score and cut bounds as
// much.
void ExpectIntegerSelectionsNearExact(double coarse) {
  const LayerShape shape{2, 8, 4100, 128, 32};
  for (DType t : {DType::kF16, DType::kBF16}) {
    TestLayer layer = RandomLayer(shape, 31, t);
    layer.layer_index = 7;
    ASSERT_EQ(cpu::ScoringLogitsPath(t, 128, ScoringMath::kInteger), cpu::LogitsPath::kInt8Dot);
    for (EvictionPolicy policy : {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV,
                                  EvictionPolicy::kKeyformer, EvictionPolicy::kKVzip}) {
      SCOPED_TRACE(std::string(PolicyName(policy)) + " " + std::string(DTypeName(t)));
      EvictionSpec spec;
      spec.policy = policy;
      spec.seed = 5;
      spec.keep_ratio = 0.25;
      CompressionSpec full;
      full.eviction = spec;
      LayerInput in = layer.input();
      const absl::StatusOr<std::vector<float>> exact = ScoreTokens(in, spec);
      const absl::StatusOr<TokenSelection> exact_sel = SelectTokens(in, full);
      in.scoring_math = ScoringMath::kInteger;
      const absl::StatusOr<std::vector<float>> integer = ScoreTokens(in, spec);
      const absl::StatusOr<TokenSelection> integer_sel = SelectTokens(in, full);
      ASSERT_TRUE(exact.ok() && integer.ok() && exact_sel.ok() && integer_sel.ok());
      const int S = shape.seq_len;
      const bool amplified =
          policy == EvictionPolicy::kKeyformer || policy == EvictionPolicy::kKVzip;
      const double max_error = (amplified ? 0.25 : 0.02) * coarse;  // of the head's mean score
      int differ = 0;
      for (int h = 0; h < shape.num_kv_heads; ++h) {
        const float* e = exact->data() + static_cast<size_t>(h) * S;
        const float* g = integer->data() + static_cast<size_t>(h) * S;
        double mean = 0, worst = 0;
        for (int j = 0; j < S; ++j) mean += std::fabs(e[j]) / S;
        for (int j = 0; j < S; ++j) {
          worst = std::max(worst, std::fabs(g[j] - e[j]) / mean);
          differ += g[j] != e[j];
        }
        const std::vector<int32_t> pe = testing::HeadPositions(*exact_sel, h),
                                   pg = testing::HeadPositions(*integer_sel, h);
        ASSERT_EQ(pe.size(), pg.size()) << "head " << h;
        std::vector<int32_t> shared;
        std::set_intersection(pe.begin(), pe.end(), pg.begin(), pg.end(),
                              std::back_inserter(shared));
        const double overlap = static_cast<double>(shared.size()) / pe.size();
        // The tokens one side alone keeps sit at the cut: their exact scores span little.
        std::vector<int32_t> diff;
        std::set_symmetric_difference(pe.begin(), pe.end(), pg.begin(), pg.end(),
                                      std::back_inserter(diff));
        float lo = std::numeric_limits<float>::infinity(), hi = -lo;
        for (int32_t p : diff) {
          lo = std::min(lo, e[p]);
          hi = std::max(hi, e[p]);
        }
        const double spread = diff.empty() ? 0.0 : (hi - lo) / mean;
        // Measured on VNNI: worst 0.005-0.007 (h2o, snapkv), 0.06-0.16 (keyformer, whose noise
        // scales a token's logit error, and kvzip, a maximum); overlap 0.98-1.00; spread <=
        // 0.031. On AVX2: worst 0.009-0.013 and 0.15-0.26, overlap 0.98-1.00, spread <= 0.068.
        EXPECT_LE(worst, max_error) << "head " << h;
        EXPECT_GE(overlap, 0.97) << "head " << h;
        EXPECT_LE(spread, 0.05 * coarse) << "head " << h << ": " << diff.size() << " tokens differ";
      }
      EXPECT_GT(differ, 0) << "the two modes gave bit-identical scores: was the int8 path taken?";
    }
  }
}

// ScoringMath::kInteger (int8 logits, cpu/int8_logits.h) against the exact path at the same
// instruction-set level, for each int8 kernel (avx2: 7-bit queries; avx512vnni: 8-bit): every
// score within a few percent of the exact one (relative to the head's mean score; a quarter for
// keyformer and kvzip), and the kept sets of a 4K-token layer at keep 0.25 nearly the same: at
// least 97% of each head's kept tokens shared, and the tokens kept on one side only within 5% of
// the mean score of each other by the exact scores (near-ties at the cut that the rounding broke
// differently). Below avx2 the integer mode takes the exact path (the same scores, bit for bit).
TEST(ScoreTokensTest, IntegerScoringKeepsNearlyTheExactSelections) {
  for (CpuIsa level : {CpuIsa::kAvx2, CpuIsa::kAvx512Vnni}) {
    SCOPED_TRACE(std::string(CpuIsaName(level)));
    if (!testing_isa::Supported(level)) {
      std::printf("[  SKIPPED ] level %s: this CPU lacks it (it has %s: %s)\n",
                  std::string(CpuIsaName(level)).c_str(),
                  std::string(CpuIsaName(DetectedCpuIsa())).c_str(), CpuFeatureList().c_str());
      continue;
    }
    // The level itself: below AMX, which kInteger leaves to its tiles.
    const testing_isa::ScopedIsaCap cap(level);
    ExpectIntegerSelectionsNearExact(level == CpuIsa::kAvx2 ? 2.0 : 1.0);
  }
  if (!testing_isa::Supported(CpuIsa::kAvx2)) GTEST_SKIP() << "no int8 kernel on this CPU";
  const testing_isa::ScopedIsaCap below(CpuIsa::kPortable);
  const TestLayer layer = RandomLayer(LayerShape{1, 4, 1500, 64, 16}, 3, DType::kF16);
  EXPECT_EQ(cpu::ScoringLogitsPath(DType::kF16, 64, ScoringMath::kInteger),
            cpu::ScoringLogitsPath(DType::kF16, 64, ScoringMath::kExact));
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kSnapKV;
  LayerInput in = layer.input();
  const absl::StatusOr<std::vector<float>> exact = ScoreTokens(in, spec);
  in.scoring_math = ScoringMath::kInteger;
  const absl::StatusOr<std::vector<float>> integer = ScoreTokens(in, spec);
  ASSERT_TRUE(exact.ok() && integer.ok());
  EXPECT_EQ(*exact, *integer);
}

// Keys are scored in chunks of 1024 with a running (online) softmax max per row: a logit ramp
// that rises over the positions raises the max in every chunk (rescaling the partial sums), one
// that falls keeps the first chunk's max; both must match the one-shot reference.
TEST(ScoreTokensTest, MultiChunkRowsMatchReferenceWhateverChunkHoldsTheMax) {
  const LayerShape shape{1, 2, 2600, 8, 4};
  for (float slope : {1.0f / 150, -1.0f / 150}) {
    std::vector<float> k = testing::RandomValues(2600 * 8, 21);
    std::vector<float> q = testing::RandomValues(2 * 4 * 8, 22);
    for (int s = 0; s < 2600; ++s) k[s * 8] = slope * static_cast<float>(s - 1300);
    for (int r = 0; r < 8; ++r) q[r * 8] = 1.0f;  // every query row follows the ramp
    TestLayer layer = testing::MakeLayer(shape, k, k, q, DType::kF16);
    layer.layer_index = 2;
    for (EvictionPolicy policy :
         {EvictionPolicy::kH2O, EvictionPolicy::kKeyformer, EvictionPolicy::kKVzip}) {
      for (double tau : {1.0, 0.5}) {
        EvictionSpec spec;
        spec.policy = policy;
        spec.seed = 5;
        spec.tau = tau;
        ExpectNearReference(layer, spec);
      }
    }
  }
}

TEST(ScoreTokensTest, SnapKVPoolsThePrefixOnly) {
  const LayerShape shape{1, 2, 40, 16, 6};
  const TestLayer layer = RandomLayer(shape, 8);
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kSnapKV;
  spec.pool_kernel = 5;
  const std::vector<double> raw = ReferenceAttentionScores(layer, spec);
  for (PoolKind kind : {PoolKind::kMax, PoolKind::kAvg}) {
    spec.pool = kind;
    absl::StatusOr<std::vector<float>> got = ScoreTokens(layer.input(), spec);
    ASSERT_TRUE(got.ok());
    const int prefix = shape.seq_len - shape.obs_window;
    for (int j = 0; j < shape.seq_len; ++j) {
      double want = raw[j];
      if (j < prefix) {  // window clipped to [0, prefix)
        const int lo = std::max(0, j - 2), hi = std::min(prefix - 1, j + 2);
        double acc = kind == PoolKind::kMax ? -1.0 : 0.0;
        for (int i = lo; i <= hi; ++i)
          acc = kind == PoolKind::kMax ? std::max(acc, raw[i]) : acc + raw[i];
        want = kind == PoolKind::kMax ? acc : acc / (hi - lo + 1);
      }
      EXPECT_NEAR((*got)[j], want, 1e-5) << j;
    }
  }
}

TEST(ScoreTokensTest, KNormIsNegativeL2Norm) {
  const LayerShape shape{2, 2, 9, 8, 0};
  std::vector<float> k(2 * 9 * 8, 0.0f);
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 9; ++s) k[(h * 9 + s) * 8 + (s % 8)] = static_cast<float>(s + h);
  }
  const TestLayer layer = testing::MakeLayer(shape, k, k, {});
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kKNorm;
  absl::StatusOr<std::vector<float>> got = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(got.ok());
  for (int h = 0; h < 2; ++h) {
    for (int s = 0; s < 9; ++s) EXPECT_FLOAT_EQ((*got)[h * 9 + s], -static_cast<float>(s + h));
  }
}

TEST(ScoreTokensTest, RandomIsSeededCounterNoise) {
  const LayerShape shape{2, 2, 16, 8, 0};
  TestLayer layer = RandomLayer(shape, 1);
  layer.layer_index = 3;
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kRandom;
  spec.seed = 99;
  absl::StatusOr<std::vector<float>> got = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(got.ok());
  for (int h = 0; h < 2; ++h) {
    for (int j = 0; j < 16; ++j) EXPECT_EQ((*got)[h * 16 + j], CounterUniform(99, 3, h, 0, j));
  }
}

TEST(ScoreTokensTest, StreamingAndNoneScoreZeroAndBadInputIsRejected) {
  const TestLayer layer = RandomLayer({1, 1, 10, 8, 2}, 1);
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kStreaming;
  absl::StatusOr<std::vector<float>> got = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(got.ok());
  EXPECT_THAT(*got, ::testing::Each(0.0f));
  spec.policy = EvictionPolicy::kH2O;
  spec.tau = -1;
  EXPECT_THAT(std::string(ScoreTokens(layer.input(), spec).status().message()),
              ::testing::HasSubstr("eviction.tau"));
  LayerInput in = layer.input();
  in.k = nullptr;
  EXPECT_EQ(ScoreTokens(in, EvictionSpec()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ScoreTokensTest, LargeWindowUsesRowBlocksCorrectly) {
  // S * rows above the logits block size (4M floats) forces several row blocks.
  const LayerShape shape{1, 2, 2100, 8, 1100};
  const TestLayer layer = RandomLayer(shape, 5);
  EvictionSpec spec;
  spec.policy = EvictionPolicy::kH2O;
  absl::StatusOr<std::vector<float>> got = ScoreTokens(layer.input(), spec);
  ASSERT_TRUE(got.ok());
  // Every softmax row sums to 1 and scores are averaged over g: the total is W.
  double total = 0;
  for (float x : *got) total += x;
  EXPECT_NEAR(total, 1100.0, 1e-2);
  // Spot-check a few positions against the reference (full reference would be slow here).
  const std::vector<double> want = ReferenceAttentionScores(layer, spec);
  for (int j : {0, 500, 999, 1000, 1500, 2099}) EXPECT_NEAR((*got)[j], want[j], 1e-4) << j;
}

}  // namespace
}  // namespace kvc

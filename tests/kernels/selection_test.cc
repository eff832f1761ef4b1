// SelectTokens: one hand-computable case per policy, then properties over random shapes.
#include "kvc/selection.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/select_util.h"

namespace kvc {
namespace {

using ::testing::ElementsAre;
using testing::HeadPositions;
using testing::MakeLayer;
using testing::RandomLayer;
using testing::TestLayer;

constexpr float kSqrt8 = 2.8284271247461903f;

// One KV head, one query head, D = 8, observation window W. Keys are zero except `spikes`: key j
// is sqrt(8) * logit_j on channel 0, and every query row is e_0, so a_tj = logit_j exactly.
TestLayer SpikeLayer(int S, int W, const std::vector<std::pair<int, float>>& spikes,
                     int num_q_heads = 1) {
  const LayerShape shape{1, num_q_heads, S, 8, W};
  std::vector<float> k(S * 8, 0.0f), q(num_q_heads * W * 8, 0.0f);
  for (auto [j, logit] : spikes) k[j * 8] = kSqrt8 * logit;
  for (int r = 0; r < num_q_heads * W; ++r) q[r * 8] = 1.0f;
  return MakeLayer(shape, k, k, q);
}

TokenSelection Select(const TestLayer& layer, const CompressionSpec& spec) {
  absl::StatusOr<TokenSelection> sel = SelectTokens(layer.input(), spec);
  EXPECT_TRUE(sel.ok()) << sel.status();
  return sel.ok() ? *sel : TokenSelection();
}

CompressionSpec Policy(EvictionPolicy p, int budget) {
  CompressionSpec s;
  s.eviction.policy = p;
  s.eviction.budget = budget;
  return s;
}

TEST(SelectTokensTest, NoneKeepsEverything) {
  const TestLayer layer = SpikeLayer(5, 1, {});
  const TokenSelection sel = Select(layer, Policy(EvictionPolicy::kNone, 0));
  EXPECT_EQ(sel.budget, 5);
  EXPECT_THAT(HeadPositions(sel, 0), ElementsAre(0, 1, 2, 3, 4));
}

TEST(SelectTokensTest, StreamingKeepsSinksAndRecent) {
  const TestLayer layer = SpikeLayer(20, 0, {});
  // 4 sinks + the most recent 3.
  EXPECT_THAT(HeadPositions(Select(layer, Policy(EvictionPolicy::kStreaming, 7)), 0),
              ElementsAre(0, 1, 2, 3, 17, 18, 19));
  // Budget below the sink count: just the first B.
  EXPECT_THAT(HeadPositions(Select(layer, Policy(EvictionPolicy::kStreaming, 3)), 0),
              ElementsAre(0, 1, 2));
  CompressionSpec s = Policy(EvictionPolicy::kStreaming, 5);
  s.eviction.sink_tokens = 1;
  EXPECT_THAT(HeadPositions(Select(layer, s), 0), ElementsAre(0, 16, 17, 18, 19));
}

TEST(SelectTokensTest, H2OKeepsRecentHalfThenHeavyHitters) {
  // S = 10, W = 1: the single query (position 9) sees every key. Keys 2 and 5 have logits 6 and 4,
  // the rest 0, so the attention mass ranks 2 > 5 > everything else. B = 4: recent floor(4 * 0.5)
  // = 2 tokens (8, 9), then the two heavy hitters.
  const TestLayer layer = SpikeLayer(10, 1, {{2, 6.0f}, {5, 4.0f}});
  EXPECT_THAT(HeadPositions(Select(layer, Policy(EvictionPolicy::kH2O, 4)), 0),
              ElementsAre(2, 5, 8, 9));
  // B = 3: recent floor(1.5) = 1 token (9), then 2 and 5.
  EXPECT_THAT(HeadPositions(Select(layer, Policy(EvictionPolicy::kH2O, 3)), 0),
              ElementsAre(2, 5, 9));
  // recent_fraction 0: pure heavy hitters; the three zero-logit ties go to the lowest position.
  CompressionSpec s = Policy(EvictionPolicy::kH2O, 3);
  s.eviction.recent_fraction = 0.0;
  EXPECT_THAT(HeadPositions(Select(layer, s), 0), ElementsAre(0, 2, 5));
}

TEST(SelectTokensTest, H2OIsCausal) {
  // W = 2: rows at positions 4 and 5 of S = 6. Key 1 has logit 3, key 5 logit 4; only row 1
  // sees key 5. Causal: key 1 = 0.834 (row 0) + 0.256 (row 1) = 1.09 beats key 5 = 0.695.
  // Were the mask ignored, both rows would give key 5 0.695 and key 1 0.256: key 5 would win.
  const TestLayer layer = SpikeLayer(6, 2, {{1, 3.0f}, {5, 4.0f}});
  CompressionSpec s = Policy(EvictionPolicy::kH2O, 1);
  s.eviction.recent_fraction = 0.0;
  absl::StatusOr<std::vector<float>> scores = ScoreTokens(layer.input(), s.eviction);
  ASSERT_TRUE(scores.ok());
  const double row0_key1 = std::exp(3.0) / (std::exp(3.0) + 4.0);  // keys 0..4
  const double denom1 = std::exp(3.0) + std::exp(4.0) + 4.0;       // keys 0..5
  EXPECT_NEAR((*scores)[1], row0_key1 + std::exp(3.0) / denom1, 1e-5);
  EXPECT_NEAR((*scores)[5], std::exp(4.0) / denom1, 1e-5);
  EXPECT_THAT(HeadPositions(Select(layer, s), 0), ElementsAre(1));
}

TEST(SelectTokensTest, SnapKVKeepsWindowAndPooledNeighbourhood) {
  // S = 16, W = 2: window = 14, 15. One spike at 5; max-pool kernel 7 over the prefix [0, 14)
  // gives positions 2..8 the spike's score; B = 5 keeps the window plus the 3 lowest of those
  // ties: 2, 3, 4. Unpooled (kernel 1) the spike itself and the lowest zero-logit keys win.
  const TestLayer layer = SpikeLayer(16, 2, {{5, 8.0f}});
  CompressionSpec s = Policy(EvictionPolicy::kSnapKV, 5);
  EXPECT_THAT(HeadPositions(Select(layer, s), 0), ElementsAre(2, 3, 4, 14, 15));
  s.eviction.pool_kernel = 1;
  EXPECT_THAT(HeadPositions(Select(layer, s), 0), ElementsAre(0, 1, 5, 14, 15));
  // Avg pool, kernel 3: 4, 5, 6 share the spike (each (spike + 2 base) / 3, more than any other).
  s.eviction.pool_kernel = 3;
  s.eviction.pool = PoolKind::kAvg;
  EXPECT_THAT(HeadPositions(Select(layer, s), 0), ElementsAre(4, 5, 6, 14, 15));
  // B < W keeps only the most recent B window tokens.
  s.eviction.budget = 1;
  EXPECT_THAT(HeadPositions(Select(layer, s), 0), ElementsAre(15));
}

TEST(SelectTokensTest, KeyformerKeepsRecentThenSpikesDespiteNoise) {
  // Logit gaps of 50+ dwarf Gumbel noise (which lies in [-2.8, 17.4] for 24-bit uniforms), so
  // the three spikes win for any seed. B = 4: recent int(0.3 * 4) = 1 (position 9).
  const TestLayer layer = SpikeLayer(10, 1, {{1, 50.0f}, {3, 60.0f}, {6, 70.0f}});
  for (uint64_t seed : {0u, 1u, 77u}) {
    CompressionSpec s = Policy(EvictionPolicy::kKeyformer, 4);
    s.eviction.seed = seed;
    EXPECT_THAT(HeadPositions(Select(layer, s), 0), ElementsAre(1, 3, 6, 9));
  }
}

TEST(SelectTokensTest, KeyformerSeedDecidesNearTies) {
  // All logits 0: the selection is decided by the noise alone.
  const TestLayer layer = SpikeLayer(64, 4, {});
  CompressionSpec s = Policy(EvictionPolicy::kKeyformer, 16);
  s.eviction.seed = 1;
  const TokenSelection a = Select(layer, s);
  const TokenSelection a2 = Select(layer, s);
  s.eviction.seed = 2;
  const TokenSelection b = Select(layer, s);
  EXPECT_EQ(a.positions, a2.positions);
  EXPECT_NE(a.positions, b.positions);
}

TEST(SelectTokensTest, KNormKeepsLowestNormKeys) {
  // Norms 5 1 4 2 8 3 7 6 (one channel each): B = 3 keeps 1, 3, 5. No protected tokens.
  const float norms[8] = {5, 1, 4, 2, 8, 3, 7, 6};
  std::vector<float> k(8 * 8, 0.0f);
  for (int j = 0; j < 8; ++j) k[j * 8 + 3] = -norms[j];  // sign must not matter
  const TestLayer layer = MakeLayer({1, 1, 8, 8, 0}, k, k, {});
  EXPECT_THAT(HeadPositions(Select(layer, Policy(EvictionPolicy::kKNorm, 3)), 0),
              ElementsAre(1, 3, 5));
}

TEST(SelectTokensTest, RandomIsSeeded) {
  const TestLayer layer = RandomLayer({2, 2, 64, 8, 0}, 1);
  CompressionSpec s = Policy(EvictionPolicy::kRandom, 8);
  s.eviction.seed = 5;
  const TokenSelection a = Select(layer, s), a2 = Select(layer, s);
  s.eviction.seed = 6;
  const TokenSelection b = Select(layer, s);
  EXPECT_EQ(a.positions, a2.positions);
  EXPECT_NE(a.positions, b.positions);
  EXPECT_NE(HeadPositions(a, 0), HeadPositions(a, 1));  // heads draw independently
}

TEST(SelectTokensTest, GqaAveragesOverTheGroup) {
  // One KV head, two query heads, W = 1 at position 5. Keys 1, 2, 4 sit on channels 0, 1, 2
  // (scaled by sqrt(8) so logits equal query entries). Head 0: logits 10 (key 1), 9.5 (key 2) ->
  // p1 = 0.62, p2 = 0.38. Head 1: 10 (key 2), 9.8 (key 4) -> p2 = 0.55, p4 = 0.45.
  // Mean: key 2 = 0.465 > key 1 = 0.311: keep 2. Head 0 alone (or a max over heads) keeps 1.
  std::vector<float> k(6 * 8, 0.0f);
  k[1 * 8 + 0] = kSqrt8;
  k[2 * 8 + 1] = kSqrt8;
  k[4 * 8 + 2] = kSqrt8;
  std::vector<float> q(2 * 8, 0.0f);
  q[0] = 10.0f;
  q[1] = 9.5f;
  q[8 + 1] = 10.0f;
  q[8 + 2] = 9.8f;
  CompressionSpec s = Policy(EvictionPolicy::kH2O, 1);
  s.eviction.recent_fraction = 0.0;
  const TestLayer group = MakeLayer({1, 2, 6, 8, 1}, k, k, q);
  EXPECT_THAT(HeadPositions(Select(group, s), 0), ElementsAre(2));
  const TestLayer head0 =
      MakeLayer({1, 1, 6, 8, 1}, k, k, std::vector<float>(q.begin(), q.begin() + 8));
  EXPECT_THAT(HeadPositions(Select(head0, s), 0), ElementsAre(1));
}

TEST(SelectTokensTest, PerLayerGranularitySharesOneSetFromSummedScores) {
  // Two KV heads (one query head each), S = 6, W = 1. Head 0 puts ~all mass on key 1; head 1
  // splits 0.6 / 0.4 between keys 3 and 1. Per head (B = 1): {1}, {3}. Per layer: key 1 sums
  // to ~1.4 and wins for both heads.
  std::vector<float> k(2 * 6 * 8, 0.0f), q(2 * 8, 0.0f);
  k[(0 * 6 + 1) * 8 + 0] = kSqrt8 * 20.0f;
  k[(1 * 6 + 3) * 8 + 0] = kSqrt8 * 10.0f;
  k[(1 * 6 + 1) * 8 + 0] = kSqrt8 * (10.0f - std::log(1.5f));
  q[0] = 1.0f;
  q[8] = 1.0f;
  const TestLayer layer = MakeLayer({2, 2, 6, 8, 1}, k, k, q);
  CompressionSpec s = Policy(EvictionPolicy::kH2O, 1);
  s.eviction.recent_fraction = 0.0;
  TokenSelection per_head = Select(layer, s);
  EXPECT_THAT(HeadPositions(per_head, 0), ElementsAre(1));
  EXPECT_THAT(HeadPositions(per_head, 1), ElementsAre(3));
  s.eviction.granularity = Granularity::kPerLayer;
  TokenSelection per_layer = Select(layer, s);
  EXPECT_THAT(HeadPositions(per_layer, 0), ElementsAre(1));
  EXPECT_THAT(HeadPositions(per_layer, 1), ElementsAre(1));
}

TEST(SelectTokensTest, PerLayerBudgetsOverride) {
  TestLayer layer = RandomLayer({2, 4, 50, 16, 4}, 3);
  CompressionSpec s = Policy(EvictionPolicy::kH2O, 10);
  s.eviction.layer_budgets = {0, 3, 50};
  for (auto [layer_index, want] :
       std::vector<std::pair<int, int>>{{0, 10}, {1, 3}, {2, 50}, {3, 10}}) {
    layer.layer_index = layer_index;
    const TokenSelection sel = Select(layer, s);
    EXPECT_EQ(sel.budget, want) << layer_index;
    EXPECT_EQ(sel.positions.size(), static_cast<size_t>(2 * want));
  }
}

TEST(SelectTokensTest, RejectsInvalidSpecNamingTheField) {
  const TestLayer layer = RandomLayer({1, 1, 10, 8, 0}, 3);
  CompressionSpec s = Policy(EvictionPolicy::kSnapKV, 4);
  absl::StatusOr<TokenSelection> sel = SelectTokens(layer.input(), s);
  EXPECT_EQ(sel.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(sel.status().message()), ::testing::HasSubstr("eviction.policy"));
  s = Policy(EvictionPolicy::kStreaming, 11);
  EXPECT_THAT(std::string(SelectTokens(layer.input(), s).status().message()),
              ::testing::HasSubstr("eviction.budget"));
}

// Properties over random shapes, dtypes, layouts and group sizes, for every policy.
TEST(SelectTokensTest, PropertiesOverRandomShapes) {
  const EvictionPolicy policies[] = {EvictionPolicy::kNone,      EvictionPolicy::kStreaming,
                                     EvictionPolicy::kH2O,       EvictionPolicy::kSnapKV,
                                     EvictionPolicy::kKeyformer, EvictionPolicy::kKNorm,
                                     EvictionPolicy::kRandom};
  int case_id = 0;
  for (int S : {1, 7, 64, 301}) {
    for (int g : {1, 4}) {
      const int hkv = 1 + case_id % 3;
      const int D = case_id % 2 ? 64 : 8;
      const int W = std::min(S, 1 + case_id % 9);
      const DType dt = static_cast<DType>(case_id % 3);
      const Layout lay = static_cast<Layout>(case_id % 2);
      ++case_id;
      const TestLayer layer = RandomLayer({hkv, hkv * g, S, D, W}, case_id, dt, lay);
      for (EvictionPolicy p : policies) {
        for (double ratio : {0.3, 1.0}) {
          CompressionSpec s;
          s.eviction.policy = p;
          s.eviction.keep_ratio = ratio;
          s.eviction.seed = case_id;
          const TokenSelection sel = Select(layer, s);
          const int B = p == EvictionPolicy::kNone
                            ? S
                            : std::max(1, static_cast<int>(std::lround(ratio * S)));
          ASSERT_EQ(sel.budget, B) << PolicyName(p) << " S=" << S;
          ASSERT_EQ(sel.positions.size(), static_cast<size_t>(hkv) * B);
          for (int h = 0; h < hkv; ++h) {
            const std::vector<int32_t> pos = HeadPositions(sel, h);
            for (int i = 0; i < B; ++i) {
              ASSERT_GE(pos[i], 0);
              ASSERT_LT(pos[i], S);
              if (i > 0) {
                ASSERT_LT(pos[i - 1], pos[i]) << "sorted and unique";
              }
            }
            if (ratio == 1.0) {
              ASSERT_EQ(pos.back(), S - 1) << "keep ratio 1 keeps all";
            }
            const std::set<int32_t> kept(pos.begin(), pos.end());
            auto keeps_last = [&](int n) {
              for (int j = S - n; j < S; ++j) {
                if (!kept.count(j)) return false;
              }
              return true;
            };
            if (p == EvictionPolicy::kStreaming) {
              for (int j = 0; j < std::min(4, B); ++j) ASSERT_TRUE(kept.count(j)) << "sink " << j;
              ASSERT_TRUE(keeps_last(std::max(0, B - 4)));
            }
            if (p == EvictionPolicy::kH2O) {
              ASSERT_TRUE(keeps_last(B / 2));
            }
            if (p == EvictionPolicy::kKeyformer) {
              ASSERT_TRUE(keeps_last(static_cast<int>(0.3 * B)));
            }
            if (p == EvictionPolicy::kSnapKV) {
              ASSERT_TRUE(keeps_last(std::min(W, B)));
            }
          }
        }
      }
    }
  }
}

TEST(SelectTokensTest, HndAndNhdGiveIdenticalSelections) {
  const LayerShape shape{3, 12, 97, 32, 9};
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    const TestLayer hnd = RandomLayer(shape, 21, dt, Layout::kHND);
    const TestLayer nhd = RandomLayer(shape, 21, dt, Layout::kNHD);
    for (EvictionPolicy p : {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV,
                             EvictionPolicy::kKeyformer, EvictionPolicy::kKNorm}) {
      CompressionSpec s = Policy(p, 30);
      s.eviction.seed = 4;
      EXPECT_EQ(Select(hnd, s).positions, Select(nhd, s).positions) << PolicyName(p);
    }
  }
}

}  // namespace
}  // namespace kvc

// AllocateAcrossLayers (kvc/layer_budget.h) against a plain reference that ranks every candidate
// of every layer and head in one sorted list, and the CPU backend's selection with the counts.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/select_util.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/layer_budget.h"
#include "kvc/selection.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

// The reference: per (layer, head) its protected tokens and its own top floor(alpha * B) by raw
// score; every other candidate of every layer in one list ordered by (comparable score desc,
// NaN last, layer, head, position); the first `extra` of it are kept.
std::vector<std::vector<int32_t>> Reference(const EvictionSpec& e, const LayerShape& shape,
                                            const std::vector<std::vector<float>>& scores) {
  const int L = static_cast<int>(scores.size()), H = shape.num_kv_heads, S = shape.seq_len;
  std::vector<std::vector<int32_t>> counts(L, std::vector<int32_t>(H, 0));
  struct Cand {
    float s;
    int l, h, j;
  };
  std::vector<Cand> rest;
  int64_t extra = 0;
  for (int l = 0; l < L; ++l) {
    const int B = EffectiveBudget(e, l, S);
    const ProtectedTokens p = ProtectedFor(e, shape, B);
    const int prot = p.sinks + p.recent;
    int own = static_cast<int>(std::floor(e.adaptive_floor * B));
    if (prot == 0) own = std::max(own, 1);
    own = std::min(std::max(own, 0), B - prot);
    extra += static_cast<int64_t>(H) * (B - prot - own);
    std::vector<float> norm(static_cast<size_t>(H) * S);
    CrossHeadScores(scores[l].data(), H, S, e.policy, norm.data());
    for (int h = 0; h < H; ++h) {
      const float* raw = scores[l].data() + static_cast<size_t>(h) * S;
      std::vector<int> cand;
      for (int j = p.sinks; j < S - p.recent; ++j) cand.push_back(j);
      std::sort(cand.begin(), cand.end(), [raw](int a, int b) {
        const bool na = std::isnan(raw[a]), nb = std::isnan(raw[b]);
        if (na != nb) return nb;
        if (!na && raw[a] != raw[b]) return raw[a] > raw[b];
        return a < b;
      });
      counts[l][h] = prot + own;
      for (size_t i = own; i < cand.size(); ++i) {
        rest.push_back({norm[static_cast<size_t>(h) * S + cand[i]], l, h, cand[i]});
      }
    }
  }
  std::sort(rest.begin(), rest.end(), [](const Cand& a, const Cand& b) {
    const bool na = std::isnan(a.s), nb = std::isnan(b.s);
    if (na != nb) return nb;
    if (!na && a.s != b.s) return a.s > b.s;
    return std::tie(a.l, a.h, a.j) < std::tie(b.l, b.h, b.j);
  });
  for (int64_t i = 0; i < std::min<int64_t>(extra, static_cast<int64_t>(rest.size())); ++i) {
    ++counts[rest[i].l][rest[i].h];
  }
  return counts;
}

std::vector<std::vector<float>> RandomScores(int L, int H, int S, uint64_t seed, int levels) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> out(L, std::vector<float>(static_cast<size_t>(H) * S));
  for (int l = 0; l < L; ++l) {
    // Layers of different spread, so the allocation has somewhere to move tokens.
    const float scale = 1.0f + static_cast<float>(l);
    for (float& x : out[l]) {
      // A few levels only: many ties, which the order must break the same way.
      x = scale * static_cast<float>(rng() % static_cast<uint64_t>(levels)) / levels;
    }
  }
  return out;
}

std::vector<const std::vector<float>*> Pointers(const std::vector<std::vector<float>>& v) {
  std::vector<const std::vector<float>*> out;
  for (const auto& x : v) out.push_back(&x);
  return out;
}

TEST(LayerBudgetTest, MatchesTheReferenceForEveryProtectedWindowAndFloor) {
  const LayerShape shape{3, 6, 50, 8, 10};
  const int L = 4;
  for (EvictionPolicy policy : {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV,
                                EvictionPolicy::kKVzip, EvictionPolicy::kKNorm,
                                EvictionPolicy::kKeyDiff}) {
    for (double floor : {0.0, 0.2, 1.0}) {
      for (int budget : {1, 7, 25, 50}) {
        for (int levels : {5, 1000}) {
          SCOPED_TRACE(::testing::Message() << PolicyName(policy) << " floor " << floor << " budget "
                                          << budget << " levels " << levels);
          EvictionSpec e;
          e.policy = policy;
          e.budget = budget;
          e.adaptive = true;
          e.adaptive_floor = floor;
          e.layer_adaptive = true;
          const auto scores = RandomScores(L, shape.num_kv_heads, shape.seq_len, 3 + budget,
                                           levels);
          auto got = AllocateAcrossLayers(e, shape, Pointers(scores));
          ASSERT_TRUE(got.ok()) << got.status();
          EXPECT_EQ(*got, Reference(e, shape, scores));
          int total = 0;
          for (const auto& layer : *got) {
            for (int32_t c : layer) {
              EXPECT_GE(c, 1);
              EXPECT_LE(c, shape.seq_len);
              total += c;
            }
          }
          EXPECT_EQ(total, L * shape.num_kv_heads * budget);
        }
      }
    }
  }
}

TEST(LayerBudgetTest, TokensGoToTheLayerWhoseScoresAreHigh) {
  const LayerShape shape{2, 2, 20, 8, 4};
  EvictionSpec e;
  e.policy = EvictionPolicy::kKVzip;  // protects the 4 sinks only
  e.budget = 8;
  e.adaptive = true;
  e.adaptive_floor = 0.0;
  e.layer_adaptive = true;
  std::vector<std::vector<float>> scores(2, std::vector<float>(2 * 20, 0.1f));
  std::fill(scores[1].begin(), scores[1].end(), 0.9f);  // every token of layer 1 beats layer 0's
  auto got = AllocateAcrossLayers(e, shape, Pointers(scores));
  ASSERT_TRUE(got.ok()) << got.status();
  // Each head keeps its 4 sinks (floor 0); the other 2 * 2 * (8 - 4) = 16 tokens all go to
  // layer 1, whose scores tie: the lower head first, so head 0 takes all 16.
  EXPECT_EQ((*got)[0], (std::vector<int32_t>{4, 4}));
  EXPECT_EQ((*got)[1], (std::vector<int32_t>{20, 4}));
  scores[1][20 + 7] = 1.0f;  // one token of head 1 beats the rest: it goes first
  got = AllocateAcrossLayers(e, shape, Pointers(scores));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[1], (std::vector<int32_t>{19, 5}));
}

TEST(LayerBudgetTest, NaNScoresComeLastAndBadInputIsRefused) {
  const LayerShape shape{1, 1, 10, 8, 2};
  EvictionSpec e;
  e.policy = EvictionPolicy::kH2O;
  e.budget = 5;
  e.recent_fraction = 0;
  e.adaptive = true;
  e.adaptive_floor = 0.0;
  e.layer_adaptive = true;
  std::vector<std::vector<float>> scores(2, std::vector<float>(10, 0.5f));
  std::fill(scores[1].begin(), scores[1].end(), std::numeric_limits<float>::quiet_NaN());
  auto got = AllocateAcrossLayers(e, shape, Pointers(scores));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ((*got)[0][0], 9);  // layer 1's head keeps its one floor token, layer 0 the rest
  EXPECT_EQ((*got)[1][0], 1);

  scores[1].resize(3);
  EXPECT_THAT(AllocateAcrossLayers(e, shape, Pointers(scores)).status().message(),
              HasSubstr("layer 1 has 3 scores"));
  e.adaptive = false;  // layer-adaptive without head-adaptive: not a valid spec
  scores[1].assign(10, 0.5f);
  EXPECT_THAT(AllocateAcrossLayers(e, shape, Pointers(scores)).status().message(),
              HasSubstr("eviction.layer_adaptive"));
}

// The CPU backend keeps, per head, exactly the counts it is given: its protected tokens and its
// best-scoring rest; counts that cannot hold the protected tokens are refused.
TEST(LayerBudgetTest, CompressScoredKeepsTheGivenCountsPerHead) {
  const LayerShape shape{2, 4, 40, 16, 8};
  const testing::TestLayer layer = testing::RandomLayer(shape, 21, DType::kF16);
  CompressionSpec spec;
  spec.eviction.policy = EvictionPolicy::kKVzip;
  spec.eviction.budget = 10;
  spec.eviction.adaptive = true;
  spec.eviction.adaptive_floor = 0.0;
  spec.eviction.layer_adaptive = true;
  auto cpu = CreateCpuBackend(BackendOptions{});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  auto scores = (*cpu)->ScoreKeys(layer.input(), spec);
  ASSERT_TRUE(scores.ok()) << scores.status();
  const std::vector<float> raw = scores->scores;
  scores->head_counts = {6, 17};
  auto out = (*cpu)->CompressScored(layer.input(), spec, *scores, nullptr);
  ASSERT_TRUE(out.ok()) << out.status();
  auto view = CompactLayerView::Parse(out->bytes);
  ASSERT_TRUE(view.ok()) << view.status();
  for (int h = 0; h < 2; ++h) {
    const CompactHead head = view->head(h);
    const std::vector<int32_t> kept(head.positions, head.positions + head.n_kept);
    ASSERT_EQ(kept.size(), h == 0 ? 6u : 17u);
    for (int j = 0; j < 4; ++j) EXPECT_EQ(kept[j], j);  // the sinks
    // Every kept non-sink scores at least as high as every dropped one.
    float low = std::numeric_limits<float>::infinity();
    for (size_t i = 4; i < kept.size(); ++i) low = std::min(low, raw[h * 40 + kept[i]]);
    for (int j = 4; j < 40; ++j) {
      if (!std::binary_search(kept.begin(), kept.end(), j)) {
        EXPECT_LE(raw[h * 40 + j], low);
      }
    }
  }
  scores->head_counts = {3, 17};  // below the 4 sinks
  auto bad = (*cpu)->CompressScored(layer.input(), spec, *scores, nullptr);
  EXPECT_THAT(bad.status().message(), HasSubstr("head_counts: head 0 keeps 3"));
  scores->head_counts = {6};
  bad = (*cpu)->CompressScored(layer.input(), spec, *scores, nullptr);
  EXPECT_THAT(bad.status().message(), HasSubstr("head_counts"));
}

}  // namespace
}  // namespace kvc

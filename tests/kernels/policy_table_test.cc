// Every row of the policy table (kvc/policy.h) against what the engine does with it, so that a new
// row is checked without writing a test for it: its name parses back, validation follows its
// inputs and composition flags, selection keeps its protected window, it scores (or not) as the
// row says, and the CPU backend compresses a layer with it, alone and with head-adaptive budgets
// where the row allows them. Policy-specific formulas are tested in selection_test and
// score_extra_test.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/select_util.h"
#include "kvc/backend.h"
#include "kvc/policy.h"
#include "kvc/selection.h"
#include "kvc/spec.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing::RandomLayer;
using testing::TestLayer;

constexpr LayerShape kShape{/*num_kv_heads=*/2, /*num_q_heads=*/4, /*seq_len=*/96,
                            /*head_dim=*/16, /*obs_window=*/8};

// A layer with everything a policy may read: Q_obs, the model's RoPE, query statistics.
struct FullInput {
  TestLayer layer;
  RopeParams rope;
  std::vector<float> q_stats;
  LayerInput in;
  explicit FullInput(const LayerShape& shape) : layer(RandomLayer(shape, 11)) {
    q_stats.assign(QueryStatsFloats(shape), 0.0f);
    const int d = shape.head_dim;
    for (int qh = 0; qh < shape.num_q_heads; ++qh) {
      float* s = q_stats.data() + static_cast<size_t>(qh) * (d + d * d);
      for (int c = 0; c < d; ++c) s[c] = 0.1f * static_cast<float>((c + qh) % 5);
      for (int c = 0; c < d; ++c) s[d + c * d + c] = 1.0f;  // identity covariance
    }
    in = layer.input();
    in.rope = &rope;
    in.q_stats = q_stats.data();
  }
};

EvictionSpec SpecFor(const PolicyInfo& row, int budget) {
  EvictionSpec e;
  e.policy = row.policy;
  e.budget = budget;
  return e;
}

TEST(PolicyTableTest, RowsAreTheEnumInOrderAndNamesParseBack) {
  std::set<std::string> names;
  for (size_t i = 0; i < kNumPolicies; ++i) {
    const PolicyInfo& row = kPolicies[i];
    EXPECT_EQ(static_cast<size_t>(row.policy), i);
    EXPECT_TRUE(names.insert(std::string(row.name)).second) << "duplicate name " << row.name;
    EXPECT_FALSE(row.summary.empty()) << row.name;
    absl::StatusOr<EvictionPolicy> parsed = ParseEvictionPolicy(std::string(row.name));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, row.policy);
    EXPECT_EQ(PolicyName(row.policy), row.name);
    EXPECT_TRUE(IsKnownPolicy(row.policy));
  }
  EXPECT_FALSE(IsKnownPolicy(static_cast<EvictionPolicy>(kNumPolicies)));
  std::vector<std::string> in_order;
  for (const PolicyInfo& row : kPolicies) in_order.emplace_back(row.name);
  EXPECT_EQ(EvictionPolicyNames(), in_order);
}

TEST(PolicyTableTest, ValidationFollowsEachRow) {
  LayerShape no_window = kShape;
  no_window.obs_window = 0;
  for (const PolicyInfo& row : kPolicies) {
    SCOPED_TRACE(std::string(row.name));
    CompressionSpec spec;
    spec.eviction = SpecFor(row, 32);
    const absl::Status with_window = ValidateSpec(spec, kShape, 0);
    EXPECT_TRUE(with_window.ok()) << with_window;
    // Observation queries: required exactly when the row reads them (query statistics may come
    // from the client instead).
    const absl::Status without = ValidateSpec(spec, no_window, 0);
    EXPECT_EQ(without.ok(), row.inputs == PolicyInputs::kKeys) << without;
    if (row.inputs == PolicyInputs::kQueryStatistics) {
      spec.eviction.query_stats = true;
      EXPECT_TRUE(ValidateSpec(spec, no_window, 0).ok());
      spec.eviction.query_stats = false;
    } else if (row.policy == EvictionPolicy::kKVzip) {
      // kvzip's Q_stats are its rows' log-masses: with its queries, never instead of them.
      spec.eviction.query_stats = true;
      EXPECT_TRUE(ValidateSpec(spec, kShape, 0).ok());
      EXPECT_FALSE(ValidateSpec(spec, no_window, 0).ok());
      spec.eviction.query_stats = false;
    } else {
      spec.eviction.query_stats = true;
      EXPECT_THAT(ValidateSpec(spec, kShape, 0).message(), HasSubstr("eviction.query_stats"));
      spec.eviction.query_stats = false;
    }
    // Value weighting: allowed exactly where the row composes with it; auto follows the row.
    spec.eviction.value_weight = ValueWeight::kMul;
    EXPECT_EQ(ValidateSpec(spec, kShape, 0).ok(), row.value_weight);
    spec.eviction.value_weight = ValueWeight::kAuto;
    EXPECT_EQ(EffectiveValueWeight(spec.eviction),
              row.value_weight_by_default ? ValueWeight::kMul : ValueWeight::kOff);
    // Head-adaptive budgets: only for a policy with scores.
    spec.eviction.adaptive = true;
    const absl::Status adaptive = ValidateSpec(spec, kShape, 0);
    EXPECT_EQ(adaptive.ok(), row.scores) << adaptive;
    if (!row.scores) {
      EXPECT_THAT(adaptive.message(), HasSubstr("needs a scoring policy"));
    }
  }
}

TEST(PolicyTableTest, SelectionKeepsEachRowsProtectedWindowAndScoresAsTheRowSays) {
  FullInput full(kShape);
  const int s = kShape.seq_len;
  for (const PolicyInfo& row : kPolicies) {
    for (int budget : {4, 7, 32}) {
      SCOPED_TRACE(absl::StrCat(std::string(row.name), " budget ", budget));
      CompressionSpec spec;
      spec.eviction = SpecFor(row, budget);
      const int b = EffectiveBudget(spec.eviction, 0, s);
      const ProtectedTokens prot = ProtectedFor(spec.eviction, kShape, b);
      ASSERT_LE(prot.sinks + prot.recent, b);
      switch (row.window) {
        case ProtectedWindow::kEverything:
          EXPECT_EQ(prot.recent, s);
          break;
        case ProtectedWindow::kSinksAndRecent:
          EXPECT_EQ(prot.sinks, std::min(spec.eviction.sink_tokens, b));
          EXPECT_EQ(prot.sinks + prot.recent, b);
          break;
        case ProtectedWindow::kSinks:
          EXPECT_EQ(prot.sinks, std::min(spec.eviction.sink_tokens, b));
          EXPECT_EQ(prot.recent, 0);
          break;
        case ProtectedWindow::kRecentFraction:
          EXPECT_EQ(prot.recent, static_cast<int>(row.default_recent_fraction * b));
          break;
        case ProtectedWindow::kObservation:
          EXPECT_EQ(prot.recent, std::min(kShape.obs_window, b));
          break;
        case ProtectedWindow::kNothing:
          EXPECT_EQ(prot.sinks + prot.recent, 0);
          break;
      }
      absl::StatusOr<TokenSelection> sel = SelectTokens(full.in, spec);
      ASSERT_TRUE(sel.ok()) << sel.status();
      for (int h = 0; h < kShape.num_kv_heads; ++h) {
        const std::vector<int32_t> kept = testing::HeadPositions(*sel, h);
        ASSERT_EQ(static_cast<int>(kept.size()), b);
        EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
        const std::set<int32_t> set(kept.begin(), kept.end());
        EXPECT_EQ(static_cast<int>(set.size()), b);
        for (int i = 0; i < prot.sinks; ++i) EXPECT_TRUE(set.count(i)) << "sink " << i;
        for (int i = s - prot.recent; i < s; ++i) EXPECT_TRUE(set.count(i)) << "recent " << i;
      }
    }
    absl::StatusOr<std::vector<float>> scores = ScoreTokens(full.in, SpecFor(row, 32));
    ASSERT_TRUE(scores.ok()) << scores.status();
    const auto [lo, hi] = std::minmax_element(scores->begin(), scores->end());
    if (row.scores) {
      EXPECT_LT(*lo, *hi) << row.name << ": a scoring policy gave every token the same score";
    } else {
      EXPECT_EQ(*lo, 0.0f) << row.name;
      EXPECT_EQ(*hi, 0.0f) << row.name;
    }
  }
}

TEST(PolicyTableTest, CpuBackendCompressesWithEveryRow) {
  FullInput full(kShape);
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCpuBackend(BackendOptions{2, 0});
  ASSERT_TRUE(backend.ok()) << backend.status();
  for (const PolicyInfo& row : kPolicies) {
    for (bool adaptive : {false, true}) {
      if (adaptive && !row.scores) continue;
      SCOPED_TRACE(absl::StrCat(std::string(row.name), adaptive ? " adaptive" : ""));
      CompressionSpec spec;
      spec.eviction = SpecFor(row, 24);
      spec.eviction.adaptive = adaptive;
      spec.quant.bits = 4;
      spec.quant.group_size = 16;
      absl::StatusOr<CompactLayer> layer = (*backend)->Compress(full.in, spec, nullptr);
      ASSERT_TRUE(layer.ok()) << layer.status();
      absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(layer->bytes);
      ASSERT_TRUE(view.ok()) << view.status();
      EXPECT_EQ(view->header().eviction_policy, static_cast<uint8_t>(row.policy));
      int total = 0;
      for (int h = 0; h < kShape.num_kv_heads; ++h) total += view->desc(h).n_kept;
      const int b = EffectiveBudget(spec.eviction, 0, kShape.seq_len);
      EXPECT_EQ(total, kShape.num_kv_heads * b);
    }
  }
}

// kvcd scores a layer before its V has arrived (Backend::ScoreKeys, V null) and finishes it with
// CompressScored: for every row, alone, head-adaptive and value-weighted where the row allows it,
// the bytes are those of one Compress call.
TEST(PolicyTableTest, ScoringBeforeTheValuesStoresWhatCompressStores) {
  FullInput full(kShape);
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCpuBackend(BackendOptions{2, 0});
  ASSERT_TRUE(backend.ok()) << backend.status();
  ASSERT_TRUE((*backend)->CanScoreKeys());
  LayerInput keys_only = full.in;
  keys_only.v = nullptr;
  for (const PolicyInfo& row : kPolicies) {
    for (bool adaptive : {false, true}) {
      for (bool weighted : {false, true}) {
        if ((adaptive && !row.scores) || (weighted && !row.value_weight)) continue;
        SCOPED_TRACE(absl::StrCat(std::string(row.name), adaptive ? " adaptive" : "",
                                  weighted ? " value=mul" : ""));
        CompressionSpec spec;
        spec.eviction = SpecFor(row, 24);
        spec.eviction.adaptive = adaptive;
        if (weighted) spec.eviction.value_weight = ValueWeight::kMul;
        spec.channels.key_policy = ChannelPolicy::kThink;
        spec.channels.key_lambda = 0.25;
        spec.quant.bits = 4;
        spec.quant.group_size = 16;
        absl::StatusOr<CompactLayer> whole = (*backend)->Compress(full.in, spec, nullptr);
        ASSERT_TRUE(whole.ok()) << whole.status();
        absl::StatusOr<KeyScores> scores = (*backend)->ScoreKeys(keys_only, spec);
        ASSERT_TRUE(scores.ok()) << scores.status();
        EXPECT_EQ(scores->computed, row.scores);
        absl::StatusOr<CompactLayer> early =
            (*backend)->CompressScored(full.in, spec, *std::move(scores), nullptr);
        ASSERT_TRUE(early.ok()) << early.status();
        EXPECT_TRUE(whole->bytes == early->bytes);
      }
    }
  }
  // Scores that are not ScoreKeys' output for this input are refused, not read past their end.
  CompressionSpec spec;
  spec.eviction = SpecFor(kPolicies[static_cast<size_t>(EvictionPolicy::kH2O)], 24);
  KeyScores short_scores;
  short_scores.computed = true;
  short_scores.scores.assign(7, 0.0f);
  absl::StatusOr<CompactLayer> bad =
      (*backend)->CompressScored(full.in, spec, std::move(short_scores), nullptr);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("scores"));
}

}  // namespace
}  // namespace kvc

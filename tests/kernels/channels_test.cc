// SelectChannels on hand cases (think, l1, l2, value pruning, recent exclusion, GQA) and shape
// properties.
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/select_util.h"
#include "kvc/selection.h"

namespace kvc {
namespace {

using ::testing::ElementsAre;
using testing::HeadKeyChannels;
using testing::HeadValueChannels;
using testing::MakeLayer;
using testing::RandomLayer;
using testing::TestLayer;

// Keeps every token (policy none) so channel statistics use exactly the rows given.
ChannelSelection Channels(const TestLayer& layer, CompressionSpec spec) {
  absl::StatusOr<TokenSelection> tokens = SelectTokens(layer.input(), spec);
  EXPECT_TRUE(tokens.ok()) << tokens.status();
  absl::StatusOr<ChannelSelection> sel = SelectChannels(layer.input(), *tokens, spec);
  EXPECT_TRUE(sel.ok()) << sel.status();
  return sel.ok() ? *sel : ChannelSelection();
}

// S = 4 tokens, D = 8, one head; rows of K and V given explicitly; query q (W = 1).
TestLayer Hand(const std::vector<std::vector<float>>& k_rows,
               const std::vector<std::vector<float>>& v_rows, const std::vector<float>& q) {
  std::vector<float> k, v;
  for (const auto& r : k_rows) k.insert(k.end(), r.begin(), r.end());
  for (const auto& r : v_rows) v.insert(v.end(), r.begin(), r.end());
  return MakeLayer({1, 1, static_cast<int>(k_rows.size()), 8, 1}, k, v, q);
}

TEST(SelectChannelsTest, ThinkRanksByQueryTimesKeyEnergy) {
  // Every key row is [3,1,5,1,1,1,1,2] and the query is [1,2,0,1,1,1,1,1]: score = q^2 * k^2 =
  // [9,4,0,1,1,1,1,4]. lambda 0.75 keeps 2 channels: 0, then the 4-tie (1 vs 7) goes to 1.
  // Channel 2 has the largest key but a zero query, so magnitude policies would keep it.
  const std::vector<float> row = {3, 1, 5, 1, 1, 1, 1, 2};
  const TestLayer layer =
      Hand({row, row, row, row}, {row, row, row, row}, {1, 2, 0, 1, 1, 1, 1, 1});
  CompressionSpec s;
  s.channels.key_policy = ChannelPolicy::kThink;
  s.channels.key_lambda = 0.75;
  s.recent_tokens = 0;
  const ChannelSelection sel = Channels(layer, s);
  EXPECT_EQ(sel.key_channels, 2);
  EXPECT_THAT(HeadKeyChannels(sel, 0), ElementsAre(0, 1));
  EXPECT_EQ(sel.value_channels, 8);  // values untouched
  EXPECT_THAT(HeadValueChannels(sel, 0), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  s.channels.key_policy = ChannelPolicy::kL2;
  EXPECT_THAT(HeadKeyChannels(Channels(layer, s), 0), ElementsAre(0, 2));
}

TEST(SelectChannelsTest, L1AndL2Differ) {
  // Channel 0 = [2,2,2,2] (L1 8, L2 4), channel 1 = [5,0,0,0] (L1 5, L2 5), others 0.1.
  // lambda 0.875 keeps 1 channel: l1 keeps 0, l2 keeps 1.
  std::vector<std::vector<float>> k(4, std::vector<float>(8, 0.1f));
  for (int s = 0; s < 4; ++s) k[s][0] = 2.0f;
  k[0][1] = 5.0f;
  for (int s = 1; s < 4; ++s) k[s][1] = 0.0f;
  const TestLayer layer = Hand(k, k, std::vector<float>(8, 1.0f));
  CompressionSpec s;
  s.channels.key_lambda = 0.875;
  s.recent_tokens = 0;
  s.channels.key_policy = ChannelPolicy::kL1;
  EXPECT_THAT(HeadKeyChannels(Channels(layer, s), 0), ElementsAre(0));
  s.channels.key_policy = ChannelPolicy::kL2;
  EXPECT_THAT(HeadKeyChannels(Channels(layer, s), 0), ElementsAre(1));
}

TEST(SelectChannelsTest, RecentTokensDoNotVote) {
  // Tokens 0..2 are 1 on channel 4; the last token is 100 on channel 6. With recent_tokens = 1 the
  // last token stays unpruned and is excluded, so channel 4 wins; with 0 it counts and 6 wins.
  std::vector<std::vector<float>> k(4, std::vector<float>(8, 0.0f));
  for (int s = 0; s < 3; ++s) k[s][4] = 1.0f;
  k[3][6] = 100.0f;
  const TestLayer layer = Hand(k, k, std::vector<float>(8, 1.0f));
  CompressionSpec s;
  s.channels.key_policy = ChannelPolicy::kL2;
  s.channels.key_lambda = 0.875;
  s.recent_tokens = 1;
  EXPECT_THAT(HeadKeyChannels(Channels(layer, s), 0), ElementsAre(4));
  s.recent_tokens = 0;
  EXPECT_THAT(HeadKeyChannels(Channels(layer, s), 0), ElementsAre(6));
}

TEST(SelectChannelsTest, ValuePruningUsesTheAttentionOutput) {
  // Keys are all zero, so the query at position 3 attends uniformly (1/4) to tokens 0..3 and
  // score_v[c] = (mean_s V[s,c])^2. Channel 3 = [1,1,1,1] -> 1; channel 2 = [2,0,0,0] -> 0.25;
  // channel 6 = [4,-4,4,-4] -> 0 despite the largest magnitude. Keep 2: {2, 3}.
  std::vector<std::vector<float>> k(4, std::vector<float>(8, 0.0f));
  std::vector<std::vector<float>> v(4, std::vector<float>(8, 0.0f));
  for (int s = 0; s < 4; ++s) {
    v[s][3] = 1.0f;
    v[s][6] = s % 2 ? -4.0f : 4.0f;
  }
  v[0][2] = 2.0f;
  const TestLayer layer = Hand(k, v, std::vector<float>(8, 1.0f));
  CompressionSpec s;
  s.channels.prune_values = true;
  s.channels.value_lambda = 0.75;
  s.recent_tokens = 0;
  const ChannelSelection sel = Channels(layer, s);
  EXPECT_EQ(sel.value_channels, 2);
  EXPECT_THAT(HeadValueChannels(sel, 0), ElementsAre(2, 3));
  EXPECT_EQ(sel.key_channels, 8);
}

TEST(SelectChannelsTest, ThinkAggregatesTheQueryGroup) {
  // One KV head, two query heads. Keys are 1 on every channel. Head 0's query is 3 on channel 1;
  // head 1's query is 2 on channels 5 and 6. Group mean of q^2: ch1 4.5, ch5 2, ch6 2. Keep 2:
  // {1, 5}. Head 1 alone keeps {5, 6}.
  std::vector<float> k(4 * 8, 1.0f), q(2 * 8, 0.0f);
  q[1] = 3.0f;
  q[8 + 5] = 2.0f;
  q[8 + 6] = 2.0f;
  CompressionSpec s;
  s.channels.key_policy = ChannelPolicy::kThink;
  s.channels.key_lambda = 0.75;
  s.recent_tokens = 0;
  const TestLayer group = MakeLayer({1, 2, 4, 8, 1}, k, k, q);
  EXPECT_THAT(HeadKeyChannels(Channels(group, s), 0), ElementsAre(1, 5));
  const TestLayer head1 =
      MakeLayer({1, 1, 4, 8, 1}, k, k, std::vector<float>(q.begin() + 8, q.end()));
  EXPECT_THAT(HeadKeyChannels(Channels(head1, s), 0), ElementsAre(5, 6));
}

TEST(SelectChannelsTest, ShapesAndOrderOverRandomLayers) {
  for (Layout lay : {Layout::kHND, Layout::kNHD}) {
    const TestLayer layer = RandomLayer({4, 8, 120, 64, 16}, 9, DType::kF16, lay);
    CompressionSpec s;
    s.eviction.policy = EvictionPolicy::kSnapKV;
    s.eviction.keep_ratio = 0.5;
    s.channels.key_policy = ChannelPolicy::kThink;
    s.channels.key_lambda = 0.4;
    s.channels.prune_values = true;
    s.channels.value_lambda = 0.25;
    const ChannelSelection sel = Channels(layer, s);
    EXPECT_EQ(sel.key_channels, 64 - 25);
    EXPECT_EQ(sel.value_channels, 64 - 16);
    for (int h = 0; h < 4; ++h) {
      const std::vector<int32_t> kc = HeadKeyChannels(sel, h), vc = HeadValueChannels(sel, h);
      for (size_t i = 1; i < kc.size(); ++i) ASSERT_LT(kc[i - 1], kc[i]);
      for (size_t i = 1; i < vc.size(); ++i) ASSERT_LT(vc[i - 1], vc[i]);
      ASSERT_GE(kc.front(), 0);
      ASSERT_LT(kc.back(), 64);
    }
  }
}

TEST(SelectChannelsTest, HndAndNhdAgree) {
  const LayerShape shape{2, 4, 80, 32, 8};
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kH2O;
  s.eviction.budget = 40;
  s.channels.key_policy = ChannelPolicy::kThink;
  s.channels.key_lambda = 0.5;
  s.channels.prune_values = true;
  s.channels.value_lambda = 0.5;
  const ChannelSelection a = Channels(RandomLayer(shape, 2, DType::kBF16, Layout::kHND), s);
  const ChannelSelection b = Channels(RandomLayer(shape, 2, DType::kBF16, Layout::kNHD), s);
  EXPECT_EQ(a.key_idx, b.key_idx);
  EXPECT_EQ(a.value_idx, b.value_idx);
}

TEST(SelectChannelsTest, RejectsMismatchedTokenSelection) {
  const TestLayer layer = RandomLayer({2, 2, 10, 8, 2}, 1);
  CompressionSpec s;
  s.channels.key_policy = ChannelPolicy::kL2;
  TokenSelection t;
  t.num_kv_heads = 1;
  t.budget = 2;
  t.positions = {0, 1};
  EXPECT_THAT(std::string(SelectChannels(layer.input(), t, s).status().message()),
              ::testing::HasSubstr("tokens.num_kv_heads"));
  t.num_kv_heads = 2;
  t.positions = {0, 1, 3};
  EXPECT_THAT(std::string(SelectChannels(layer.input(), t, s).status().message()),
              ::testing::HasSubstr("tokens.positions"));
  t.positions = {0, 1, 3, 3};  // not strictly ascending
  EXPECT_THAT(std::string(SelectChannels(layer.input(), t, s).status().message()),
              ::testing::HasSubstr("tokens.positions: head 1"));
  t.positions = {0, 1, 3, 10};  // out of range
  EXPECT_THAT(std::string(SelectChannels(layer.input(), t, s).status().message()),
              ::testing::HasSubstr("tokens.positions"));
  t.budget = 11;
  EXPECT_THAT(std::string(SelectChannels(layer.input(), t, s).status().message()),
              ::testing::HasSubstr("tokens.budget"));
}

}  // namespace
}  // namespace kvc

// The channel gather is internal to kernels/ (kernels/cpu/gather.h); it is tested directly here.
#include "../kernels/cpu/gather.h"

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvc::gather {
namespace {

// Every head_dim (including ones that are not a multiple of 8) and many random kept sets: the
// shuffle path, the scalar path and the definition agree, and nothing past `kept` is written.
TEST(GatherTest, MatchesScalarForAllShapes) {
  std::mt19937 rng(11);
  for (int d = 8; d <= 256; ++d) {
    std::vector<uint16_t> row(d);
    for (uint16_t& x : row) x = static_cast<uint16_t>(rng());
    for (int trial = 0; trial < 6; ++trial) {
      const int t = 1 + static_cast<int>(rng() % d);
      std::vector<int32_t> all(d);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(t);
      std::sort(all.begin(), all.end());
      const Plan16 plan = MakePlan16(all.data(), t, d);
      std::vector<uint16_t> fast(t + 4, 0xbeef), slow(t + 4, 0xbeef);
      GatherRow16(row.data(), plan, fast.data());
      GatherRow16Scalar(row.data(), plan, slow.data());
      for (int c = 0; c < t; ++c) {
        ASSERT_EQ(slow[c], row[all[c]]) << "d " << d << " c " << c;
        ASSERT_EQ(fast[c], row[all[c]]) << "d " << d << " c " << c;
      }
      for (int c = t; c < t + 4; ++c) ASSERT_EQ(fast[c], 0xbeef) << "wrote past the end";
      // The slack variant: same kept elements, nothing written past the declared slack.
      std::vector<uint16_t> slack(t + kGather16Slack + 4, 0xbeef);
      GatherRow16Slack(row.data(), plan, slack.data());
      for (int c = 0; c < t; ++c) ASSERT_EQ(slack[c], row[all[c]]) << "d " << d << " c " << c;
      for (int c = t + kGather16Slack; c < t + kGather16Slack + 4; ++c) {
        ASSERT_EQ(slack[c], 0xbeef) << "wrote past the slack";
      }
    }
  }
}

TEST(GatherTest, PlanMasks) {
  const int32_t idx[] = {0, 3, 8, 15, 16};
  const Plan16 p = MakePlan16(idx, 5, 20);  // chunks: [0,8) [8,16); channel 16 is in the tail
  ASSERT_EQ(p.masks.size(), 2u);
  EXPECT_EQ(p.masks[0], 0b00001001);
  EXPECT_EQ(p.masks[1], 0b10000001);
  EXPECT_EQ(p.kept, 5);
}

}  // namespace
}  // namespace kvc::gather

#include "kvc/noise.h"

#include <cmath>
#include <set>

#include "gtest/gtest.h"

namespace kvc {
namespace {

TEST(NoiseTest, UniformIsOpenIntervalAndDeterministic) {
  double sum = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const float u = CounterUniform(42, 1, 2, 3, static_cast<uint32_t>(i));
    ASSERT_GT(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    EXPECT_EQ(u, CounterUniform(42, 1, 2, 3, static_cast<uint32_t>(i)));
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);  // standard error ~0.0006
}

TEST(NoiseTest, EveryCounterFieldChangesTheValue) {
  const float base = CounterUniform(1, 2, 3, 4, 5);
  EXPECT_NE(base, CounterUniform(9, 2, 3, 4, 5));
  EXPECT_NE(base, CounterUniform(1, 9, 3, 4, 5));
  EXPECT_NE(base, CounterUniform(1, 2, 9, 4, 5));
  EXPECT_NE(base, CounterUniform(1, 2, 3, 9, 5));
  EXPECT_NE(base, CounterUniform(1, 2, 3, 4, 9));
  // Swapping row and col must not give the same stream.
  EXPECT_NE(CounterUniform(1, 0, 0, 4, 5), CounterUniform(1, 0, 0, 5, 4));
}

TEST(NoiseTest, GumbelHasTheRightMeanAndVariance) {
  // Gumbel(0, 1): mean = Euler-Mascheroni 0.5772, variance = pi^2 / 6 = 1.645.
  const int n = 400000;
  double sum = 0, sq = 0;
  for (int i = 0; i < n; ++i) {
    const double g = CounterGumbel(7, 0, 0, static_cast<uint32_t>(i >> 10),
                                   static_cast<uint32_t>(i & 1023));
    ASSERT_TRUE(std::isfinite(g));
    sum += g;
    sq += g * g;
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.5772, 0.01);
  EXPECT_NEAR(var, 1.6449, 0.03);
}

TEST(NoiseTest, Mix64IsABijectionOnASample) {
  std::set<uint64_t> seen;
  for (uint64_t i = 0; i < 100000; ++i) seen.insert(Mix64(i));
  EXPECT_EQ(seen.size(), 100000u);
}

}  // namespace
}  // namespace kvc

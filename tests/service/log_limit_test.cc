// LogRateLimiter: at most N lines a window, and the first line after a drop learns how many were
// dropped. (kvcd's use of it on protobuf's log is checked end to end in kvcd_errors_test.)
#include "server/log_limit.h"

#include "gtest/gtest.h"

namespace kvc::server {
namespace {

TEST(LogRateLimiterTest, AdmitsAtMostNPerWindowAndCountsTheRest) {
  absl::Time now = absl::FromUnixSeconds(1000);
  LogRateLimiter limiter(3, absl::Seconds(1), [&] { return now; });
  for (int i = 0; i < 3; ++i) {
    auto d = limiter.Admit();
    EXPECT_TRUE(d.admit) << i;
    EXPECT_EQ(d.suppressed_before, 0u);
  }
  for (int i = 0; i < 197; ++i) EXPECT_FALSE(limiter.Admit().admit) << i;
  now += absl::Milliseconds(999);  // still the same window
  EXPECT_FALSE(limiter.Admit().admit);
  now += absl::Milliseconds(1);  // a new window: the first line reports the 198 dropped
  auto d = limiter.Admit();
  EXPECT_TRUE(d.admit);
  EXPECT_EQ(d.suppressed_before, 198u);
  d = limiter.Admit();
  EXPECT_TRUE(d.admit);
  EXPECT_EQ(d.suppressed_before, 0u);
}

TEST(LogRateLimiterTest, AQuietPeriodStartsAFreshWindow) {
  absl::Time now = absl::FromUnixSeconds(1000);
  LogRateLimiter limiter(1, absl::Seconds(1), [&] { return now; });
  EXPECT_TRUE(limiter.Admit().admit);
  EXPECT_FALSE(limiter.Admit().admit);
  now += absl::Hours(1);
  auto d = limiter.Admit();
  EXPECT_TRUE(d.admit);
  EXPECT_EQ(d.suppressed_before, 1u);
  EXPECT_FALSE(limiter.Admit().admit);
}

}  // namespace
}  // namespace kvc::server

// The soak's process probes: /proc status parsing and Prometheus series lookup.
#include "soak_kvcd.h"

#include <unistd.h>

#include <vector>

#include "gtest/gtest.h"

namespace kvc::soak {
namespace {

TEST(SoakKvcdTest, ReadsRssAndPeakOfALiveProcess) {
  std::vector<char> touched(32 << 20, 1);  // 32 MiB of resident pages
  absl::StatusOr<ProcStatus> st = ReadProcStatus(getpid());
  ASSERT_TRUE(st.ok()) << st.status();
  EXPECT_GE(st->rss_bytes, uint64_t{32} << 20);
  EXPECT_GE(st->hwm_bytes, st->rss_bytes);
  EXPECT_EQ(touched[touched.size() - 1], 1);
  EXPECT_EQ(ReadProcStatus(0x7ffffff0).status().code(), absl::StatusCode::kNotFound);
}

TEST(SoakKvcdTest, MetricValueMatchesTheWholeSeriesName) {
  const std::string text =
      "# HELP kvc_store_entries Caches in the store's index.\n"
      "kvc_store_entries_total 9\n"
      "kvc_store_entries 3\n"
      "kvc_active_streams{x=\"y\"} 4\n"
      "kvc_active_streams 0\n";
  EXPECT_EQ(*MetricValue(text, "kvc_store_entries"), 3.0);
  EXPECT_EQ(*MetricValue(text, "kvc_active_streams"), 0.0);
  EXPECT_EQ(MetricValue(text, "kvc_store_used_bytes").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvc::soak

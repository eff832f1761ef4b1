// UploadTable (server/upload_table.h): stopping an id stops each of its uploads once and takes
// them out of the table at once, so a second DeleteCache of the id finds no upload in flight even
// while the first one's stream is still ending; other ids are untouched.
#include "server/upload_table.h"

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gtest/gtest.h"

namespace kvc::server {
namespace {

TEST(UploadTableTest, StopStopsEachUploadOfTheIdOnceAndForgetsThem) {
  UploadTable table;
  std::vector<std::string> stopped;
  auto stop_as = [&](std::string name) {
    return [&stopped, name](const absl::Status& why) {
      stopped.push_back(name + ": " + std::string(why.message()));
    };
  };
  const uint64_t a1 = table.Add("a", stop_as("a1"));
  table.Add("a", stop_as("a2"));
  const uint64_t b = table.Add("b", stop_as("b"));
  EXPECT_EQ(table.size(), 3);

  EXPECT_EQ(table.Stop("a", absl::AbortedError("deleted")), 2);
  EXPECT_EQ(stopped, (std::vector<std::string>{"a1: deleted", "a2: deleted"}));
  EXPECT_EQ(table.size(), 1);
  EXPECT_EQ(table.Stop("a", absl::AbortedError("again")), 0);  // the second delete
  EXPECT_EQ(stopped.size(), 2u);

  table.Remove(a1);  // the stopped stream's own OnDone, later: nothing left to remove
  EXPECT_EQ(table.size(), 1);
  EXPECT_EQ(table.Stop("c", absl::AbortedError("unknown")), 0);
  table.Remove(b);
  EXPECT_EQ(table.size(), 0);
  EXPECT_EQ(table.StopAll(absl::UnavailableError("shutdown")), 0);
  EXPECT_EQ(stopped.size(), 2u);
}

TEST(UploadTableTest, StopAllStopsEveryUpload) {
  UploadTable table;
  int calls = 0;
  table.Add("a", [&](const absl::Status&) { ++calls; });
  table.Add("b", [&](const absl::Status&) { ++calls; });
  EXPECT_EQ(table.StopAll(absl::UnavailableError("shutdown")), 2);
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace kvc::server

// Unit tests of server/stream_guard.h: the idle reaper's protocol with a stream, per-peer slots,
// peer keys and the staging budget.
#include "server/stream_guard.h"

#include <atomic>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc::server {
namespace {

using ::testing::HasSubstr;

// Waits up to 30 s for `done`.
template <class F>
bool Eventually(F done) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!done()) {
    if (absl::Now() > deadline) return false;
    absl::SleepFor(absl::Milliseconds(5));
  }
  return true;
}

TEST(StreamReaperTest, EndsAnArmedIdleStreamOnce) {
  StreamReaper reaper(absl::Milliseconds(50), absl::Milliseconds(10));
  std::atomic<int> calls{0};
  auto w = reaper.Watch([&](absl::Duration idle) {
    EXPECT_GE(idle, absl::Milliseconds(50));
    ++calls;
  });
  w->Arm();
  ASSERT_TRUE(Eventually([&] { return w->reaped(); }));
  EXPECT_EQ(calls, 1);
  // Ended: no operation runs any more, and the reactor's own Finish is not run twice.
  EXPECT_FALSE(w->Run([] { ADD_FAILURE() << "ran after the stream ended"; }));
  EXPECT_FALSE(w->End([] { ADD_FAILURE() << "finished twice"; }));
  EXPECT_FALSE(w->Disarm());
  w->Detach();
  EXPECT_TRUE(Eventually([&] { return reaper.watched() == 0; }));
  EXPECT_EQ(calls, 1);
}

TEST(StreamReaperTest, LeavesDisarmedTouchedAndDetachedStreamsAlone) {
  StreamReaper reaper(absl::Milliseconds(200), absl::Milliseconds(10));
  std::atomic<int> calls{0};
  auto count = [&](absl::Duration) { ++calls; };
  auto disarmed = reaper.Watch(count);  // never armed: the server is working
  auto touched = reaper.Watch(count);
  auto detached = reaper.Watch(count);
  auto idle = reaper.Watch(count);
  touched->Arm();
  detached->Arm();
  detached->Detach();
  idle->Arm();
  const absl::Time start = absl::Now();
  // Activity more often than the idle time keeps `touched` alive while `idle` is ended.
  while (!idle->reaped() && absl::Now() - start < absl::Seconds(30)) {
    touched->Touch();
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(idle->reaped());
  EXPECT_FALSE(touched->reaped());
  EXPECT_FALSE(disarmed->reaped());
  EXPECT_FALSE(detached->reaped());
  EXPECT_EQ(calls, 1);
  // A disarmed watch is not re-armed by Touch.
  disarmed->Touch();
  EXPECT_TRUE(disarmed->Run([] {}));
  EXPECT_TRUE(disarmed->End([] {}));
  EXPECT_FALSE(disarmed->End([] { ADD_FAILURE() << "finished twice"; }));
}

TEST(PeerStreamsTest, CapsEachPeerSeparately) {
  PeerStreams peers(2);
  EXPECT_TRUE(peers.TryAcquire("a"));
  EXPECT_TRUE(peers.TryAcquire("a"));
  EXPECT_FALSE(peers.TryAcquire("a"));
  EXPECT_TRUE(peers.TryAcquire("b"));
  peers.Release("a");
  EXPECT_EQ(peers.held("a"), 1u);
  EXPECT_TRUE(peers.TryAcquire("a"));
  peers.Release("nobody");  // ignored
  EXPECT_EQ(peers.held("nobody"), 0u);
}

TEST(PeerKeyTest, TenantElseHostWithoutPort) {
  EXPECT_EQ(PeerKey("ipv4:10.0.0.7:5555", ""), "10.0.0.7");
  EXPECT_EQ(PeerKey("ipv6:[::1]:5555", ""), "[::1]");
  EXPECT_EQ(PeerKey("ipv6:[2001:db8::1]:443", ""), "[2001:db8::1]");
  EXPECT_EQ(PeerKey("unix:/tmp/kvcd.sock", ""), "unix:/tmp/kvcd.sock");
  EXPECT_EQ(PeerKey("ipv4:", ""), "");
  EXPECT_EQ(PeerKey("ipv4:10.0.0.7:5555", "alpha/"), "tenant:alpha/");
}

TEST(StagingBudgetTest, ReservesUpToCapacityAndGivesBack) {
  StagingBudget budget(100);
  auto a = budget.Reserve(60);
  ASSERT_TRUE(a.ok());
  auto b = budget.Reserve(41);
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("--staging_bytes=100"));
  EXPECT_THAT(std::string(b.status().message()), HasSubstr("hold 60"));
  auto c = budget.Reserve(40);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(budget.reserved(), 100u);
  {
    StagingBudget::Reservation moved = *std::move(a);
    EXPECT_EQ(budget.reserved(), 100u);
  }
  EXPECT_EQ(budget.reserved(), 40u);
  c->Release();
  c->Release();
  EXPECT_EQ(budget.reserved(), 0u);
  // A reservation may outlive its budget.
  auto budget2 = std::make_unique<StagingBudget>(10);
  auto r = budget2->Reserve(10);
  ASSERT_TRUE(r.ok());
  budget2.reset();
  r->Release();
}

// The observer (kvcd's kvc_staging_reserved_bytes) sees every change in order, and a refused
// reservation changes nothing.
TEST(StagingBudgetTest, TellsTheObserverEveryChange) {
  std::vector<uint64_t> seen;
  StagingBudget budget(100, [&seen](uint64_t reserved) { seen.push_back(reserved); });
  auto a = budget.Reserve(60);
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(budget.Reserve(41).ok());
  auto b = budget.Reserve(30);
  ASSERT_TRUE(b.ok());
  a->Release();
  a->Release();
  b->Release();
  EXPECT_THAT(seen, ::testing::ElementsAre(60u, 90u, 30u, 0u));
}

}  // namespace
}  // namespace kvc::server

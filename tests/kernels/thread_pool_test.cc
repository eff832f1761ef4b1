// kvc::ThreadPool: Schedule order and draining, and that no exception escapes a worker thread
// (which would terminate the process): ParallelFor hands it to its caller, a scheduled closure's
// is dropped, and the pool keeps working. CallNoThrow turns exceptions into statuses.
#include "kvc/thread_pool.h"

#include <atomic>
#include <cstdlib>
#include <exception>
#include <new>
#include <stdexcept>
#include <thread>
#include <string>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

TEST(ThreadPoolTest, ParallelForRethrowsOnTheCallerAndThePoolKeepsWorking) {
  ThreadPool pool(3);
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> ran{0};
    bool caught = false;
    try {
      pool.ParallelFor(64, [&](int i) {
        ran.fetch_add(1);
        // Thrown on whichever thread runs index 5 (a worker or the caller).
        if (i == 5) throw std::bad_alloc();
      });
    } catch (const std::bad_alloc&) {
      caught = true;
    }
    EXPECT_TRUE(caught);
    EXPECT_GE(ran.load(), 1);
    EXPECT_LE(ran.load(), 64);
    // The same pool runs the next job completely.
    std::vector<std::atomic<int>> hits(100);
    pool.ParallelFor(100, [&](int i) { hits[i].fetch_add(1); });
    for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  }
}

TEST(ThreadPoolTest, ParallelForRethrowsTheFirstExceptionOnce) {
  ThreadPool pool(4);
  try {
    pool.ParallelFor(1000, [](int i) { throw std::runtime_error("index failed"); });
    FAIL() << "no exception";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "index failed");
  }
}

TEST(ThreadPoolTest, ScheduleRunsInOrderOnOneWorkerAndTheDestructorDrains) {
  std::vector<int> order;
  {
    ThreadPool pool(2);  // one worker: strict FIFO
    absl::Notification gate;
    pool.Schedule([&gate] { gate.WaitForNotificationWithTimeout(absl::Seconds(30)); });
    for (int i = 0; i < 50; ++i) pool.Schedule([&order, i] { order.push_back(i); });
    gate.Notify();
  }  // joins after running everything queued
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
}

TEST(ThreadPoolTest, ThrowingScheduledClosuresDoNotKillTheWorker) {
  ThreadPool pool(2);
  std::atomic<int> ran{0};
  absl::Notification done;
  pool.Schedule([] { throw std::bad_alloc(); });
  pool.Schedule([] { throw std::runtime_error("boom"); });
  pool.Schedule([] { throw 42; });
  pool.Schedule([&] {
    ran.fetch_add(1);
    done.Notify();
  });
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(ran.load(), 1);
}

TEST(ThreadPoolTest, ScheduleWithoutWorkersRunsInline) {
  ThreadPool pool(1);
  EXPECT_EQ(pool.num_workers(), 0);
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  pool.Schedule([&] { ran_on = std::this_thread::get_id(); });
  EXPECT_EQ(ran_on, caller);
  pool.Schedule([] { throw std::runtime_error("inline"); });  // caught, not propagated
}

TEST(ThreadPoolTest, ScheduledClosuresAndParallelForShareThePool) {
  ThreadPool pool(3);
  std::atomic<int> sum{0};
  absl::Notification done;
  std::atomic<int> left{10};
  for (int j = 0; j < 10; ++j) {
    pool.Schedule([&] {
      // A scheduled closure may itself fork-join on the same pool.
      pool.ParallelFor(10, [&](int i) { sum.fetch_add(i); });
      if (left.fetch_sub(1) == 1) done.Notify();
    });
  }
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(30)));
  EXPECT_EQ(sum.load(), 10 * 45);
}

TEST(CallNoThrowTest, MapsExceptionsToStatuses) {
  absl::Status s = CallNoThrow([]() -> absl::Status { throw std::bad_alloc(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("out of memory"));
  absl::StatusOr<int> v =
      CallNoThrow([]() -> absl::StatusOr<int> { throw std::length_error("vector too long"); });
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("vector too long"));
  s = CallNoThrow([]() -> absl::Status { throw 7; });
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  v = CallNoThrow([]() -> absl::StatusOr<int> { return 3; });
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v, 3);
  s = CallNoThrow([] { return absl::NotFoundError("passed through"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
}

// Allocations on this thread fail while it is set (the replacement operator new below).
thread_local bool t_fail_allocations = false;

TEST(StatusFromExceptionTest, GivesTheBareCodeWhenItsMessageCannotBeAllocated) {
  std::exception_ptr oom, other;
  try {
    throw std::bad_alloc();
  } catch (...) {
    oom = std::current_exception();
  }
  try {
    throw std::runtime_error("a message that needs memory");
  } catch (...) {
    other = std::current_exception();
  }
  t_fail_allocations = true;
  const absl::Status a = StatusFromException(oom);
  const absl::Status b = StatusFromException(other);
  t_fail_allocations = false;
  EXPECT_EQ(a.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(a.message().empty()) << a;
  EXPECT_EQ(b.code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(b.message().empty()) << b;
  // With memory, the messages are there.
  EXPECT_THAT(std::string(StatusFromException(oom).message()), HasSubstr("out of memory"));
  EXPECT_THAT(std::string(StatusFromException(other).message()), HasSubstr("needs memory"));
}

TEST(RunNoThrowTest, HandsTheExceptionToItsHandlerAndNothingEscapes) {
  std::vector<absl::Status> seen;
  RunNoThrow([] {}, [&](const absl::Status& s) { seen.push_back(s); });
  EXPECT_TRUE(seen.empty());

  RunNoThrow([] { throw std::bad_alloc(); }, [&](const absl::Status& s) { seen.push_back(s); });
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(seen[0].message()), HasSubstr("out of memory"));

  // A handler that throws (memory is out) is called once more with the bare code.
  seen.clear();
  RunNoThrow([] { throw std::length_error("too long"); },
             [&](const absl::Status& s) {
               seen.push_back(s);
               if (seen.size() == 1) throw std::bad_alloc();
             });
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(seen[0].message()), HasSubstr("too long"));
  EXPECT_EQ(seen[1].code(), absl::StatusCode::kInternal);
  EXPECT_TRUE(seen[1].message().empty());

  // A handler that always throws: reported, and still nothing leaves RunNoThrow.
  int calls = 0;
  RunNoThrow([] { throw 7; },
             [&](const absl::Status&) {
               ++calls;
               throw std::runtime_error("handler failed");
             });
  EXPECT_EQ(calls, 2);
}

}  // namespace
}  // namespace kvc

// Every allocation of this test binary goes through here, so that a test can make this thread's
// allocations fail (t_fail_allocations).
void* operator new(std::size_t n) {
  if (kvc::t_fail_allocations) throw std::bad_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

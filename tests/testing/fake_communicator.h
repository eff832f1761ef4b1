// Test helper: an in-process fake of the transfer data plane (kvc/communicator.h). A group is
// a pair of message queues; Send enqueues for the peer, Recv dequeues (and reports a size
// mismatch as DATA_LOSS, where real NCCL would corrupt or hang). Both ranks live in one process,
// so one FakeFactory serves kvcd's side and the client's side. Thread-safe.
// FakeFactory::Kill models a peer process that dies mid-transfer: its rank stops without closing
// the group, so the survivor's Recv waits out its timeout and its Send (which, as with NCCL,
// cannot complete without the receiver) ends DEADLINE_EXCEEDED at its timeout. SendAfter's
// events are recorded, so tests can check that callers pass the producer's event through.
#ifndef KVC_TESTS_TESTING_FAKE_COMMUNICATOR_H_
#define KVC_TESTS_TESTING_FAKE_COMMUNICATOR_H_

#include <atomic>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "kvc/communicator.h"

namespace kvc::testing {

using transfer::Communicator;
using transfer::CommunicatorFactory;

struct FakeGroup {
  absl::Mutex mu;
  bool joined[2] ABSL_GUARDED_BY(mu) = {false, false};
  bool closed ABSL_GUARDED_BY(mu) = false;
  bool dead[2] ABSL_GUARDED_BY(mu) = {false, false};              // FakeFactory::Kill
  std::deque<std::vector<uint8_t>> inbox[2] ABSL_GUARDED_BY(mu);  // messages to rank r
  std::vector<const void*> ready_events ABSL_GUARDED_BY(mu);      // SendAfter's, in order
};

class FakeEndpoint final : public Communicator {
 public:
  FakeEndpoint(std::shared_ptr<FakeGroup> g, int rank) : g_(std::move(g)), rank_(rank) {}
  ~FakeEndpoint() override { Close(); }

  absl::Status Send(const void* src, size_t bytes, absl::Duration timeout) override {
    absl::MutexLock lock(&g_->mu);
    FakeGroup* g = g_.get();
    if (g->dead[rank_]) return absl::CancelledError("fake: this rank died");
    if (g->dead[1 - rank_]) {
      // Nobody will receive: wait out the timeout (an orderly close still ends it early).
      g->mu.AwaitWithTimeout(absl::Condition(&g->closed), timeout);
      if (g->closed) return absl::CancelledError("fake: closed");
      return absl::DeadlineExceededError("fake: the peer did not receive in time");
    }
    if (g->closed) return absl::CancelledError("fake: closed");
    const auto* p = static_cast<const uint8_t*>(src);
    g->inbox[1 - rank_].emplace_back(p, p + bytes);
    return absl::OkStatus();
  }

  absl::Status SendAfter(const void* src, size_t bytes, const void* ready_event,
                         absl::Duration timeout) override {
    {
      absl::MutexLock lock(&g_->mu);
      g_->ready_events.push_back(ready_event);
    }
    return Send(src, bytes, timeout);
  }

  absl::Status Recv(void* dst, size_t bytes, absl::Duration timeout) override {
    absl::MutexLock lock(&g_->mu);
    FakeGroup* g = g_.get();
    const int r = rank_;
    auto ready = [g, r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(g->mu) {
      return g->closed || !g->inbox[r].empty();
    };
    if (g->dead[r]) return absl::CancelledError("fake: this rank died");
    if (!g->mu.AwaitWithTimeout(absl::Condition(&ready), timeout)) {
      return absl::DeadlineExceededError("fake: nothing received in time");
    }
    if (g->closed) return absl::CancelledError("fake: closed");
    std::vector<uint8_t> msg = std::move(g->inbox[r].front());
    g->inbox[r].pop_front();
    // A real NCCL receive of the wrong size would corrupt or hang; the fake reports it.
    if (msg.size() != bytes) {
      return absl::DataLossError(
          absl::StrCat("fake: peer sent ", msg.size(), " bytes, receive expected ", bytes));
    }
    std::memcpy(dst, msg.data(), bytes);
    return absl::OkStatus();
  }

  void Close() override {
    absl::MutexLock lock(&g_->mu);
    if (g_->dead[rank_]) return;  // a dead process signals nothing
    g_->closed = true;
  }
  std::string_view kind() const override { return "fake"; }

 private:
  std::shared_ptr<FakeGroup> g_;
  const int rank_;
};

class FakeFactory final : public CommunicatorFactory {
 public:
  absl::Status Available() override {
    absl::MutexLock lock(&mu_);
    return available_;
  }
  void SetAvailable(absl::Status s) {
    absl::MutexLock lock(&mu_);
    available_ = std::move(s);
  }
  absl::StatusOr<std::string> NewUniqueId() override {
    absl::MutexLock lock(&mu_);
    const std::string id = absl::StrCat("fake-group-", ++counter_);
    groups_[id] = std::make_shared<FakeGroup>();
    return id;
  }
  absl::StatusOr<std::unique_ptr<Communicator>> Join(const std::string& id, int rank,
                                                     absl::Duration timeout,
                                                     const absl::Notification* cancel) override {
    std::shared_ptr<FakeGroup> g;
    {
      absl::MutexLock lock(&mu_);
      auto it = groups_.find(id);
      if (it == groups_.end()) return absl::NotFoundError("fake: unknown group");
      g = it->second;
      ++joins_;
    }
    if (rank != 0 && rank != 1) return absl::InvalidArgumentError("rank");
    absl::MutexLock lock(&g->mu);
    if (g->joined[rank]) return absl::AlreadyExistsError("fake: rank already joined");
    g->joined[rank] = true;
    FakeGroup* gp = g.get();
    auto both = [gp]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(gp->mu) {
      return gp->joined[0] && gp->joined[1];
    };
    // Waits in short slices so that a cancellation is noticed promptly.
    const absl::Time deadline = absl::Now() + timeout;
    while (!g->mu.AwaitWithTimeout(absl::Condition(&both), absl::Milliseconds(5))) {
      if (cancel != nullptr && cancel->HasBeenNotified()) {
        g->joined[rank] = false;
        cancelled_joins_.fetch_add(1);
        return absl::CancelledError("fake: join cancelled");
      }
      if (absl::Now() > deadline) {
        g->joined[rank] = false;
        return absl::DeadlineExceededError("fake: peer did not join");
      }
    }
    return std::unique_ptr<Communicator>(new FakeEndpoint(g, rank));
  }
  int joins() {
    absl::MutexLock lock(&mu_);
    return joins_;
  }
  // Rank `rank` of every group made so far dies: no more operations, no close signal.
  void Kill(int rank) {
    absl::MutexLock lock(&mu_);
    for (auto& [id, g] : groups_) {
      absl::MutexLock glock(&g->mu);
      g->dead[rank] = true;
    }
  }
  // The events SendAfter was given, over all groups (in group order, then call order).
  std::vector<const void*> ready_events() {
    absl::MutexLock lock(&mu_);
    std::vector<const void*> out;
    for (auto& [id, g] : groups_) {
      absl::MutexLock glock(&g->mu);
      out.insert(out.end(), g->ready_events.begin(), g->ready_events.end());
    }
    return out;
  }
  int cancelled_joins() const { return cancelled_joins_.load(); }

 private:
  absl::Mutex mu_;
  absl::Status available_ ABSL_GUARDED_BY(mu_);
  int counter_ ABSL_GUARDED_BY(mu_) = 0;
  int joins_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<std::string, std::shared_ptr<FakeGroup>> groups_ ABSL_GUARDED_BY(mu_);
  std::atomic<int> cancelled_joins_{0};
};

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_FAKE_COMMUNICATOR_H_

// Cooperative cancellation of engine work. A CancelToken is set by whoever owns a request (the
// client went away, its deadline passed, its cache was deleted, the server shuts down) and read
// by the engine at every row-block or chunk boundary of its long loops, so that cancelled work
// stops within one block (see kvc/cost.h for the block sizes) instead of running to the end.
//
//   CancelToken token;
//   LayerInput in = ...;
//   in.cancel = &token;                       // the engine checks it between blocks
//   ... on another thread: token.Cancel(absl::CancelledError("client gone"));
//   backend->Compress(in, spec, nullptr);     // returns that status soon after
//
// A token may also carry a deadline: once it has passed, the token reads as cancelled with
// DEADLINE_EXCEEDED and the deadline's description.
//
// Thread-safety: every method may be called from any thread, concurrently. cancelled() is cheap
// (an atomic load, plus a clock read when a deadline is set): engine loops call it per block.
#ifndef KVC_CANCEL_H_
#define KVC_CANCEL_H_

#include <atomic>
#include <cstdint>
#include <limits>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvc {

class CancelToken {
 public:
  CancelToken() = default;
  CancelToken(const CancelToken&) = delete;
  CancelToken& operator=(const CancelToken&) = delete;

  // Cancels with `why` (not OK; an OK status becomes CANCELLED). The first reason wins: later
  // calls, and a deadline passing afterwards, change nothing.
  void Cancel(absl::Status why);

  // From `deadline` on the token reads as cancelled with DEADLINE_EXCEEDED "`what`" (e.g.
  // "compression ran past --compress_timeout_seconds=300"). A later call replaces an earlier
  // deadline that has not passed yet.
  void SetDeadline(absl::Time deadline, std::string what);

  // True once cancelled or past the deadline.
  bool cancelled() const {
    if (cancelled_.load(std::memory_order_acquire)) return true;
    const int64_t deadline = deadline_ns_.load(std::memory_order_relaxed);
    if (deadline == kNoDeadline) return false;
    return DeadlinePassed(deadline);
  }

  // OK while not cancelled, else the reason.
  absl::Status status() const;

 private:
  static constexpr int64_t kNoDeadline = std::numeric_limits<int64_t>::max();
  bool DeadlinePassed(int64_t deadline_ns) const;

  mutable std::atomic<bool> cancelled_{false};
  std::atomic<int64_t> deadline_ns_{kNoDeadline};
  mutable absl::Mutex mu_;
  mutable absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::string deadline_what_ ABSL_GUARDED_BY(mu_);
};

// The engine's check between blocks: true when `token` (may be null: never cancelled) is.
inline bool Cancelled(const CancelToken* token) { return token != nullptr && token->cancelled(); }

}  // namespace kvc

#endif  // KVC_CANCEL_H_

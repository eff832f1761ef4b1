#include "kvc/cancel.h"

#include <utility>

namespace kvc {

void CancelToken::Cancel(absl::Status why) {
  if (why.ok()) why = absl::CancelledError("cancelled");
  absl::MutexLock lock(&mu_);
  if (cancelled_.load(std::memory_order_relaxed)) return;
  status_ = std::move(why);
  cancelled_.store(true, std::memory_order_release);
}

void CancelToken::SetDeadline(absl::Time deadline, std::string what) {
  absl::MutexLock lock(&mu_);
  if (cancelled_.load(std::memory_order_relaxed)) return;
  deadline_what_ = std::move(what);
  deadline_ns_.store(absl::ToUnixNanos(deadline), std::memory_order_relaxed);
}

bool CancelToken::DeadlinePassed(int64_t deadline_ns) const {
  if (absl::GetCurrentTimeNanos() < deadline_ns) return false;
  absl::MutexLock lock(&mu_);
  if (!cancelled_.load(std::memory_order_relaxed)) {
    status_ = absl::DeadlineExceededError(deadline_what_);
    cancelled_.store(true, std::memory_order_release);
  }
  return true;
}

absl::Status CancelToken::status() const {
  if (!cancelled()) return absl::OkStatus();
  absl::MutexLock lock(&mu_);
  return status_;
}

}  // namespace kvc

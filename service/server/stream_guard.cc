#include "server/stream_guard.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "kvc/thread_pool.h"

namespace kvc::server {

void StreamWatch::Touch() {
  int64_t since = armed_since_ns_.load();
  // Only an armed watch is refreshed: a disarmed one must stay disarmed.
  while (since != 0 && !armed_since_ns_.compare_exchange_weak(since, absl::GetCurrentTimeNanos())) {
  }
}

bool StreamWatch::Disarm() {
  // Under the lock, so that the reaper cannot end the stream after this returned true.
  absl::MutexLock lock(&mu_);
  armed_since_ns_ = 0;
  return !ended_;
}

bool StreamWatch::Run(absl::FunctionRef<void()> op) {
  absl::MutexLock lock(&mu_);
  if (ended_) return false;
  op();
  return true;
}

bool StreamWatch::End(absl::FunctionRef<void()> finish) {
  absl::MutexLock lock(&mu_);
  if (ended_) return false;
  finish();  // an exception (memory is out) leaves the stream open for a retry to end it
  ended_ = true;
  return true;
}

void StreamWatch::Detach() {
  // Taking the lock waits for an IdleFn in progress; the reactor is still alive until then.
  absl::MutexLock lock(&mu_);
  detached_ = true;
  armed_since_ns_ = 0;
}

void StreamWatch::MaybeReap(int64_t now_ns, absl::Duration idle) {
  absl::MutexLock lock(&mu_);
  if (detached_ || ended_) return;
  const int64_t since = armed_since_ns_.load();
  if (since == 0 || now_ns - since < absl::ToInt64Nanoseconds(idle)) return;
  on_idle_(absl::Nanoseconds(now_ns - since));  // should it throw, the next sweep tries again
  ended_ = true;
  reaped_ = true;
}

StreamReaper::StreamReaper(absl::Duration idle, absl::Duration period)
    : idle_(idle), period_(period) {
  thread_ = std::thread([this] { Loop(); });
}

StreamReaper::~StreamReaper() {
  stop_.Notify();
  thread_.join();
}

std::shared_ptr<StreamWatch> StreamReaper::Watch(StreamWatch::IdleFn on_idle) {
  auto w = std::make_shared<StreamWatch>(std::move(on_idle));
  absl::MutexLock lock(&mu_);
  watches_.push_back(w);
  return w;
}

int StreamReaper::watched() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(watches_.size());
}

void StreamReaper::Loop() {
  while (!stop_.WaitForNotificationWithTimeout(period_)) {
    // A failed sweep (memory is out) is reported and the next one tries again.
    RunOrReport("kvcd: the stream reaper's sweep failed", [&] {
      std::vector<std::shared_ptr<StreamWatch>> check;
      {
        absl::MutexLock lock(&mu_);
        watches_.erase(std::remove_if(watches_.begin(), watches_.end(),
                                      [](const auto& w) { return w->detached(); }),
                       watches_.end());
        check = watches_;
      }
      // Without the reaper's lock: an IdleFn calls into gRPC, and new streams must not wait on it.
      const int64_t now = absl::GetCurrentTimeNanos();
      for (const auto& w : check) w->MaybeReap(now, idle_);
    });
  }
}

bool PeerStreams::TryAcquire(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  uint32_t& n = held_[peer];
  if (n >= per_peer_) return false;
  ++n;
  return true;
}

void PeerStreams::Release(const std::string& peer) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(peer);
  if (it == held_.end()) return;
  if (--it->second == 0) held_.erase(it);
}

uint32_t PeerStreams::held(const std::string& peer) const {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(peer);
  return it == held_.end() ? 0 : it->second;
}

std::string PeerKey(absl::string_view grpc_peer, const std::string& tenant_namespace) {
  if (!tenant_namespace.empty()) return absl::StrCat("tenant:", tenant_namespace);
  absl::string_view p = grpc_peer;
  if (absl::ConsumePrefix(&p, "ipv4:") || absl::ConsumePrefix(&p, "ipv6:")) {
    const size_t colon = p.rfind(':');
    // "[::1]:5555" keeps its brackets; a bare IPv6 address without a port has no ']' before it.
    if (colon != absl::string_view::npos && colon > 0 && (p[0] != '[' || p[colon - 1] == ']')) {
      return std::string(p.substr(0, colon));
    }
    return std::string(p);
  }
  return std::string(grpc_peer);
}

struct StagingBudget::Reservation::State {
  State(uint64_t c, std::function<void(uint64_t)> f) : capacity(c), on_change(std::move(f)) {}
  const uint64_t capacity;
  const std::function<void(uint64_t)> on_change;
  absl::Mutex mu;
  uint64_t reserved ABSL_GUARDED_BY(mu) = 0;
};

StagingBudget::Reservation& StagingBudget::Reservation::operator=(Reservation&& o) noexcept {
  if (this != &o) {
    Release();
    state_ = std::move(o.state_);
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void StagingBudget::Reservation::Release() {
  if (state_ == nullptr) return;
  {
    absl::MutexLock lock(&state_->mu);
    state_->reserved -= bytes_;
    if (state_->on_change) state_->on_change(state_->reserved);
  }
  state_.reset();
  bytes_ = 0;
}

StagingBudget::StagingBudget(uint64_t capacity, std::function<void(uint64_t)> on_change)
    : state_(std::make_shared<Reservation::State>(capacity, std::move(on_change))) {}

absl::StatusOr<StagingBudget::Reservation> StagingBudget::Reserve(uint64_t bytes) {
  absl::MutexLock lock(&state_->mu);
  const uint64_t free = state_->capacity - state_->reserved;
  if (bytes > free) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "staging: the upload needs ", bytes, " bytes of staging, but uploads in flight hold ",
        state_->reserved, " of --staging_bytes=", state_->capacity, "; retry later"));
  }
  state_->reserved += bytes;
  if (state_->on_change) state_->on_change(state_->reserved);
  Reservation r;
  r.state_ = state_;
  r.bytes_ = bytes;
  return r;
}

uint64_t StagingBudget::reserved() const {
  absl::MutexLock lock(&state_->mu);
  return state_->reserved;
}

uint64_t StagingBudget::capacity() const { return state_->capacity; }

}  // namespace kvc::server

// What keeps one client from holding kvcd's stream resources without using them:
//
//   StreamReaper / StreamWatch  ends a PutCache or GetCache stream that moves no bytes for
//                               --stream_idle_seconds (DEADLINE_EXCEEDED), so its slot, staging
//                               and store lease are freed;
//   PeerStreams                 a per-peer (per-tenant) share of the stream slots
//                               (--max_streams_per_peer);
//   StagingBudget               the bytes all uploads in flight may stage (--staging_bytes),
//                               reserved from an upload's declared sizes at its header.
//
// Thread-safety: every class here may be used from any thread.
#ifndef KVC_SERVICE_SERVER_STREAM_GUARD_H_
#define KVC_SERVICE_SERVER_STREAM_GUARD_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace kvc::server {

// One stream's link to the reaper. The stream arms its watch whenever it waits on its client (a
// read or a write is outstanding) and disarms it while the server works (compressing,
// exporting); the reaper ends a stream armed for longer than the idle time.
//
// Ending a stream races with the reactor's own operations, so the reactor issues every StartRead,
// StartWrite and Finish through Run and End: they hold the watch's lock, and nothing is started
// on a stream that has ended. The reactor calls Detach from OnDone, before it deletes itself;
// after Detach returns the reaper never calls it again.
class StreamWatch {
 public:
  // Called by the reaper with the watch's lock held, once, when the stream has been armed and
  // idle for `idle`. It must end the stream (Finish, and TryCancel when a write may be stuck
  // behind flow control) and must not call back into this watch.
  using IdleFn = std::function<void(absl::Duration idle)>;

  explicit StreamWatch(IdleFn on_idle) : on_idle_(std::move(on_idle)) {}
  StreamWatch(const StreamWatch&) = delete;
  StreamWatch& operator=(const StreamWatch&) = delete;

  // The stream waits on its client from now on: idle time counts from now.
  void Arm() { armed_since_ns_.store(absl::GetCurrentTimeNanos()); }
  // The stream waits on the server: it is not idle. Returns false when the stream has already
  // ended (the reaper ended it while its read or write was outstanding): the reactor must then
  // start nothing more and leave the rest to OnDone.
  bool Disarm();
  // Activity outside the stream itself (a tensor delivered by the transfer service): restarts
  // the idle time if the watch is armed.
  void Touch();

  // Runs `op` (starting a read or write) with the lock held, unless the stream has ended;
  // returns whether it ran.
  bool Run(absl::FunctionRef<void()> op);
  // Ends the stream once: runs `finish` (which calls Finish) with the lock held and returns true
  // the first time; returns false without running it when the stream had already ended. When
  // `finish` throws, the stream has not ended and the exception propagates.
  bool End(absl::FunctionRef<void()> finish);
  // True once the reaper has ended the stream.
  bool reaped() const { return reaped_.load(); }
  // From OnDone: the reaper never calls the IdleFn after this returns.
  void Detach();

 private:
  friend class StreamReaper;
  // Ends the stream through the IdleFn if it is armed and has been idle for at least `idle`.
  void MaybeReap(int64_t now_ns, absl::Duration idle);
  bool detached() const { return detached_.load(); }

  const IdleFn on_idle_;
  std::atomic<int64_t> armed_since_ns_{0};  // 0: disarmed
  std::atomic<bool> reaped_{false};
  std::atomic<bool> detached_{false};
  absl::Mutex mu_;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
};

// One thread that checks every watch each `period` and ends those idle for `idle` or longer.
class StreamReaper {
 public:
  StreamReaper(absl::Duration idle, absl::Duration period);
  ~StreamReaper();  // stops the thread
  StreamReaper(const StreamReaper&) = delete;
  StreamReaper& operator=(const StreamReaper&) = delete;

  // A new watch, checked until it is detached.
  std::shared_ptr<StreamWatch> Watch(StreamWatch::IdleFn on_idle);
  absl::Duration idle() const { return idle_; }
  int watched() const;  // watches not yet pruned (detached ones leave at the next sweep)

 private:
  void Loop();

  const absl::Duration idle_;
  const absl::Duration period_;
  mutable absl::Mutex mu_;
  std::vector<std::shared_ptr<StreamWatch>> watches_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread thread_;
};

// The stream slots each peer holds, capped at `per_peer`.
class PeerStreams {
 public:
  explicit PeerStreams(uint32_t per_peer) : per_peer_(per_peer) {}
  // Takes a slot for `peer`; false when it already holds per_peer().
  bool TryAcquire(const std::string& peer);
  void Release(const std::string& peer);
  uint32_t per_peer() const { return per_peer_; }
  uint32_t held(const std::string& peer) const;

 private:
  const uint32_t per_peer_;
  mutable absl::Mutex mu_;
  std::map<std::string, uint32_t> held_ ABSL_GUARDED_BY(mu_);
};

// Who a stream belongs to for PeerStreams: "tenant:NAME/" when the call authenticated as a
// tenant (`tenant_namespace` is its store-id prefix "NAME/"), else the host part of gRPC's peer
// string: "ipv4:10.0.0.7:5555" -> "10.0.0.7", "ipv6:[::1]:5555" -> "[::1]"; other forms as given.
std::string PeerKey(absl::string_view grpc_peer, const std::string& tenant_namespace);

// Bytes reserved by uploads in flight, at most capacity(). A Reservation gives its bytes back
// when destroyed; it may outlive the budget object. `on_change`, when set, is told the reserved
// total after every change (under the budget's lock, so calls arrive in order; keep it cheap).
class StagingBudget {
 public:
  explicit StagingBudget(uint64_t capacity,
                         std::function<void(uint64_t reserved)> on_change = nullptr);

  class Reservation {
   public:
    Reservation() = default;
    Reservation(Reservation&& o) noexcept { *this = std::move(o); }
    Reservation& operator=(Reservation&& o) noexcept;
    ~Reservation() { Release(); }
    uint64_t bytes() const { return bytes_; }
    void Release();  // gives the bytes back now; idempotent

   private:
    friend class StagingBudget;
    struct State;
    std::shared_ptr<State> state_;
    uint64_t bytes_ = 0;
  };

  // RESOURCE_EXHAUSTED, naming --staging_bytes and what is reserved, when `bytes` do not fit.
  absl::StatusOr<Reservation> Reserve(uint64_t bytes);
  uint64_t reserved() const;
  uint64_t capacity() const;

 private:
  std::shared_ptr<Reservation::State> state_;
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_STREAM_GUARD_H_

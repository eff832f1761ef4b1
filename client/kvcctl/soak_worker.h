// kvcctl soak: one client thread and the state the threads share (counters, the ledger, what the
// kvcd supervisor tells the clients about kills and restarts).
//
// Thread-safety: SoakState is shared by every worker and the supervisor (atomics and mutexes);
// a SoakWorker belongs to its thread.
#ifndef KVC_CLIENT_KVCCTL_SOAK_WORKER_H_
#define KVC_CLIENT_KVCCTL_SOAK_WORKER_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvc/backend.h"
#include "kvc/client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "soak_model.h"

namespace kvc::soak {

struct SoakConfig {
  std::string target;
  std::string id_prefix = "soak/";  // every cache id starts with it
  int clients = 8;
  double fault_rate = 0.15;  // share of iterations that inject a client-side fault
  absl::Duration stall = absl::Seconds(3);
  int tiny_deadline_ms = 20;  // the longest tiny deadline
  int race_ids = 4;           // ids shared by every client (overwrite and delete races)
  int own_ids = 4;            // ids private to each client
  absl::Duration timeout = absl::Seconds(120);  // ordinary calls
  absl::Duration recover = absl::Seconds(30);   // allowed UNAVAILABLE time after a restart
  ShapeLimits limits;
  uint64_t seed = 1;
  bool verbose = false;
  bool self_check = false;  // corrupt fetched caches 1, 11, 21, ... on arrival (must be caught)
};

struct SoakState {
  explicit SoakState(SoakConfig c) : config(std::move(c)) {}
  const SoakConfig config;
  Ledger ledger;
  std::atomic<bool> stop{false};

  // Kills: `epoch` is raised before each SIGKILL; `down` is true from then until kvcd is ready.
  std::atomic<uint64_t> epoch{0};
  std::atomic<bool> down{false};
  std::atomic<int64_t> ready_unix_ms{0};  // when kvcd last became ready

  std::atomic<uint64_t> ops{0};
  std::atomic<uint64_t> verified_gets{0}, verified_bytes{0}, lossless_bytes{0};

  void Count(const std::string& op, absl::StatusCode code);
  void Fault(const std::string& kind);
  // A failure of the soak: corruption, an illegal status, a crash.
  void Failure(const std::string& what);

  std::map<std::string, std::map<std::string, uint64_t>> OpCounts() const;
  std::map<std::string, uint64_t> FaultCounts() const;
  std::vector<std::string> Failures() const;
  uint64_t failure_count() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::map<std::string, uint64_t>> counts_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, uint64_t> faults_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> failures_ ABSL_GUARDED_BY(mu_);  // the first 20
  uint64_t failure_count_ ABSL_GUARDED_BY(mu_) = 0;
};

// One client: its own kvc::Client (ordinary deadlines), one with tiny deadlines, and a raw stub
// on its own channel for uploads it abandons (cancelled or stalled mid-stream).
class SoakWorker {
 public:
  static absl::StatusOr<std::unique_ptr<SoakWorker>> Create(SoakState* state, int index);
  void Run();  // until state->stop
  // True when this client's ordinary channel reached kvcd at kill epoch `epoch` or later.
  bool ReachedSince(uint64_t epoch) const { return reached_epoch_[0] >= epoch; }
  int index() const { return index_; }

 private:
  SoakWorker(SoakState* state, int index);

  std::string PickId();
  absl::StatusOr<Upload> NewVersion(const std::string& id);
  void Put(Client& client, const std::string& op);
  void Get(bool cancel_midway);
  void Delete(Client& client, const std::string& op);
  void Stat();
  void AbandonUpload(bool stall);
  // Records the status of `op` that started at kill epoch `epoch0`; a Failure when it is not
  // legal. `extra_ok` lists codes this op may also answer (e.g. DEADLINE_EXCEEDED when tiny).
  // `via` is the client that made the call: each has its own channel, which reconnects on its own
  // after a restart.
  void Judge(const std::string& op, const Client& via, const absl::Status& s, uint64_t epoch0,
             const std::vector<absl::StatusCode>& extra_ok = {});

  SoakState* const state_;
  const int index_;
  std::mt19937_64 rng_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<Client> client_, tiny_client_;
  std::unique_ptr<kvcache::v1::KvCache::Stub> raw_;
  // The kill epoch of the last call that reached kvcd, per client (0: client_, 1: tiny_client_).
  uint64_t reached_epoch_[2] = {0, 0};
  uint64_t n_ = 0;
  uint64_t fetched_ = 0;
};

}  // namespace kvc::soak

#endif  // KVC_CLIENT_KVCCTL_SOAK_WORKER_H_

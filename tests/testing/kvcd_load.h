// Test helpers for kvcd under load: a heavy upload that keeps kvcd's compression pool busy for
// seconds (and that a test can cancel), and readings of a kvcd process's CPU time and memory
// from /proc, so tests can tell whether compression is running and how much memory it took.
//
// Thread-safety: a HeavyUpload is driven by one thread at a time, except Cancel (any thread).
#ifndef KVC_TESTS_TESTING_KVCD_LOAD_H_
#define KVC_TESTS_TESTING_KVCD_LOAD_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvc::testing {

// CPU seconds (user + system) the process has used; -1 when /proc cannot be read.
double ProcessCpuSeconds(pid_t pid);
// VmRSS and VmHWM (peak) of the process in bytes; -1 when /proc cannot be read.
int64_t ResidentBytes(pid_t pid);
int64_t PeakResidentBytes(pid_t pid);

// The CPU the process uses over `window`, in cores (CPU seconds per second).
double CpuCores(pid_t pid, absl::Duration window);

// Waits until the process uses at least `cores` over a 0.5 s window, or `timeout` passes;
// returns whether it did.
bool WaitForCpu(pid_t pid, double cores, absl::Duration timeout);

// A kvzip upload (every one of the `window` reconstruction rows sees all `seq_len` keys) over one
// layer of 2 KV heads, 16 query heads, D = 128, fp16: at 32768 tokens and 8192 rows, 64 MiB and
// about 1.1e12 flops of scoring (9 s on one AVX-512 core without AMX), more than kvcd's
// default work budget allows: the kvcd it goes to needs --work_flops_per_byte=65536. A test that
// needs compression to outlast a deadline runs kvcd with --threads=1, so the time is the
// sequential scorer's. Built once by the caller and reused (the header's id and overwrite are set
// per upload).
std::vector<kvcache::v1::PutCacheRequest> HeavyRequests(int seq_len, int window);

// A compute-bound heavy upload: expected attention over `seq_len` tokens of 2 KV heads with 64
// query heads of D = 256 (W = 64), one layer, fp16: about 1.2 MB per 1K tokens and 8.6 Mflop
// per token (the covariance products run from L2), within kvcd's default work budget. Unlike
// keyformer with W = S, whose logits stream through memory, it leaves the memory bandwidth to
// others, so a test of CPU fairness measures the CPU.
std::vector<kvcache::v1::PutCacheRequest> HeavyExpectedRequests(int seq_len);

// One PutCache stream sending `requests` (with the header's id replaced and overwrite set).
class HeavyUpload {
 public:
  // Starts the stream and sends every request on the calling thread, then WritesDone: when it
  // returns, kvcd has all bytes and is compressing (or has refused). `timeout` is the call's
  // deadline.
  HeavyUpload(kvcache::v1::KvCache::Stub* stub,
              const std::vector<kvcache::v1::PutCacheRequest>& requests, const std::string& id,
              absl::Duration timeout = absl::Seconds(600));
  // Waits for the response; returns the final status.
  grpc::Status Finish();
  // Cancels the call (the client goes away); any thread.
  void Cancel() { ctx_.TryCancel(); }

 private:
  grpc::ClientContext ctx_;
  kvcache::v1::PutCacheResponse response_;
  std::unique_ptr<grpc::ClientWriter<kvcache::v1::PutCacheRequest>> writer_;
};

// Keeps a kvcd's compression pool busy for as long as a test needs, however fast the machine:
// `clients` threads each keep `depth` uploads of `requests` in flight (ids prefix/<client>/<n>),
// starting a new one whenever one completes, so that with clients * depth above the pool's
// workers a queued layer is always waiting when a running one ends. Stop cancels what is in
// flight (the clients go away mid-compression) and joins the threads.
class HeavyLoad {
 public:
  HeavyLoad(kvcache::v1::KvCache::Stub* stub,
            const std::vector<kvcache::v1::PutCacheRequest>& requests, const std::string& prefix,
            int clients, int depth);
  ~HeavyLoad() { Stop(); }
  HeavyLoad(const HeavyLoad&) = delete;
  HeavyLoad& operator=(const HeavyLoad&) = delete;

  struct Outcome {
    int completed = 0;  // uploads kvcd finished (OK) before Stop
    int cancelled = 0;  // uploads in flight at Stop
    std::vector<std::string> errors;  // any other final status, with its message
  };
  // Idempotent; the second call returns what the first did.
  Outcome Stop();

 private:
  void Client(int c);

  kvcache::v1::KvCache::Stub* const stub_;
  const std::vector<kvcache::v1::PutCacheRequest>& requests_;
  const std::string prefix_;
  const int depth_;
  absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<HeavyUpload*> in_flight_ ABSL_GUARDED_BY(mu_);
  Outcome outcome_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
};

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_KVCD_LOAD_H_

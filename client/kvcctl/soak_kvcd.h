// kvcctl soak: the RSS sampler that watches kvcd (VmRSS and VmHWM from /proc/<pid>/status). The
// kvcd it runs itself (spawn, SIGKILL, restart on the same port) and its metrics come from the
// shared launcher, kvc/kvcd_process.h.
//
// Thread-safety: RssSampler runs its own thread.
#ifndef KVC_CLIENT_KVCCTL_SOAK_KVCD_H_
#define KVC_CLIENT_KVCCTL_SOAK_KVCD_H_

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvc/kvcd_process.h"  // KvcdProcess, MetricValue, WaitForMetric

namespace kvc::soak {

struct ProcStatus {
  uint64_t rss_bytes = 0;  // VmRSS
  uint64_t hwm_bytes = 0;  // VmHWM: the peak RSS of the process so far
};
// NOT_FOUND when the process is gone.
absl::StatusOr<ProcStatus> ReadProcStatus(pid_t pid);

// Samples a process every `period`; `pid` is asked anew each time (0 = no process now).
class RssSampler {
 public:
  struct Sample {
    double seconds = 0;  // since Start
    pid_t pid = 0;
    ProcStatus status;
    uint64_t ops = 0;
  };
  RssSampler(std::function<pid_t()> pid, std::function<uint64_t()> ops, absl::Duration period,
             std::FILE* csv);
  ~RssSampler();  // stops the thread
  void Stop();

  uint64_t max_rss() const { return max_rss_.load(); }
  uint64_t max_hwm() const { return max_hwm_.load(); }
  uint64_t samples() const { return samples_.load(); }
  // First sample over `bound` (by VmRSS or VmHWM), if any.
  bool Exceeded(uint64_t bound, Sample* first) const;

 private:
  void Loop();

  std::function<pid_t()> pid_;
  std::function<uint64_t()> ops_;
  const absl::Duration period_;
  std::FILE* csv_;  // null once Stop has run
  const absl::Time start_ = absl::Now();
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> max_rss_{0}, max_hwm_{0}, samples_{0};
  mutable absl::Mutex mu_;
  std::vector<Sample> peaks_ ABSL_GUARDED_BY(mu_);  // each sample that raised max_hwm
  std::thread thread_;
};

}  // namespace kvc::soak

#endif  // KVC_CLIENT_KVCCTL_SOAK_KVCD_H_

// kvcctl soak: the kvcd it runs itself (spawn, SIGKILL, restart on the same port) and the RSS
// sampler that watches it (VmRSS and VmHWM from /proc/<pid>/status).
//
// Thread-safety: KvcdChild is thread-safe (one mutex); RssSampler runs its own thread.
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

namespace kvc::soak {

struct ProcStatus {
  uint64_t rss_bytes = 0;  // VmRSS
  uint64_t hwm_bytes = 0;  // VmHWM: the peak RSS of the process so far
};
// NOT_FOUND when the process is gone.
absl::StatusOr<ProcStatus> ReadProcStatus(pid_t pid);

// A plain HTTP/1.0 GET of http://<host_port>/metrics (IPv4); returns the body of a 200.
absl::StatusOr<std::string> ScrapeMetrics(const std::string& host_port, absl::Duration timeout);
// The value of an unlabelled series in a Prometheus text exposition; NOT_FOUND when absent.
absl::StatusOr<double> MetricValue(const std::string& exposition, const std::string& series);
// Scrapes until `series` equals `value` or `timeout` passes; the error names the last value.
absl::Status WaitForMetric(const std::string& host_port, const std::string& series, double value,
                           absl::Duration timeout);

// A kvcd child process. Its output goes to `log_path` (appended, every start).
class KvcdChild {
 public:
  struct Options {
    std::string binary;
    std::vector<std::string> flags;  // after --listen/--port_file/--health_listen/--metrics_listen
    std::string log_path;
    std::string port_file;
    absl::Duration start_timeout = absl::Seconds(60);
  };
  explicit KvcdChild(Options options) : options_(std::move(options)) {}
  ~KvcdChild();  // SIGKILLs a running child
  KvcdChild(const KvcdChild&) = delete;
  KvcdChild& operator=(const KvcdChild&) = delete;

  // Starts kvcd on 127.0.0.1:0 the first time and on the same address afterwards (retrying while
  // the port is not free yet); returns when it has written its --port_file. The error carries the
  // tail of the log.
  absl::Status Start();
  // SIGKILL and reap. Marks the exit as expected.
  absl::Status Kill();
  // SIGTERM, then waits up to `timeout` for a clean exit; returns the exit code.
  absl::StatusOr<int> Stop(absl::Duration timeout);
  // Non-blocking: OK while running (or after an expected kill), INTERNAL naming the exit status
  // when the child exited on its own.
  absl::Status CheckAlive();

  std::string address() const;
  // The metrics address the running kvcd printed ("" if none yet).
  std::string metrics_address() const;
  pid_t pid() const;
  std::string LogTail(size_t bytes) const;

 private:
  absl::Status StartOnce(const std::string& listen);

  const Options options_;
  mutable absl::Mutex mu_;
  pid_t pid_ ABSL_GUARDED_BY(mu_) = -1;
  std::string address_ ABSL_GUARDED_BY(mu_);
};

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
  std::FILE* const csv_;
  const absl::Time start_ = absl::Now();
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> max_rss_{0}, max_hwm_{0}, samples_{0};
  mutable absl::Mutex mu_;
  std::vector<Sample> peaks_ ABSL_GUARDED_BY(mu_);  // each sample that raised max_hwm
  std::thread thread_;
};

}  // namespace kvc::soak

#endif  // KVC_CLIENT_KVCCTL_SOAK_KVCD_H_

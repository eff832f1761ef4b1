// The one way kvc's tools and tests run a kvcd: kvcctl soak, the integration tests and the
// benchmarks start the real binary as a child process on ephemeral loopback ports, read the
// addresses it prints, signal, stop, kill and restart it (on the same port), and read its metrics.
//
//   KvcdProcess::Options opts;
//   opts.binary = KVCD_PATH;
//   opts.flags = {"--store_bytes=8MiB"};
//   ASSERT_OK_AND_ASSIGN(auto kvcd, KvcdProcess::Start(opts));
//   auto channel = grpc::CreateChannel(kvcd->address(), grpc::InsecureChannelCredentials());
//   ...
//   kvcd->Signal(SIGTERM); EXPECT_EQ(*kvcd->Wait(absl::Seconds(10)), 0);
//
// Thread-safety: a KvcdProcess is thread-safe (one mutex): e.g. a sampler may read pid() while
// another thread restarts the process.
#ifndef KVC_KVCD_PROCESS_H_
#define KVC_KVCD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvc {

class KvcdProcess {
 public:
  struct Options {
    // Path of the kvcd binary; empty means the KVCD_PATH environment variable.
    std::string binary;
    // The command line is --listen=127.0.0.1:0 (on a restart: the address the first run got)
    // --health_listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0, then base_flags, then flags, so
    // later flags override earlier ones (an empty --health_listen= or --metrics_listen= turns
    // that listener off). The base flags suit tests and benchmarks.
    std::vector<std::string> base_flags = {"--store_bytes=64MiB", "--threads=2"};
    std::vector<std::string> flags;
    // kvcd's output is kept in memory (output()) and, when set, appended to this file too.
    std::string log_path;
    absl::Duration start_timeout = absl::Seconds(30);
    // When false, Start returns right after spawning (addresses stay empty): for tests of
    // start-up failures, which then call Wait and output().
    bool wait_for_ready = true;
    // SIGKILL the child when the thread that started it exits (PR_SET_PDEATHSIG): a soak's kvcd
    // must not outlive it.
    bool kill_with_parent = false;
    // "NAME=VALUE" entries for the child's environment, which is otherwise this process's: an
    // entry replaces a variable of the same name or adds one (e.g. TMPDIR, KVC_CPU_ISA).
    std::vector<std::string> env;
  };

  // Starts kvcd and waits until it prints its gRPC address (and its health and metrics addresses
  // unless disabled). On failure the process is killed and the error carries its output.
  static absl::StatusOr<std::unique_ptr<KvcdProcess>> Start(const Options& options);

  // Kills the process (SIGKILL) if it still runs.
  ~KvcdProcess();
  KvcdProcess(const KvcdProcess&) = delete;
  KvcdProcess& operator=(const KvcdProcess&) = delete;

  std::string address() const;          // "127.0.0.1:PORT"
  std::string health_address() const;   // "" if disabled
  std::string metrics_address() const;  // "" if disabled
  pid_t pid() const;                    // -1 when not running

  // Sends a signal (e.g. SIGTERM). FAILED_PRECONDITION when the process has already exited.
  absl::Status Signal(int sig);
  // Waits for exit and for its output to be read to the end (so output() is complete); returns
  // the exit code (128 + signal when killed by a signal).
  // DEADLINE_EXCEEDED when it is still running after `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  bool running() const;

  // SIGKILL and reap; the exit counts as expected (CheckAlive stays OK).
  // FAILED_PRECONDITION when it is not running.
  absl::Status Kill();
  // SIGTERM, then waits up to `timeout` for it to exit; returns the exit code. A process still
  // running after `timeout` is killed: DEADLINE_EXCEEDED.
  absl::StatusOr<int> Stop(absl::Duration timeout);
  // Starts it again on the same gRPC address (retrying while the port is not free yet, as right
  // after a SIGKILL), once the previous run has exited.
  absl::Status Restart();
  // Non-blocking: OK while running (or after Kill/Stop), INTERNAL naming the exit status when
  // the process exited on its own.
  absl::Status CheckAlive();

  // Everything the process wrote to stdout and stderr so far (every run; beyond 8 MiB, the most
  // recent 4 MiB or more).
  std::string output() const;
  // The last `bytes` of output().
  std::string OutputTail(size_t bytes) const;

 private:
  explicit KvcdProcess(Options options) : options_(std::move(options)) {}
  // Spawns one run listening on `listen` and, unless !wait, waits for its addresses.
  absl::Status Run(const std::string& listen, bool wait);
  void ReadLoop(int fd);
  // Waits until a line of this run's output starts with `prefix`; returns the rest of the line.
  absl::StatusOr<std::string> WaitForLine(const std::string& prefix, absl::Time deadline);
  // Reaps the child if it exited (blocking with `block`); records its exit code.
  bool Reap(bool block) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void JoinReader();

  const Options options_;
  mutable absl::Mutex mu_;
  pid_t pid_ ABSL_GUARDED_BY(mu_) = -1;
  bool exited_ ABSL_GUARDED_BY(mu_) = true;
  bool expected_exit_ ABSL_GUARDED_BY(mu_) = false;
  int exit_code_ ABSL_GUARDED_BY(mu_) = 0;
  std::string address_ ABSL_GUARDED_BY(mu_);
  std::string health_address_ ABSL_GUARDED_BY(mu_);
  std::string metrics_address_ ABSL_GUARDED_BY(mu_);
  std::string output_ ABSL_GUARDED_BY(mu_);
  size_t run_output_begin_ ABSL_GUARDED_BY(mu_) = 0;  // where this run's output starts
  bool eof_ ABSL_GUARDED_BY(mu_) = true;              // this run's output has been read to the end
  std::thread reader_;  // started and joined by the thread that (re)starts the process
};

// An HTTP GET of http://host_port/path with libcurl (never through a proxy); returns the body when
// the status is 200, else UNAVAILABLE with the status line or libcurl's error. `path` includes the
// query string, already URL-encoded. Thread-safe.
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(5));

// The value of one series in a Prometheus text exposition, matching the whole series name, e.g.
// MetricValue(text, "kvc_evictions_total{reason=\"ttl\"}"); NOT_FOUND when absent.
absl::StatusOr<double> MetricValue(const std::string& exposition, const std::string& series);

// Scrapes http://metrics_address/metrics until `series` equals `value` or `timeout` passes; the
// error names the last value seen. Callers use it instead of sleeping, e.g. to wait until kvcd
// has released every stream slot (kvc_active_streams == 0).
absl::Status WaitForMetric(const std::string& metrics_address, const std::string& series,
                           double value, absl::Duration timeout = absl::Seconds(10));

}  // namespace kvc

#endif  // KVC_KVCD_PROCESS_H_

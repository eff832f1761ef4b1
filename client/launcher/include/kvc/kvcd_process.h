// Test helper: runs the real kvcd binary as a child process on ephemeral loopback ports, reads
// the addresses it prints, and stops it. Used by integration tests of the service and client.
//
//   KvcdProcess::Options opts;
//   opts.binary = KVCD_PATH;
//   opts.flags = {"--store_bytes=8MiB"};
//   ASSERT_OK_AND_ASSIGN(auto kvcd, KvcdProcess::Start(opts));
//   auto channel = grpc::CreateChannel(kvcd->address(), grpc::InsecureChannelCredentials());
//   ...
//   kvcd->Signal(SIGTERM); EXPECT_EQ(*kvcd->Wait(absl::Seconds(10)), 0);
//
// Thread-safety: one thread drives a KvcdProcess; output() may be called from any thread.
#ifndef KVC_TESTS_TESTING_KVCD_PROCESS_H_
#define KVC_TESTS_TESTING_KVCD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvc::testing {

class KvcdProcess {
 public:
  struct Options {
    // Path of the kvcd binary; empty means the KVCD_PATH environment variable.
    std::string binary;
    // Appended after the defaults, so they override them: the defaults are
    // --listen=127.0.0.1:0 --health_listen=127.0.0.1:0 --metrics_listen=127.0.0.1:0
    // --store_bytes=64MiB --threads=2.
    std::vector<std::string> flags;
    absl::Duration start_timeout = absl::Seconds(30);
    // When false, Start returns right after spawning (addresses stay empty): for tests of
    // start-up failures, which then call Wait and output().
    bool wait_for_ready = true;
  };

  // Starts kvcd and waits until it prints its gRPC address (and its health and metrics addresses
  // unless disabled). On failure the process is killed and the error carries its output.
  static absl::StatusOr<std::unique_ptr<KvcdProcess>> Start(const Options& options);

  // Kills the process (SIGKILL) if it still runs.
  ~KvcdProcess();
  KvcdProcess(const KvcdProcess&) = delete;
  KvcdProcess& operator=(const KvcdProcess&) = delete;

  const std::string& address() const { return address_; }                  // "127.0.0.1:PORT"
  const std::string& health_address() const { return health_address_; }    // "" if disabled
  const std::string& metrics_address() const { return metrics_address_; }  // "" if disabled
  pid_t pid() const { return pid_; }

  // Sends a signal (e.g. SIGTERM). FAILED_PRECONDITION when the process has already exited.
  absl::Status Signal(int sig);
  // Waits for exit and for its output to be read to the end (so output() is complete); returns
  // the exit code (128 + signal when killed by a signal).
  // DEADLINE_EXCEEDED when it is still running after `timeout`.
  absl::StatusOr<int> Wait(absl::Duration timeout);
  bool running() const { return !exited_; }

  // Everything the process wrote to stdout and stderr so far.
  std::string output() const;

 private:
  KvcdProcess() = default;
  void ReadLoop();
  // Waits until `prefix` appears at the start of an output line; returns the rest of the line.
  absl::StatusOr<std::string> WaitForLine(const std::string& prefix, absl::Time deadline);

  pid_t pid_ = -1;
  int out_fd_ = -1;
  bool exited_ = false;
  int exit_code_ = 0;
  std::string address_, health_address_, metrics_address_;
  std::thread reader_;
  mutable absl::Mutex mu_;
  std::string output_ ABSL_GUARDED_BY(mu_);
  bool eof_ ABSL_GUARDED_BY(mu_) = false;
};

// grpc.health.v1 Check of `service` ("" = the whole server) at `address`: true for SERVING,
// false for NOT_SERVING; an error for anything else (including an RPC failure).
absl::StatusOr<bool> HealthServing(const std::string& address, const std::string& service = "",
                                   absl::Duration timeout = absl::Seconds(5));

// Returns a TCP port on 127.0.0.1 that was free a moment ago (for servers that cannot take
// port 0, like Prometheus).
absl::StatusOr<int> PickFreeLoopbackPort();

// A plain HTTP/1.0 GET to host:port; returns the body when the status is 200, else an error with
// the status line. `path` includes the query string, already URL-encoded.
absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout = absl::Seconds(5));

// The value of one series in a Prometheus text exposition, e.g.
// MetricValue(text, "kvc_evictions_total{reason=\"ttl\"}"); NOT_FOUND when absent.
absl::StatusOr<double> MetricValue(const std::string& exposition, const std::string& series);

// Scrapes http://metrics_address/metrics until `series` equals `value` or `timeout` passes; the
// error names the last value seen. Tests use it instead of sleeping, e.g. to wait until kvcd has
// released every stream slot (kvc_active_streams == 0) or holds the ones a test opened.
absl::Status WaitForMetric(const std::string& metrics_address, const std::string& series,
                           double value, absl::Duration timeout = absl::Seconds(10));

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_KVCD_PROCESS_H_

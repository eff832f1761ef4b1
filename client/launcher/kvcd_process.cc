#include "testing/kvcd_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"

namespace kvc::testing {
namespace {

// A sync gRPC client channel with no call in flight is polled only by gRPC's backup poller
// (every 5 s by default), so an idle test client would answer kvcd's graceful-shutdown ping late
// and make every shutdown look 5 s slow. Poll idle channels often in test processes instead; an
// explicit setting in the environment wins.
[[maybe_unused]] const bool kFastIdlePolling = [] {
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50", /*overwrite=*/0);
  return true;
}();

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvcdProcess>> KvcdProcess::Start(const Options& options) {
  std::string binary = options.binary;
  if (binary.empty()) {
    const char* env = std::getenv("KVCD_PATH");
    if (env == nullptr) return absl::InvalidArgumentError("binary: empty and KVCD_PATH unset");
    binary = env;
  }
  if (access(binary.c_str(), X_OK) != 0) return Errno(absl::StrCat("kvcd binary ", binary));
  std::vector<std::string> args = {binary,
                                   "--listen=127.0.0.1:0",
                                   "--health_listen=127.0.0.1:0",
                                   "--metrics_listen=127.0.0.1:0",
                                   "--store_bytes=64MiB",
                                   "--threads=2"};
  args.insert(args.end(), options.flags.begin(), options.flags.end());
  bool metrics = true, health = true;
  for (const auto& f : args) {
    if (f == "--metrics_listen=") metrics = false;
    if (f == "--health_listen=") health = false;
    if (f.rfind("--metrics_listen=", 0) == 0) metrics = f != "--metrics_listen=";
    if (f.rfind("--health_listen=", 0) == 0) health = f != "--health_listen=";
  }

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Errno("pipe");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return Errno("fork");
  if (pid == 0) {
    // Child: only async-signal-safe calls until exec.
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  std::unique_ptr<KvcdProcess> p(new KvcdProcess());
  p->pid_ = pid;
  p->out_fd_ = fds[0];
  p->reader_ = std::thread([raw = p.get()] { raw->ReadLoop(); });
  if (!options.wait_for_ready) return p;

  const absl::Time deadline = absl::Now() + options.start_timeout;
  auto fail = [&](const absl::Status& s) -> absl::Status {
    return absl::Status(s.code(),
                        absl::StrCat(std::string(s.message()), "; kvcd output:\n", p->output()));
  };
  auto addr = p->WaitForLine("kvcd: listening on ", deadline);
  if (!addr.ok()) return fail(addr.status());
  p->address_ = *addr;
  if (health) {
    auto h = p->WaitForLine("kvcd: health on ", deadline);
    if (!h.ok()) return fail(h.status());
    p->health_address_ = *h;
  }
  if (metrics) {
    auto m = p->WaitForLine("kvcd: metrics on http://", deadline);
    if (!m.ok()) return fail(m.status());
    std::string v = *m;
    const size_t slash = v.find('/');
    p->metrics_address_ = slash == std::string::npos ? v : v.substr(0, slash);
  }
  return p;
}

KvcdProcess::~KvcdProcess() {
  if (!exited_ && pid_ > 0) {
    kill(pid_, SIGKILL);
    int status;
    waitpid(pid_, &status, 0);
    exited_ = true;
  }
  if (reader_.joinable()) reader_.join();
  if (out_fd_ >= 0) close(out_fd_);
}

void KvcdProcess::ReadLoop() {
  char buf[4096];
  for (;;) {
    const ssize_t n = read(out_fd_, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    absl::MutexLock lock(&mu_);
    if (n <= 0) {
      eof_ = true;
      return;
    }
    output_.append(buf, static_cast<size_t>(n));
  }
}

std::string KvcdProcess::output() const {
  absl::MutexLock lock(&mu_);
  return output_;
}

absl::StatusOr<std::string> KvcdProcess::WaitForLine(const std::string& prefix,
                                                     absl::Time deadline) {
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      for (absl::string_view line : absl::StrSplit(output_, '\n')) {
        if (line.size() > prefix.size() && line.substr(0, prefix.size()) == prefix &&
            output_.find(std::string(line) + "\n") != std::string::npos) {
          return std::string(line.substr(prefix.size()));
        }
      }
      if (eof_) {
        return absl::UnavailableError(absl::StrCat("kvcd exited before printing '", prefix, "'"));
      }
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("kvcd did not print '", prefix, "'"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::Status KvcdProcess::Signal(int sig) {
  if (exited_) return absl::FailedPreconditionError("kvcd has exited");
  if (kill(pid_, sig) != 0) return Errno("kill");
  return absl::OkStatus();
}

absl::StatusOr<int> KvcdProcess::Wait(absl::Duration timeout) {
  if (exited_) return exit_code_;
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exited_ = true;
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      // The reader thread may not have drained the pipe yet: callers read output() next.
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(&eof_),
                            std::max(deadline, absl::Now() + absl::Seconds(5)));
      return exit_code_;
    }
    if (r < 0 && errno != EINTR) return Errno("waitpid");
    if (absl::Now() > deadline) return absl::DeadlineExceededError("kvcd is still running");
    absl::SleepFor(absl::Milliseconds(10));
  }
}

absl::StatusOr<bool> HealthServing(const std::string& address, const std::string& service,
                                   absl::Duration timeout) {
  // HealthCheckRequest{service} and HealthCheckResponse{status} encoded by hand: the health
  // proto's generated code is not part of the installed gRPC headers.
  std::string req;
  if (!service.empty()) {
    req.push_back(0x0a);
    req.push_back(static_cast<char>(service.size()));
    req += service;
  }
  grpc::Slice slice(req);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                        absl::StrCat("health check: ", status.error_message()));
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::DataLossError("health check: unreadable");
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // SERVING = 1, NOT_SERVING = 2; an absent field means UNKNOWN (0).
  const int value = bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;
  if (value == 1) return true;
  if (value == 2) return false;
  return absl::UnknownError(absl::StrCat("health check: status ", value));
}

absl::StatusOr<int> PickFreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return Errno("bind");
  }
  close(fd);
  return ntohs(addr.sin_port);
}

absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port)) {
    return absl::InvalidArgumentError(absl::StrCat("host_port: '", host_port, "'"));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("host_port: '", host_port, "' is not IPv4"));
  }
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(absl::ToInt64Seconds(timeout));
  tv.tv_usec = static_cast<suseconds_t>(absl::ToInt64Microseconds(timeout) % 1000000);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    absl::Status s = Errno(absl::StrCat("connect ", host_port));
    close(fd);
    return s;
  }
  const std::string req =
      absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host_port, "\r\nConnection: close\r\n\r\n");
  size_t sent = 0;
  while (sent < req.size()) {
    const ssize_t n = send(fd, req.data() + sent, req.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      close(fd);
      return Errno("send");
    }
    sent += static_cast<size_t>(n);
  }
  std::string resp;
  char buf[8192];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      close(fd);
      return Errno("recv");
    }
    if (n == 0) break;
    resp.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  const size_t header_end = resp.find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::DataLossError("truncated HTTP response");
  const std::string status_line = resp.substr(0, resp.find("\r\n"));
  if (status_line.find(" 200") == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("HTTP GET ", path, ": ", status_line));
  }
  return resp.substr(header_end + 4);
}

absl::StatusOr<double> MetricValue(const std::string& exposition, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double v;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &v)) return v;
    }
  }
  return absl::NotFoundError(absl::StrCat("series ", series, " not in the exposition"));
}

absl::Status WaitForMetric(const std::string& metrics_address, const std::string& series,
                           double value, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last = "no scrape";
  while (true) {
    absl::StatusOr<std::string> text = HttpGet(metrics_address, "/metrics");
    if (text.ok()) {
      absl::StatusOr<double> v = MetricValue(*text, series);
      if (v.ok() && *v == value) return absl::OkStatus();
      last = v.ok() ? absl::StrCat(*v) : v.status().ToString();
    } else {
      last = text.status().ToString();
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(series, " did not reach ", value, " within ",
                                                      absl::FormatDuration(timeout),
                                                      " (last: ", last, ")"));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
}

}  // namespace kvc::testing

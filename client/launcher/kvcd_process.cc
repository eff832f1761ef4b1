#include "kvc/kvcd_process.h"

#include <curl/curl.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace kvc {
namespace {

// A sync gRPC client channel with no call in flight is polled only by gRPC's backup poller
// (every 5 s by default), so an idle client in the launching process would answer kvcd's
// graceful-shutdown ping late and make every shutdown look 5 s slow. Poll idle channels often in
// processes that run kvcd; an explicit setting in the environment wins.
[[maybe_unused]] const bool kFastIdlePolling = [] {
  setenv("GRPC_CLIENT_CHANNEL_BACKUP_POLL_INTERVAL_MS", "50", /*overwrite=*/0);
  return true;
}();

constexpr size_t kMaxOutputBytes = size_t{8} << 20;

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

std::string DescribeWait(int status) {
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  return absl::StrCat("wait status ", status);
}

// Starts argv[0] with envp, its stdout and stderr on out_fd; -1 with errno when vfork fails.
// vfork, not fork: fork runs the process's atfork handlers, and OpenBLAS's joins its worker
// threads there, which deadlocks while another thread is inside a BLAS call. The child makes only
// async-signal-safe calls before execve. A function of its own, so that no local of the caller
// lives across vfork (the child shares the caller's stack until it execs).
[[gnu::noinline]] pid_t SpawnChild(int out_fd, char* const* argv, char* const* envp,
                                   bool kill_with_parent) {
  const pid_t pid = vfork();
  if (pid == 0) {
    dup2(out_fd, STDOUT_FILENO);
    dup2(out_fd, STDERR_FILENO);
    if (kill_with_parent) prctl(PR_SET_PDEATHSIG, SIGKILL);
    execve(argv[0], argv, envp);
    _exit(127);
  }
  return pid;
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvcdProcess>> KvcdProcess::Start(const Options& options) {
  Options o = options;
  if (o.binary.empty()) {
    const char* env = std::getenv("KVCD_PATH");
    if (env == nullptr) return absl::InvalidArgumentError("binary: empty and KVCD_PATH unset");
    o.binary = env;
  }
  if (access(o.binary.c_str(), X_OK) != 0) return Errno(absl::StrCat("kvcd binary ", o.binary));
  std::unique_ptr<KvcdProcess> p(new KvcdProcess(std::move(o)));
  if (absl::Status s = p->Run("127.0.0.1:0", p->options_.wait_for_ready); !s.ok()) {
    p.reset();  // kills the process and reads its output to the end
    return s;
  }
  return p;
}

absl::Status KvcdProcess::Run(const std::string& listen, bool wait) {
  std::vector<std::string> args = {options_.binary, "--listen=" + listen,
                                   "--health_listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0"};
  args.insert(args.end(), options_.base_flags.begin(), options_.base_flags.end());
  args.insert(args.end(), options_.flags.begin(), options_.flags.end());
  bool metrics = true, health = true;
  for (const auto& f : args) {
    if (f.rfind("--metrics_listen=", 0) == 0) metrics = f != "--metrics_listen=";
    if (f.rfind("--health_listen=", 0) == 0) health = f != "--health_listen=";
  }
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // The child's environment, built before vfork (the child may not allocate).
  const auto name_of = [](absl::string_view entry) { return entry.substr(0, entry.find('=')); };
  std::vector<std::string> env = options_.env;
  for (char** e = environ; *e != nullptr; ++e) {
    if (std::none_of(options_.env.begin(), options_.env.end(), [&](const std::string& o) {
          return name_of(o) == name_of(*e);
        })) {
      env.emplace_back(*e);
    }
  }
  std::vector<char*> envp;
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);

  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return Errno("pipe");
  const pid_t pid = SpawnChild(fds[1], argv.data(), envp.data(), options_.kill_with_parent);
  if (pid < 0) {
    const absl::Status status = Errno("vfork");
    close(fds[0]);
    close(fds[1]);
    return status;
  }
  close(fds[1]);
  {
    absl::MutexLock lock(&mu_);
    pid_ = pid;
    exited_ = false;
    expected_exit_ = false;
    eof_ = false;
    run_output_begin_ = output_.size();
    address_.clear();
    health_address_.clear();
    metrics_address_.clear();
  }
  reader_ = std::thread([this, fd = fds[0]] { ReadLoop(fd); });
  if (!wait) return absl::OkStatus();

  const absl::Time deadline = absl::Now() + options_.start_timeout;
  auto fail = [&](const absl::Status& s) -> absl::Status {
    return absl::Status(s.code(),
                        absl::StrCat(std::string(s.message()), "; kvcd output:\n", output()));
  };
  absl::StatusOr<std::string> addr = WaitForLine("kvcd: listening on ", deadline);
  if (!addr.ok()) return fail(addr.status());
  std::string health_addr, metrics_addr;
  if (health) {
    absl::StatusOr<std::string> h = WaitForLine("kvcd: health on ", deadline);
    if (!h.ok()) return fail(h.status());
    health_addr = *h;
  }
  if (metrics) {
    absl::StatusOr<std::string> m = WaitForLine("kvcd: metrics on http://", deadline);
    if (!m.ok()) return fail(m.status());
    const size_t slash = m->find('/');
    metrics_addr = slash == std::string::npos ? *m : m->substr(0, slash);
  }
  absl::MutexLock lock(&mu_);
  address_ = *addr;
  health_address_ = health_addr;
  metrics_address_ = metrics_addr;
  return absl::OkStatus();
}

KvcdProcess::~KvcdProcess() {
  {
    absl::MutexLock lock(&mu_);
    if (!exited_ && pid_ > 0) {
      kill(pid_, SIGKILL);
      Reap(/*block=*/true);
    }
  }
  JoinReader();
}

void KvcdProcess::JoinReader() {
  if (reader_.joinable()) reader_.join();
}

void KvcdProcess::ReadLoop(int fd) {
  const int log = options_.log_path.empty() ? -1
                                            : open(options_.log_path.c_str(),
                                                   O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  char buf[4096];
  for (;;) {
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n > 0 && log >= 0) {
      // The log is a convenience copy: a failed write loses only the copy.
      [[maybe_unused]] const ssize_t w = write(log, buf, static_cast<size_t>(n));
    }
    absl::MutexLock lock(&mu_);
    if (n <= 0) {
      eof_ = true;
      break;
    }
    output_.append(buf, static_cast<size_t>(n));
    // A long soak keeps only the recent output in memory (log_path has all of it).
    if (output_.size() > kMaxOutputBytes) {
      const size_t drop = output_.size() - kMaxOutputBytes / 2;
      output_.erase(0, drop);
      run_output_begin_ = run_output_begin_ > drop ? run_output_begin_ - drop : 0;
    }
  }
  close(fd);
  if (log >= 0) close(log);
}

bool KvcdProcess::Reap(bool block) {
  if (pid_ <= 0) return exited_;
  int status = 0;
  const pid_t r = waitpid(pid_, &status, block ? 0 : WNOHANG);
  if (r != pid_) return false;
  exited_ = true;
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  pid_ = -1;
  return true;
}

std::string KvcdProcess::address() const {
  absl::MutexLock lock(&mu_);
  return address_;
}

std::string KvcdProcess::health_address() const {
  absl::MutexLock lock(&mu_);
  return health_address_;
}

std::string KvcdProcess::metrics_address() const {
  absl::MutexLock lock(&mu_);
  return metrics_address_;
}

pid_t KvcdProcess::pid() const {
  absl::MutexLock lock(&mu_);
  return pid_;
}

bool KvcdProcess::running() const {
  absl::MutexLock lock(&mu_);
  return !exited_;
}

std::string KvcdProcess::output() const {
  absl::MutexLock lock(&mu_);
  return output_;
}

std::string KvcdProcess::OutputTail(size_t bytes) const {
  absl::MutexLock lock(&mu_);
  return output_.size() > bytes ? output_.substr(output_.size() - bytes) : output_;
}

absl::StatusOr<std::string> KvcdProcess::WaitForLine(const std::string& prefix,
                                                     absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  std::string found;
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    absl::string_view run = absl::string_view(output_).substr(run_output_begin_);
    for (absl::string_view line : absl::StrSplit(run, '\n')) {
      // Only whole lines: the address is complete once its newline has arrived.
      if (line.size() > prefix.size() && line.substr(0, prefix.size()) == prefix &&
          line.data() + line.size() < run.data() + run.size()) {
        found = std::string(line.substr(prefix.size()));
        return true;
      }
    }
    return eof_;
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat("kvcd did not print '", prefix, "'"));
  }
  if (found.empty()) {
    return absl::UnavailableError(absl::StrCat("kvcd exited before printing '", prefix, "'"));
  }
  return found;
}

absl::Status KvcdProcess::Signal(int sig) {
  absl::MutexLock lock(&mu_);
  if (exited_ || pid_ <= 0) return absl::FailedPreconditionError("kvcd has exited");
  if (kill(pid_, sig) != 0) return Errno("kill");
  return absl::OkStatus();
}

absl::StatusOr<int> KvcdProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (Reap(/*block=*/false)) break;
    }
    if (absl::Now() > deadline) return absl::DeadlineExceededError("kvcd is still running");
    absl::SleepFor(absl::Milliseconds(10));
  }
  // The reader thread may not have drained the pipe yet: callers read output() next.
  absl::MutexLock lock(&mu_);
  mu_.AwaitWithDeadline(absl::Condition(&eof_), std::max(deadline, absl::Now() + absl::Seconds(5)));
  return exit_code_;
}

absl::Status KvcdProcess::Kill() {
  absl::MutexLock lock(&mu_);
  if (exited_ || pid_ <= 0) return absl::FailedPreconditionError("kvcd is not running");
  expected_exit_ = true;
  kill(pid_, SIGKILL);
  Reap(/*block=*/true);
  return absl::OkStatus();
}

absl::StatusOr<int> KvcdProcess::Stop(absl::Duration timeout) {
  {
    absl::MutexLock lock(&mu_);
    if (exited_ || pid_ <= 0) return absl::FailedPreconditionError("kvcd is not running");
    expected_exit_ = true;
    kill(pid_, SIGTERM);
  }
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (Reap(/*block=*/false)) {
        if (exit_code_ < 128) return exit_code_;
        return absl::InternalError(
            absl::StrCat("kvcd killed by signal ", exit_code_ - 128, " on SIGTERM"));
      }
    }
    if (absl::Now() >= deadline) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  Kill().IgnoreError();
  return absl::DeadlineExceededError(
      absl::StrCat("kvcd still ran ", absl::FormatDuration(timeout), " after SIGTERM"));
}

absl::Status KvcdProcess::Restart() {
  std::string listen;
  {
    absl::MutexLock lock(&mu_);
    if (!exited_) return absl::FailedPreconditionError("kvcd is still running");
    listen = address_.empty() ? "127.0.0.1:0" : address_;
  }
  JoinReader();
  absl::Status last;
  // The restart binds the same port; right after a SIGKILL the kernel may still hold it briefly,
  // and kvcd then exits before printing its address (UNAVAILABLE): try again.
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  do {
    last = Run(listen, /*wait=*/true);
    if (last.ok()) return last;
    {
      absl::MutexLock lock(&mu_);
      if (!exited_ && pid_ > 0) {
        expected_exit_ = true;
        kill(pid_, SIGKILL);
        Reap(/*block=*/true);
      }
    }
    JoinReader();
    if (last.code() != absl::StatusCode::kUnavailable) break;
    absl::SleepFor(absl::Milliseconds(250));
  } while (absl::Now() < deadline);
  return last;
}

absl::Status KvcdProcess::CheckAlive() {
  absl::MutexLock lock(&mu_);
  if (exited_ || pid_ <= 0) return absl::OkStatus();
  int status = 0;
  const pid_t pid = pid_;
  if (waitpid(pid, &status, WNOHANG) != pid) return absl::OkStatus();
  exited_ = true;
  exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  pid_ = -1;
  return absl::InternalError(absl::StrCat("kvcd ", DescribeWait(status), " unexpectedly"));
}

absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path,
                                    absl::Duration timeout) {
  // libcurl's global state is set up once, before any thread could race on it.
  static const CURLcode global = curl_global_init(CURL_GLOBAL_DEFAULT);
  if (global != CURLE_OK) {
    return absl::InternalError(absl::StrCat("libcurl: ", curl_easy_strerror(global)));
  }
  std::unique_ptr<CURL, void (*)(CURL*)> curl(curl_easy_init(), &curl_easy_cleanup);
  if (curl == nullptr) return absl::InternalError("libcurl: curl_easy_init failed");
  const std::string url = absl::StrCat("http://", host_port, path);
  std::string body, status_line;
  auto on_body = +[](char* data, size_t size, size_t n, void* out) -> size_t {
    static_cast<std::string*>(out)->append(data, size * n);
    return size * n;
  };
  // The first header line is the status line ("HTTP/1.1 404 Not Found").
  auto on_header = +[](char* data, size_t size, size_t n, void* out) -> size_t {
    auto* line = static_cast<std::string*>(out);
    if (line->empty()) *line = std::string(absl::StripTrailingAsciiWhitespace({data, size * n}));
    return size * n;
  };
  const long ms = static_cast<long>(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  CURL* c = curl.get();
  curl_easy_setopt(c, CURLOPT_URL, url.c_str());
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // no SIGALRM for timeouts: threads use this
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");  // loopback servers: never through a proxy
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, ms);
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &body);
  curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
  curl_easy_setopt(c, CURLOPT_HEADERDATA, &status_line);
  const CURLcode rc = curl_easy_perform(c);
  if (rc != CURLE_OK) {
    return absl::UnavailableError(absl::StrCat("HTTP GET ", url, ": ", curl_easy_strerror(rc)));
  }
  long code = 0;
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &code);
  if (code != 200)
    return absl::UnavailableError(absl::StrCat("HTTP GET ", path, ": ", status_line));
  return body;
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

}  // namespace kvc

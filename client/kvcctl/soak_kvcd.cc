#include "soak_kvcd.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace kvc::soak {
namespace {

std::string DescribeWait(int status) {
  if (WIFSIGNALED(status)) return absl::StrCat("killed by signal ", WTERMSIG(status));
  if (WIFEXITED(status)) return absl::StrCat("exited with code ", WEXITSTATUS(status));
  return absl::StrCat("wait status ", status);
}

}  // namespace

absl::StatusOr<ProcStatus> ReadProcStatus(pid_t pid) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  if (!in) return absl::NotFoundError(absl::StrCat("no /proc/", pid, "/status"));
  ProcStatus out;
  std::string line;
  while (std::getline(in, line)) {
    // "VmRSS:	  123456 kB"
    for (auto [key, field] : {std::pair<const char*, uint64_t*>{"VmRSS:", &out.rss_bytes},
                              {"VmHWM:", &out.hwm_bytes}}) {
      absl::string_view rest = line;
      if (!absl::ConsumePrefix(&rest, key)) continue;
      rest = absl::StripAsciiWhitespace(rest);
      absl::ConsumeSuffix(&rest, "kB");
      uint64_t kib = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(rest), &kib)) *field = kib << 10;
    }
  }
  return out;
}

absl::StatusOr<std::string> ScrapeMetrics(const std::string& host_port, absl::Duration timeout) {
  const size_t colon = host_port.rfind(':');
  int port = 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  if (colon == std::string::npos || !absl::SimpleAtoi(host_port.substr(colon + 1), &port) ||
      inet_pton(AF_INET, host_port.substr(0, colon).c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics address '", host_port, "'"));
  }
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(absl::ToInt64Seconds(timeout));
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  std::string resp;
  absl::Status status;
  const std::string req =
      absl::StrCat("GET /metrics HTTP/1.0\r\nHost: ", host_port, "\r\nConnection: close\r\n\r\n");
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::send(fd, req.data(), req.size(), MSG_NOSIGNAL) != static_cast<ssize_t>(req.size())) {
    status = absl::UnavailableError(absl::StrCat(host_port, ": ", std::strerror(errno)));
  } else {
    char buf[8192];
    for (;;) {
      const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      resp.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  if (!status.ok()) return status;
  const size_t body = resp.find("\r\n\r\n");
  if (resp.rfind("HTTP/1.", 0) != 0 || resp.find(" 200 ") > resp.find("\r\n") ||
      body == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("metrics: ", resp.substr(0, resp.find('\r'))));
  }
  return resp.substr(body + 4);
}

absl::StatusOr<double> MetricValue(const std::string& exposition, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (absl::ConsumePrefix(&line, series) && absl::ConsumePrefix(&line, " ")) {
      double v;
      if (absl::SimpleAtod(line, &v)) return v;
    }
  }
  return absl::NotFoundError(absl::StrCat("series ", series, " not in the exposition"));
}

absl::Status WaitForMetric(const std::string& host_port, const std::string& series, double value,
                           absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string last = "no scrape";
  while (true) {
    absl::StatusOr<std::string> text = ScrapeMetrics(host_port, absl::Seconds(5));
    absl::StatusOr<double> v =
        text.ok() ? MetricValue(*text, series) : absl::StatusOr<double>(text.status());
    if (v.ok() && *v == value) return absl::OkStatus();
    last = v.ok() ? absl::StrCat(*v) : v.status().ToString();
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(series, " is ", last, ", not ", value,
                                                      " after ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
}

KvcdChild::~KvcdChild() {
  absl::MutexLock lock(&mu_);
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
}

absl::Status KvcdChild::StartOnce(const std::string& listen) {
  ::unlink(options_.port_file.c_str());
  std::vector<std::string> args = {options_.binary, "--listen=" + listen,
                                   "--port_file=" + options_.port_file,
                                   "--health_listen=127.0.0.1:0", "--metrics_listen=127.0.0.1:0"};
  args.insert(args.end(), options_.flags.begin(), options_.flags.end());
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  // Prepared before vfork: the child may only make async-signal-safe calls before execv.
  const int log =
      ::open(options_.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log < 0) {
    return absl::InternalError(
        absl::StrCat("cannot open ", options_.log_path, ": ", std::strerror(errno)));
  }
  // vfork, not fork: fork runs the process's atfork handlers, and OpenBLAS's joins its worker
  // threads there, which deadlocks while the soak's clients are inside a BLAS call.
  const pid_t pid = ::vfork();
  if (pid < 0) {
    ::close(log);
    return absl::InternalError(absl::StrCat("vfork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    ::dup2(log, STDOUT_FILENO);
    ::dup2(log, STDERR_FILENO);
    // kvcd must not outlive the soak (the thread that spawns is the soak's main thread).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::execv(argv[0], argv.data());
    _exit(127);
  }
  ::close(log);
  {
    absl::MutexLock lock(&mu_);
    pid_ = pid;
  }
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  while (absl::Now() < deadline) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      absl::MutexLock lock(&mu_);
      pid_ = -1;
      return absl::UnavailableError(absl::StrCat("kvcd ", DescribeWait(status), " on start"));
    }
    std::ifstream in(options_.port_file);
    std::string address;
    if (in && std::getline(in, address) && !address.empty()) {
      absl::MutexLock lock(&mu_);
      address_ = address;
      return absl::OkStatus();
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  Kill().IgnoreError();
  return absl::DeadlineExceededError(absl::StrCat("kvcd did not write --port_file within ",
                                                  absl::FormatDuration(options_.start_timeout)));
}

absl::Status KvcdChild::Start() {
  const std::string listen = address().empty() ? "127.0.0.1:0" : address();
  absl::Status last;
  // A restart binds the same port; right after a SIGKILL the kernel may still hold it briefly.
  const absl::Time deadline = absl::Now() + options_.start_timeout;
  do {
    last = StartOnce(listen);
    if (last.ok() || last.code() != absl::StatusCode::kUnavailable) break;
    absl::SleepFor(absl::Milliseconds(250));
  } while (absl::Now() < deadline);
  if (last.ok()) return last;
  return absl::Status(last.code(), absl::StrCat(last.message(), "; log tail:\n", LogTail(2000)));
}

absl::Status KvcdChild::Kill() {
  pid_t pid;
  {
    absl::MutexLock lock(&mu_);
    pid = pid_;
    pid_ = -1;
  }
  if (pid <= 0) return absl::FailedPreconditionError("kvcd is not running");
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  return absl::OkStatus();
}

absl::StatusOr<int> KvcdChild::Stop(absl::Duration timeout) {
  pid_t pid;
  {
    absl::MutexLock lock(&mu_);
    pid = pid_;
  }
  if (pid <= 0) return absl::FailedPreconditionError("kvcd is not running");
  ::kill(pid, SIGTERM);
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      absl::MutexLock lock(&mu_);
      pid_ = -1;
      if (WIFEXITED(status)) return WEXITSTATUS(status);
      return absl::InternalError(absl::StrCat("kvcd ", DescribeWait(status), " on SIGTERM"));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  Kill().IgnoreError();
  return absl::DeadlineExceededError(
      absl::StrCat("kvcd still ran ", absl::FormatDuration(timeout), " after SIGTERM"));
}

absl::Status KvcdChild::CheckAlive() {
  absl::MutexLock lock(&mu_);
  if (pid_ <= 0) return absl::OkStatus();
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) != pid_) return absl::OkStatus();
  pid_ = -1;
  return absl::InternalError(absl::StrCat("kvcd ", DescribeWait(status), " unexpectedly"));
}

std::string KvcdChild::address() const {
  absl::MutexLock lock(&mu_);
  return address_;
}

std::string KvcdChild::metrics_address() const {
  // kvcd prints "kvcd: metrics on http://ADDR/metrics" after each start; the last one is current.
  const std::string log = LogTail(std::string::npos);
  const std::string prefix = "kvcd: metrics on http://";
  const size_t at = log.rfind(prefix);
  if (at == std::string::npos) return "";
  const size_t begin = at + prefix.size();
  const size_t end = log.find("/metrics", begin);
  return end == std::string::npos ? "" : log.substr(begin, end - begin);
}

pid_t KvcdChild::pid() const {
  absl::MutexLock lock(&mu_);
  return pid_;
}

std::string KvcdChild::LogTail(size_t bytes) const {
  std::ifstream in(options_.log_path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string all = ss.str();
  return all.size() > bytes ? all.substr(all.size() - bytes) : all;
}

RssSampler::RssSampler(std::function<pid_t()> pid, std::function<uint64_t()> ops,
                       absl::Duration period, std::FILE* csv)
    : pid_(std::move(pid)), ops_(std::move(ops)), period_(period), csv_(csv) {
  if (csv_ != nullptr) std::fprintf(csv_, "seconds,pid,rss_bytes,hwm_bytes,ops\n");
  thread_ = std::thread([this] { Loop(); });
}

RssSampler::~RssSampler() { Stop(); }

void RssSampler::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  if (csv_ != nullptr) std::fflush(csv_);
}

void RssSampler::Loop() {
  while (!stop_.load()) {
    const pid_t pid = pid_();
    if (pid > 0) {
      absl::StatusOr<ProcStatus> st = ReadProcStatus(pid);
      if (st.ok()) {
        Sample s;
        s.seconds = absl::ToDoubleSeconds(absl::Now() - start_);
        s.pid = pid;
        s.status = *st;
        s.ops = ops_();
        if (csv_ != nullptr) {
          std::fprintf(csv_, "%.2f,%d,%llu,%llu,%llu\n", s.seconds, static_cast<int>(pid),
                       static_cast<unsigned long long>(st->rss_bytes),
                       static_cast<unsigned long long>(st->hwm_bytes),
                       static_cast<unsigned long long>(s.ops));
          std::fflush(csv_);  // a long run can be watched (and survives a crash of the soak)
        }
        if (st->rss_bytes > max_rss_.load()) max_rss_ = st->rss_bytes;
        if (st->hwm_bytes > max_hwm_.load()) {
          max_hwm_ = st->hwm_bytes;
          absl::MutexLock lock(&mu_);
          peaks_.push_back(s);
        }
        ++samples_;
      }
    }
    const absl::Time next = absl::Now() + period_;
    while (!stop_.load() && absl::Now() < next) absl::SleepFor(absl::Milliseconds(20));
  }
}

bool RssSampler::Exceeded(uint64_t bound, Sample* first) const {
  absl::MutexLock lock(&mu_);
  for (const Sample& s : peaks_) {
    if (s.status.hwm_bytes > bound || s.status.rss_bytes > bound) {
      *first = s;
      return true;
    }
  }
  return false;
}

}  // namespace kvc::soak

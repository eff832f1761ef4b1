#include "server/log_limit.h"

#include <cstdio>
#include <string>
#include <utility>

#include "google/protobuf/stubs/logging.h"

namespace kvc::server {

LogRateLimiter::LogRateLimiter(int max_lines, absl::Duration window,
                               std::function<absl::Time()> now)
    : max_lines_(max_lines), window_(window), now_(std::move(now)) {}

LogRateLimiter::Decision LogRateLimiter::Admit() {
  const absl::Time now = now_();
  absl::MutexLock lock(&mu_);
  if (now - window_start_ >= window_) {
    window_start_ = now;
    in_window_ = 0;
  }
  Decision d;
  if (in_window_ >= max_lines_) {
    ++suppressed_;
    return d;
  }
  ++in_window_;
  d.admit = true;
  d.suppressed_before = std::exchange(suppressed_, 0);
  return d;
}

namespace {

// Set once by InstallProtobufLogLimit; never freed (log lines may come until exit).
LogRateLimiter* g_protobuf_limiter = nullptr;
int g_protobuf_lines_per_second = 0;

const char* LevelName(google::protobuf::LogLevel level) {
  switch (level) {
    case google::protobuf::LOGLEVEL_INFO:
      return "INFO";
    case google::protobuf::LOGLEVEL_WARNING:
      return "WARNING";
    case google::protobuf::LOGLEVEL_ERROR:
      return "ERROR";
    case google::protobuf::LOGLEVEL_FATAL:
      return "FATAL";
  }
  return "UNKNOWN";
}

void LimitedProtobufLog(google::protobuf::LogLevel level, const char* filename, int line,
                        const std::string& message) {
  LogRateLimiter::Decision d;
  if (level == google::protobuf::LOGLEVEL_FATAL) {
    d.admit = true;
  } else {
    d = g_protobuf_limiter->Admit();
  }
  if (!d.admit) return;
  if (d.suppressed_before > 0) {
    std::fprintf(stderr, "[libprotobuf] %llu log lines suppressed (at most %d a second)\n",
                 static_cast<unsigned long long>(d.suppressed_before), g_protobuf_lines_per_second);
  }
  // One fprintf per line, so concurrent lines do not interleave.
  std::fprintf(stderr, "[libprotobuf %s %s:%d] %s\n", LevelName(level), filename, line,
               message.c_str());
  std::fflush(stderr);
}

}  // namespace

void InstallProtobufLogLimit(int lines_per_second) {
  if (g_protobuf_limiter == nullptr) {
    g_protobuf_lines_per_second = lines_per_second < 1 ? 1 : lines_per_second;
    g_protobuf_limiter = new LogRateLimiter(g_protobuf_lines_per_second, absl::Seconds(1));
  }
  google::protobuf::SetLogHandler(&LimitedProtobufLog);
}

}  // namespace kvc::server

// Rate limiting of library log lines. Protobuf logs an ERROR line for every message it refuses to
// parse because a string field is not UTF-8; without a limit, any client could fill kvcd's log
// (and the node's disk) by repeating one bad request.
//
// Thread-safety: LogRateLimiter is thread-safe. InstallProtobufLogLimit must be called before
// other threads use protobuf (protobuf's SetLogHandler is not thread-safe), e.g. early in main.
#ifndef KVC_SERVICE_SERVER_LOG_LIMIT_H_
#define KVC_SERVICE_SERVER_LOG_LIMIT_H_

#include <cstdint>
#include <functional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace kvc::server {

// Admits at most `max_lines` lines per window of `window` (windows start at the first line after
// the previous window ended). The first line admitted after lines were dropped learns how many.
class LogRateLimiter {
 public:
  struct Decision {
    bool admit = false;
    uint64_t suppressed_before = 0;  // lines dropped since the last admitted one (when admitted)
  };

  // Requires max_lines >= 1 and window > 0. `now` is replaceable in tests.
  LogRateLimiter(
      int max_lines, absl::Duration window,
      std::function<absl::Time()> now = [] { return absl::Now(); });

  Decision Admit();

 private:
  const int max_lines_;
  const absl::Duration window_;
  const std::function<absl::Time()> now_;
  absl::Mutex mu_;
  absl::Time window_start_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int in_window_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t suppressed_ ABSL_GUARDED_BY(mu_) = 0;
};

// kvcd's limit on protobuf log lines.
inline constexpr int kProtobufLogLinesPerSecond = 5;

// Replaces protobuf's log handler with one that writes to stderr as protobuf's default does
// ("[libprotobuf LEVEL file:line] message"), but at most `lines_per_second` lines a second; the
// next line written after some were dropped is preceded by one saying how many. FATAL messages are
// always written.
void InstallProtobufLogLimit(int lines_per_second = kProtobufLogLinesPerSecond);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_LOG_LIMIT_H_

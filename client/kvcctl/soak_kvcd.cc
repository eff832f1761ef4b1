#include "soak_kvcd.h"

#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace kvc::soak {

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
  // The caller may close the file once Stop has returned: the destructor's Stop must not touch
  // it again (an hour-long soak with --rss_csv aborted in glibc at exit).
  csv_ = nullptr;
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

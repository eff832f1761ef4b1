#include "testing/kvcd_load.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "testing/kvc_rpc.h"

namespace kvc::testing {
namespace {

int64_t StatusField(pid_t pid, const char* field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  const std::string prefix = std::string(field) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(prefix, 0) != 0) continue;
    long long kib = 0;
    if (std::sscanf(line.c_str() + prefix.size(), " %lld kB", &kib) == 1) return kib * 1024;
  }
  return -1;
}

}  // namespace

double ProcessCpuSeconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // Fields after the command name (which may hold spaces and parentheses): state is field 3,
  // utime and stime fields 14 and 15.
  const size_t close = stat.rfind(')');
  if (close == std::string::npos) return -1;
  std::istringstream rest(stat.substr(close + 2));
  std::string field;
  unsigned long long utime = 0, stime = 0;
  for (int i = 3; i <= 15 && rest >> field; ++i) {
    if (i == 14) utime = std::stoull(field);
    if (i == 15) stime = std::stoull(field);
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

int64_t ResidentBytes(pid_t pid) { return StatusField(pid, "VmRSS"); }
int64_t PeakResidentBytes(pid_t pid) { return StatusField(pid, "VmHWM"); }

double CpuCores(pid_t pid, absl::Duration window) {
  const double c0 = ProcessCpuSeconds(pid);
  const absl::Time t0 = absl::Now();
  absl::SleepFor(window);
  const double c1 = ProcessCpuSeconds(pid);
  return (c1 - c0) / absl::ToDoubleSeconds(absl::Now() - t0);
}

bool WaitForCpu(pid_t pid, double cores, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (CpuCores(pid, absl::Milliseconds(500)) >= cores) return true;
  }
  return false;
}

std::vector<kvcache::v1::PutCacheRequest> HeavyRequests(int seq_len, int window) {
  TestCache cache =
      MakeTestCache("heavy", Shape(1, 2, 16, 128, static_cast<uint32_t>(seq_len), window),
                    kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 17);
  auto* e = cache.header.mutable_compression()->mutable_eviction();
  e->set_policy("kvzip");
  e->set_keep_ratio(0.5);
  return MakeRequests(cache, 1 << 20);
}

std::vector<kvcache::v1::PutCacheRequest> HeavyExpectedRequests(int seq_len) {
  TestCache cache = MakeTestCache("heavy", Shape(1, 2, 64, 256, static_cast<uint32_t>(seq_len), 64),
                                  kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 19);
  auto* e = cache.header.mutable_compression()->mutable_eviction();
  e->set_policy("expected");
  e->set_keep_ratio(0.5);
  cache.header.mutable_rope()->set_theta(10000);
  cache.header.mutable_rope()->set_style(kvcache::v1::ROPE_HALF_SPLIT);
  return MakeRequests(cache, 1 << 20);
}

HeavyUpload::HeavyUpload(kvcache::v1::KvCache::Stub* stub,
                         const std::vector<kvcache::v1::PutCacheRequest>& requests,
                         const std::string& id, absl::Duration timeout) {
  ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  writer_ = stub->PutCache(&ctx_, &response_);
  kvcache::v1::PutCacheRequest header = requests[0];
  header.mutable_header()->set_cache_id(id);
  header.mutable_header()->set_overwrite(true);
  bool ok = writer_->Write(header);
  for (size_t i = 1; ok && i < requests.size(); ++i) ok = writer_->Write(requests[i]);
  writer_->WritesDone();
}

grpc::Status HeavyUpload::Finish() { return writer_->Finish(); }

HeavyLoad::HeavyLoad(kvcache::v1::KvCache::Stub* stub,
                     const std::vector<kvcache::v1::PutCacheRequest>& requests,
                     const std::string& prefix, int clients, int depth)
    : stub_(stub), requests_(requests), prefix_(prefix), depth_(depth) {
  for (int c = 0; c < clients; ++c) threads_.emplace_back([this, c] { Client(c); });
}

void HeavyLoad::Client(int c) {
  std::deque<std::unique_ptr<HeavyUpload>> mine;
  int n = 0;
  while (true) {
    // Top up to `depth` uploads in flight; each sends all its bytes before it is registered.
    while (static_cast<int>(mine.size()) < depth_) {
      {
        absl::MutexLock lock(&mu_);
        if (stop_) break;
      }
      auto up = std::make_unique<HeavyUpload>(
          stub_, requests_, absl::StrCat(prefix_, "/", c, "/", n++));
      absl::MutexLock lock(&mu_);
      in_flight_.push_back(up.get());
      if (stop_) up->Cancel();  // Stop ran while this one was sending
      mine.push_back(std::move(up));
    }
    if (mine.empty()) return;
    const grpc::Status status = mine.front()->Finish();
    absl::MutexLock lock(&mu_);
    in_flight_.erase(std::find(in_flight_.begin(), in_flight_.end(), mine.front().get()));
    mine.pop_front();
    if (status.ok()) {
      ++outcome_.completed;
    } else if (status.error_code() == grpc::StatusCode::CANCELLED && stop_) {
      ++outcome_.cancelled;
    } else {
      outcome_.errors.push_back(absl::StrCat(status.error_code(), ": ", status.error_message()));
      stop_ = true;  // a refused upload would refuse again: stop, and let the test report it
    }
  }
}

HeavyLoad::Outcome HeavyLoad::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    for (HeavyUpload* up : in_flight_) up->Cancel();
  }
  for (auto& t : threads_) t.join();
  threads_.clear();
  absl::MutexLock lock(&mu_);
  return outcome_;
}

}  // namespace kvc::testing

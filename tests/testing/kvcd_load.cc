#include "testing/kvcd_load.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

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

}  // namespace kvc::testing

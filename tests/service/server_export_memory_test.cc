// A DENSE download whose export cannot get its memory ends with RESOURCE_EXHAUSTED, and kvcd
// goes on serving. (The export job's std::bad_alloc used to escape into the thread pool, which
// logged it, and the stream stayed parked on an export that would never finish, holding its
// lease.) Memory is made to run out for real: the test lowers its own address-space limit
// (RLIMIT_AS) just above what the process has mapped, so the export's multi-MiB buffer cannot be
// mapped while everything else the RPC needs still fits. That changes the whole process, so it
// runs in a death-test child (a fresh process, re-executed for this test alone).
#include <sys/resource.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/thread_pool.h"
#include "server/service_impl.h"
#include "testing/kvc_rpc.h"
#include "testing/service_on_loopback.h"

namespace kvc::server {
namespace {

// VmSize of this process in bytes (0 when unreadable).
uint64_t MappedBytes() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmSize:", 0) == 0) return std::stoull(line.substr(7)) << 10;
  }
  return 0;
}

// In the child: a 4-bit cache whose DENSE export needs 16 MiB for each of K and V, fetched
// with less than that left to map. Exits 0 when the download ends with RESOURCE_EXHAUSTED and
// a later GetCache of the same cache is served, else 1 (printing why).
[[noreturn]] void FetchUnderAddressLimit() {
  auto fail = [](const std::string& why) {
    std::fprintf(stderr, "%s\n", why.c_str());
    std::fflush(stderr);
    _exit(1);
  };
  auto backend = CreateCpuBackend(BackendOptions{});
  if (!backend.ok()) fail(backend.status().ToString());
  ThreadPool pool(2);
  testing::ServiceOnLoopback loopback;
  if (!loopback.Start(backend->get(), &pool)) fail("no loopback service");
  auto cache = testing::MakeTestCache("q4", testing::Shape(1, 8, 8, 128, 8192, 0),
                                      kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 3);
  cache.header.mutable_compression()->mutable_quant()->set_bits(4);
  if (grpc::Status s = testing::PutCache(loopback.stub(), cache, nullptr, 1 << 20); !s.ok()) {
    fail("put: " + s.error_message());
  }
  kvcache::v1::GetCacheRequest req;
  req.set_cache_id("q4");
  req.set_format(kvcache::v1::FORMAT_DENSE);
  testing::Fetched warm;  // every thread and buffer the download needs exists now
  if (grpc::Status s = testing::Get(loopback.stub(), req, &warm); !s.ok()) {
    fail("first DENSE get: " + s.error_message());
  }
  const uint64_t mapped = MappedBytes();
  if (mapped == 0) fail("cannot read VmSize");
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) != 0) fail("getrlimit");
  const rlimit before = limit;
  limit.rlim_cur = mapped + (4 << 20);  // room for small allocations, not for the export
  if (setrlimit(RLIMIT_AS, &limit) != 0) fail("setrlimit");
  testing::Fetched got;
  const grpc::Status s = testing::Get(loopback.stub(), req, &got, absl::Seconds(60));
  if (setrlimit(RLIMIT_AS, &before) != 0) fail("setrlimit back");
  if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED) {
    fail("DENSE get under the limit: code " + std::to_string(s.error_code()) + ": " +
         s.error_message());
  }
  if (s.error_message().find("layer 0") == std::string::npos) {
    fail("the error does not name the layer: " + s.error_message());
  }
  testing::Fetched again;  // the service is unharmed and the lease was released
  if (grpc::Status t = testing::Get(loopback.stub(), req, &again); !t.ok()) {
    fail("DENSE get after the limit: " + t.error_message());
  }
  if (again.part(0, kvcache::v1::PART_K) != warm.part(0, kvcache::v1::PART_K)) {
    fail("the keys fetched after the limit differ");
  }
  std::fprintf(stderr, "export refused: %s\n", s.error_message().c_str());
  std::fflush(stderr);
  _exit(0);
}

TEST(ServerExportMemoryDeathTest, AnExportThatCannotAllocateEndsTheStream) {
  // AddressSanitizer maps its own memory for the allocations it serves, which an address-space
  // limit this tight breaks before the export is reached.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "an address-space limit cannot be tested under AddressSanitizer";
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "an address-space limit cannot be tested under AddressSanitizer";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(FetchUnderAddressLimit(), ::testing::ExitedWithCode(0), "export refused");
}

}  // namespace
}  // namespace kvc::server

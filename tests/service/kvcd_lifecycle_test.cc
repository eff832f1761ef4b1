// kvcd as a process: start-up output and --port_file, health on both ports, flag validation
// (exit code 2), and SIGTERM/SIGINT drain: NOT_SERVING, UNAVAILABLE for new calls, in-flight
// uploads complete, bounded shutdown, exit 0; a fault prints a stack trace.
#include <signal.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing::KvcdProcess;

std::unique_ptr<KvcdProcess> StartKvcd(std::vector<std::string> flags) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = std::move(flags);
  auto p = KvcdProcess::Start(opts);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

bool WaitForHealth(const std::string& address, bool serving, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    auto s = testing::HealthServing(address);
    if (s.ok() && *s == serving) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return false;
}

TEST(KvcdLifecycleTest, PrintsAddressesWritesPortFileAndServesHealthOnBothPorts) {
  const std::string port_file = ::testing::TempDir() + "/kvcd_port_" + std::to_string(getpid());
  auto kvcd = StartKvcd({"--port_file=" + port_file});
  ASSERT_NE(kvcd, nullptr);
  EXPECT_THAT(kvcd->address(), ::testing::StartsWith("127.0.0.1:"));
  EXPECT_NE(kvcd->address(), "127.0.0.1:0");
  std::ifstream in(port_file);
  std::string written;
  std::getline(in, written);
  EXPECT_EQ(written, kvcd->address());
  std::remove(port_file.c_str());

  auto main_health = testing::HealthServing(kvcd->address());
  ASSERT_TRUE(main_health.ok()) << main_health.status();
  EXPECT_TRUE(*main_health);
  auto probe_health = testing::HealthServing(kvcd->health_address());
  ASSERT_TRUE(probe_health.ok()) << probe_health.status();
  EXPECT_TRUE(*probe_health);
  // The probe port serves nothing but health.
  auto probe_stub = testing::NewStub(kvcd->health_address());
  grpc::ClientContext ctx;
  kvcache::v1::ServerInfo info;
  EXPECT_EQ(probe_stub->GetServerInfo(&ctx, {}, &info).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  // The real service answers with the configured limits.
  auto stub = testing::NewStub(kvcd->address());
  grpc::ClientContext ctx2;
  ASSERT_TRUE(stub->GetServerInfo(&ctx2, {}, &info).ok());
  EXPECT_TRUE(info.serving());
  EXPECT_EQ(info.limits().store_capacity_bytes(), 64u << 20);  // the helper's default
  EXPECT_EQ(info.limits().max_cache_bytes(), 16u << 20);       // defaults to store / 4
  EXPECT_EQ(info.limits().max_message_bytes(), 8u << 20);
  EXPECT_EQ(info.limits().max_chunk_bytes(), 4u << 20);
  EXPECT_EQ(info.limits().max_concurrent_streams(), 64u);
  EXPECT_THAT(info.eviction_policies(), ::testing::Contains("snapkv"));
  EXPECT_FALSE(info.backend().empty());
}

TEST(KvcdLifecycleTest, InvalidFlagsExitWithCode2AndNameTheFlag) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--store_bytes=12X", "--store_bytes"},
      {"--store_bytes=0", "--store_bytes"},
      {"--buffer_pool_bytes=1Q", "--buffer_pool_bytes"},
      {"--max_chunk_bytes=8MiB", "--max_chunk_bytes"},  // not below --max_message_bytes
      {"--max_message_bytes=100", "--max_message_bytes"},
      {"--max_concurrent_streams=0", "--max_concurrent_streams"},
      {"--backend=tpu", "--backend"},
      {"--listen=localhost", "--listen"},
      {"--threads=-1", "--threads"},
      {"--drain_seconds=-1", "--drain_seconds"},
      {"--threads=abc", "threads"},          // absl cannot parse the value
      {"--no_such_flag=1", "no_such_flag"},  // unknown flag
      {"--auth_tokens_file=/nonexistent/tokens", "--auth_tokens_file"},
  };
  for (const auto& [flag, name] : cases) {
    KvcdProcess::Options opts;
    opts.binary = KVCD_PATH;
    opts.flags = {flag};
    opts.wait_for_ready = false;
    auto p = KvcdProcess::Start(opts);
    ASSERT_TRUE(p.ok()) << p.status();
    auto code = (*p)->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << flag;
    EXPECT_EQ(*code, 2) << flag;
    absl::SleepFor(absl::Milliseconds(20));  // let the reader collect the last output
    EXPECT_THAT((*p)->output(), HasSubstr(name)) << flag;
  }
}

// Asks grpc.reflection.v1alpha for the service list: ServerReflectionRequest{list_services: ""}
// encoded by hand (field 7). Returns the raw response bytes, or the RPC's error.
absl::StatusOr<std::string> ListServicesByReflection(const std::string& address) {
  class Reactor : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    void OnWriteDone(bool) override {}
    void OnReadDone(bool ok) override {
      if (ok) {
        std::vector<grpc::Slice> slices;
        (void)response_.Dump(&slices);
        for (const auto& s : slices)
          bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    void OnDone(const grpc::Status& s) override {
      status = s;
      done.Notify();
    }
    void Go() {
      grpc::Slice slice(std::string("\x3a\x00", 2));
      request_ = grpc::ByteBuffer(&slice, 1);
      StartWriteLast(&request_, grpc::WriteOptions());
      StartRead(&response_);
      StartCall();
    }
    grpc::ByteBuffer request_, response_;
    std::string bytes;
    grpc::Status status;
    absl::Notification done;
  };
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  Reactor reactor;
  stub.PrepareBidiStreamingCall(&ctx,
                                "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                                grpc::StubOptions(), &reactor);
  reactor.Go();
  reactor.done.WaitForNotification();
  if (!reactor.status.ok()) {
    return absl::Status(static_cast<absl::StatusCode>(reactor.status.error_code()),
                        reactor.status.error_message());
  }
  return reactor.bytes;
}

TEST(KvcdLifecycleTest, ReflectionOnlyWhenEnabledAndOnlyOnTheMainPort) {
  auto plain = StartKvcd({});
  ASSERT_NE(plain, nullptr);
  EXPECT_EQ(ListServicesByReflection(plain->address()).status().code(),
            absl::StatusCode::kUnimplemented);
  auto kvcd = StartKvcd({"--enable_reflection"});
  ASSERT_NE(kvcd, nullptr);
  auto list = ListServicesByReflection(kvcd->address());
  ASSERT_TRUE(list.ok()) << list.status();
  EXPECT_THAT(*list, HasSubstr("kvcache.v1.KvCache"));
  EXPECT_THAT(*list, HasSubstr("grpc.health.v1.Health"));
  EXPECT_EQ(ListServicesByReflection(kvcd->health_address()).status().code(),
            absl::StatusCode::kUnimplemented);
}

TEST(KvcdLifecycleTest, AnAddressInUseFailsWithExitCode1) {
  auto first = StartKvcd({});
  ASSERT_NE(first, nullptr);
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = {"--listen=" + first->address()};
  opts.wait_for_ready = false;
  auto second = KvcdProcess::Start(opts);
  ASSERT_TRUE(second.ok()) << second.status();
  auto code = (*second)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 1);
  absl::SleepFor(absl::Milliseconds(20));
  EXPECT_THAT((*second)->output(), HasSubstr("--listen"));
}

TEST(KvcdLifecycleTest, SigtermDrainsInFlightUploadsThenExitsZero) {
  auto kvcd = StartKvcd({"--drain_seconds=10", "--store_bytes=16MiB"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  auto cache = testing::MakeTestCache("drain/a", testing::Shape(2, 2, 2, 32, 128, 0),
                                      kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 1);
  const auto requests = testing::MakeRequests(cache, 4096);
  grpc::ClientContext ctx;
  kvcache::v1::PutCacheResponse resp;
  auto writer = stub->PutCache(&ctx, &resp);
  for (size_t i = 0; i < requests.size() / 2; ++i) ASSERT_TRUE(writer->Write(requests[i]));
  // Signal only once the server has the stream open (the client may still hold it back).
  absl::Status open = testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 1);
  ASSERT_TRUE(open.ok()) << "the upload stream never reached the server: " << open;

  ASSERT_TRUE(kvcd->Signal(SIGTERM).ok());
  EXPECT_TRUE(WaitForHealth(kvcd->health_address(), false, absl::Seconds(5)));
  EXPECT_TRUE(WaitForHealth(kvcd->address(), false, absl::Seconds(5)));
  {
    grpc::ClientContext c;
    kvcache::v1::StatCacheRequest req;
    req.set_cache_id("drain/a");
    kvcache::v1::CacheInfo info;
    EXPECT_EQ(stub->StatCache(&c, req, &info).error_code(), grpc::StatusCode::UNAVAILABLE);
  }
  {
    grpc::Status s = testing::PutCache(
        stub.get(), testing::MakeTestCache("drain/new", testing::Shape(1, 1, 1, 8, 8, 0),
                                           kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 2));
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE) << s.error_message();
  }
  {
    grpc::ClientContext c;
    kvcache::v1::ServerInfo info;
    ASSERT_TRUE(stub->GetServerInfo(&c, {}, &info).ok());
    EXPECT_FALSE(info.serving());
  }
  EXPECT_TRUE(kvcd->running());
  // The in-flight upload still completes.
  for (size_t i = requests.size() / 2; i < requests.size(); ++i) {
    ASSERT_TRUE(writer->Write(requests[i]));
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(resp.input_bytes(), cache.kv_bytes());
  auto code = kvcd->Wait(absl::Seconds(15));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_THAT(kvcd->output(), HasSubstr("draining"));
}

TEST(KvcdLifecycleTest, SigintWithNothingInFlightExitsPromptly) {
  auto kvcd = StartKvcd({"--drain_seconds=30"});
  ASSERT_NE(kvcd, nullptr);
  ASSERT_TRUE(kvcd->Signal(SIGINT).ok());
  // Well before --drain_seconds: draining ends as soon as no stream is open.
  auto code = kvcd->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

// Threads that libraries start before main (OpenBLAS starts its pool when it loads) can receive a
// process-directed SIGTERM; kvcd must still drain and exit 0 however early the signal comes. The
// signal is sent the moment the listening line appears (the probe and metrics ports are off so
// nothing else is waited for; --port_file keeps kvcd busy after that line, as in a deployment),
// many times, since a wrong delivery hits only some runs (about a quarter before the fix).
TEST(KvcdLifecycleTest, SigtermRightAfterStartUpAlwaysDrainsAndExitsZero) {
  constexpr int kRuns = 24;
  const std::string port_file =
      ::testing::TempDir() + "/kvcd_early_sigterm_" + std::to_string(getpid());
  for (int i = 0; i < kRuns; ++i) {
    auto kvcd = StartKvcd(
        {"--health_listen=", "--metrics_listen=", "--threads=4", "--port_file=" + port_file});
    ASSERT_NE(kvcd, nullptr) << "run " << i;
    ASSERT_TRUE(kvcd->Signal(i % 2 == 0 ? SIGTERM : SIGINT).ok()) << "run " << i;
    auto code = kvcd->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << "run " << i << ": " << code.status();
    ASSERT_EQ(*code, 0) << "run " << i << ", output:\n" << kvcd->output();
    // The reader thread may still be collecting the last lines (slow on a loaded machine).
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    while (kvcd->output().find("stopped after") == std::string::npos && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    EXPECT_THAT(kvcd->output(), HasSubstr("draining")) << "run " << i;
    EXPECT_THAT(kvcd->output(), HasSubstr("stopped after")) << "run " << i;
  }
  std::remove(port_file.c_str());
}

// A fault leaves evidence: the signal and a stack trace on stderr, then death by that signal (so
// a supervisor still sees a crash). Sent from outside here; a real fault takes the same handler.
TEST(KvcdLifecycleTest, AFaultPrintsTheSignalAndAStackTraceThenDiesOfIt) {
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
  GTEST_SKIP() << "under AddressSanitizer kvcd keeps ASan's own fault report";
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "under AddressSanitizer kvcd keeps ASan's own fault report";
#endif
  auto kvcd = StartKvcd({"--health_listen=", "--metrics_listen="});
  ASSERT_NE(kvcd, nullptr);
  ASSERT_TRUE(kvcd->Signal(SIGSEGV).ok());
  auto code = kvcd->Wait(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 128 + SIGSEGV) << kvcd->output();
  EXPECT_THAT(kvcd->output(), HasSubstr("*** SIGSEGV received"));
  EXPECT_THAT(kvcd->output(), HasSubstr("PC: @"));
}

TEST(KvcdLifecycleTest, ShutdownIsBoundedWhenAStreamNeverEnds) {
  auto kvcd = StartKvcd({"--drain_seconds=0.5", "--shutdown_deadline_seconds=0.5"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  auto cache = testing::MakeTestCache("stuck/a", testing::Shape(1, 1, 1, 8, 64, 0),
                                      kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 1);
  grpc::ClientContext ctx;
  kvcache::v1::PutCacheResponse resp;
  auto writer = stub->PutCache(&ctx, &resp);
  ASSERT_TRUE(writer->Write(testing::MakeRequests(cache, 64)[0]));
  absl::SleepFor(absl::Milliseconds(100));
  const absl::Time start = absl::Now();
  ASSERT_TRUE(kvcd->Signal(SIGTERM).ok());
  auto code = kvcd->Wait(absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  writer->WritesDone();
  EXPECT_FALSE(writer->Finish().ok());  // the stuck upload was cut off, not stored
}

}  // namespace
}  // namespace kvc

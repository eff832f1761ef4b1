// Compression is cancellable (the hardening review of expected attention, rebuilt as tests against
// a real kvcd): an upload's compression stops within a row block once its client is gone, its
// deadline passed, its cache id was deleted or it ran past --compress_timeout_seconds; SIGTERM
// ends kvcd within --drain_seconds + 5 s whatever the pool is doing; and a client that stops
// answering keepalive pings is dropped within --keepalive_time_seconds +
// --keepalive_timeout_seconds.
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_load.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using testing::KvcdProcess;

std::unique_ptr<KvcdProcess> StartKvcd(std::vector<std::string> flags) {
  KvcdProcess::Options opts;
  // $KVCD_PATH runs the test against another kvcd (e.g. an older one, to measure it).
  opts.binary = std::getenv("KVCD_PATH") != nullptr ? std::getenv("KVCD_PATH") : KVCD_PATH;
  // One compression thread and a work budget that admits Heavy(): its scoring then takes
  // several seconds, whatever the machine's core count, so a 4 s deadline passes during it.
  opts.flags = {"--store_bytes=512MiB", "--stream_idle_seconds=120", "--threads=1",
                "--work_flops_per_byte=65536"};
  opts.flags.insert(opts.flags.end(), flags.begin(), flags.end());
  opts.flags.push_back("--backend=cpu");
  // No AMX scoring (see Heavy()), unless KVC_CPU_ISA already caps kvcd's kernels.
  if (std::getenv("KVC_CPU_ISA") == nullptr) opts.env = {"KVC_CPU_ISA=avx512vnni"};
  auto p = KvcdProcess::Start(opts);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

// One layer of kvzip over 32768 tokens with 8192 rows that each see every key: 9 s of compression
// on kvcd's one thread with fp32 sgemm scoring on an AVX-512 core. AMX scoring (kvc/cpu_isa.h
// level amx) is several times faster, so StartKvcd caps kvcd's kernels below it (unless
// KVC_CPU_ISA already caps them).
const std::vector<pb::PutCacheRequest>& Heavy() {
  static const auto* const requests =
      new std::vector<pb::PutCacheRequest>(testing::HeavyRequests(32768, 8192));
  return *requests;
}

constexpr char kRunning[] = "kvc_compressions_running";

// Waits until kvcd runs no compression (the gauge kvc_compressions_running is 0); returns the
// seconds that took, or -1 when it did not happen within `timeout`.
double SecondsUntilStopped(const KvcdProcess& kvcd, absl::Duration timeout) {
  const absl::Time start = absl::Now();
  if (!testing::WaitForMetric(kvcd.metrics_address(), kRunning, 0, timeout).ok()) return -1;
  return absl::ToDoubleSeconds(absl::Now() - start);
}

class KvcdCancelTest : public ::testing::Test {
 protected:
  void StartLoaded(std::vector<std::string> flags = {}) {
    kvcd_ = StartKvcd(std::move(flags));
    ASSERT_NE(kvcd_, nullptr);
    stub_ = testing::NewStub(kvcd_->address());
  }
  // Starts a heavy upload and waits until kvcd compresses it (and `running` layers in all).
  std::unique_ptr<testing::HeavyUpload> Compressing(const std::string& id,
                                                    absl::Duration timeout = absl::Seconds(600),
                                                    int running = 1) {
    auto up = std::make_unique<testing::HeavyUpload>(stub_.get(), Heavy(), id, timeout);
    EXPECT_TRUE(
        testing::WaitForMetric(kvcd_->metrics_address(), kRunning, running, absl::Seconds(60)).ok())
        << "kvcd never started compressing";
    return up;
  }
  std::unique_ptr<KvcdProcess> kvcd_;
  std::unique_ptr<pb::KvCache::Stub> stub_;
};

TEST_F(KvcdCancelTest, ClientGoneStopsItsCompression) {
  ASSERT_NO_FATAL_FAILURE(StartLoaded());
  auto up = Compressing("gone");
  up->Cancel();
  EXPECT_EQ(up->Finish().error_code(), grpc::StatusCode::CANCELLED);
  const double stopped = SecondsUntilStopped(*kvcd_, absl::Seconds(30));
  std::printf("client gone: compression stopped %.2f s later\n", stopped);
  EXPECT_GE(stopped, 0) << "kvcd kept compressing for a client that is gone";
  EXPECT_TRUE(testing::ViewStore(stub_.get()).ids.empty());
}

TEST_F(KvcdCancelTest, DeadlinePassedStopsItsCompression) {
  ASSERT_NO_FATAL_FAILURE(StartLoaded());
  // The bytes take about a second; the deadline passes while compressing (9 s on one AVX-512 core).
  auto up = Compressing("late", absl::Seconds(4));
  EXPECT_EQ(up->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  const double stopped = SecondsUntilStopped(*kvcd_, absl::Seconds(30));
  std::printf("deadline passed: compression stopped %.2f s later\n", stopped);
  EXPECT_GE(stopped, 0) << "kvcd kept compressing past the client's deadline";
}

TEST_F(KvcdCancelTest, DeletingTheCacheStopsItsUpload) {
  ASSERT_NO_FATAL_FAILURE(StartLoaded());
  auto up = Compressing("doomed");
  grpc::ClientContext ctx;
  pb::DeleteCacheRequest del;
  del.set_cache_id("doomed");
  pb::DeleteCacheResponse resp;
  grpc::Status s = stub_->DeleteCache(&ctx, del, &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();  // nothing was stored yet: 0 bytes freed
  EXPECT_EQ(resp.freed_bytes(), 0u);
  s = up->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(s.error_message(),
            "cache_id: 'doomed' was deleted while its upload was in progress; the upload was "
            "discarded");
  const double stopped = SecondsUntilStopped(*kvcd_, absl::Seconds(30));
  std::printf("cache deleted: compression stopped %.2f s later\n", stopped);
  EXPECT_GE(stopped, 0);
  EXPECT_TRUE(testing::ViewStore(stub_.get()).ids.empty());
  // Deleting an id that is neither stored nor uploading is still NOT_FOUND.
  grpc::ClientContext again;
  EXPECT_EQ(stub_->DeleteCache(&again, del, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(KvcdCancelTest, CompressionPastItsTimeoutIsStopped) {
  ASSERT_NO_FATAL_FAILURE(StartLoaded({"--compress_timeout_seconds=1"}));
  auto up = Compressing("slow");
  grpc::Status s = up->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), HasSubstr("compression ran past --compress_timeout_seconds=1"));
  EXPECT_GE(SecondsUntilStopped(*kvcd_, absl::Seconds(30)), 0);
  EXPECT_TRUE(testing::ViewStore(stub_.get()).ids.empty());
}

// SIGTERM while heavy uploads compress (one client gone, two waiting): kvcd drains for
// --drain_seconds, abandons the compressions and exits within the drain + 5 s.
TEST_F(KvcdCancelTest, SigtermEndsKvcdWithinTheDrainDeadline) {
  constexpr double kDrain = 1;
  ASSERT_NO_FATAL_FAILURE(
      StartLoaded({"--drain_seconds=1", "--staging_bytes=512MiB", "--threads=2"}));
  // Two compress (one job per pool worker, --threads=2), the third waits in the pool's queue.
  std::vector<std::unique_ptr<testing::HeavyUpload>> ups;
  ups.push_back(Compressing("term/0"));
  ups.push_back(Compressing("term/1", absl::Seconds(600), 2));
  ups.push_back(std::make_unique<testing::HeavyUpload>(stub_.get(), Heavy(), "term/2"));
  ups[0]->Cancel();
  std::vector<grpc::Status> status(ups.size());
  std::vector<std::thread> waiters;
  for (size_t i = 0; i < ups.size(); ++i) {
    waiters.emplace_back([&, i] { status[i] = ups[i]->Finish(); });
  }
  const absl::Time start = absl::Now();
  ASSERT_TRUE(kvcd_->Signal(SIGTERM).ok());
  absl::StatusOr<int> code = kvcd_->Wait(absl::Seconds(kDrain + 5));
  const double took = absl::ToDoubleSeconds(absl::Now() - start);
  for (auto& t : waiters) t.join();
  std::printf("SIGTERM with compressions running: kvcd exited after %.2f s\n", took);
  ASSERT_TRUE(code.ok()) << "kvcd still running " << kDrain + 5
                         << " s after SIGTERM: " << kvcd_->output();
  EXPECT_EQ(*code, 0) << kvcd_->output();
  EXPECT_EQ(status[0].error_code(), grpc::StatusCode::CANCELLED);
  for (size_t i = 1; i < ups.size(); ++i) {
    EXPECT_THAT(status[i].error_code(),
                AnyOf(grpc::StatusCode::UNAVAILABLE, grpc::StatusCode::CANCELLED))
        << status[i].error_message();
  }
}

// A TCP relay between a client and kvcd that can freeze: then it reads nothing from either side,
// so kvcd's keepalive pings go unanswered (like a client that stopped, e.g. a paused process)
// while the connection stays open.
class Relay {
 public:
  explicit Relay(int kvcd_port) : kvcd_port_(kvcd_port) {
    listen_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) == 0 &&
        listen(listen_fd_, 1) == 0 &&
        getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port_ = ntohs(addr.sin_port);
    }
    thread_ = std::thread([this] { Loop(); });
  }
  ~Relay() {
    stop_ = true;
    thread_.join();
    for (int fd : {listen_fd_, client_fd_, kvcd_fd_}) {
      if (fd >= 0) close(fd);
    }
  }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  void Freeze() { frozen_ = true; }
  // True once kvcd closed its side of the connection.
  bool kvcd_closed() const { return kvcd_closed_; }

 private:
  void Loop() {
    pollfd lp{listen_fd_, POLLIN, 0};
    while (!stop_ && poll(&lp, 1, 100) <= 0) {
    }
    if (stop_) return;
    client_fd_ = accept(listen_fd_, nullptr, nullptr);
    kvcd_fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(kvcd_port_));
    if (connect(kvcd_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) return;
    char buf[1 << 16];
    while (!stop_) {
      if (frozen_) {
        // Nothing is read; only whether kvcd has closed the connection is watched.
        pollfd p{kvcd_fd_, POLLRDHUP, 0};
        if (poll(&p, 1, 50) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
          kvcd_closed_ = true;
          return;
        }
        continue;
      }
      pollfd fds[2] = {{client_fd_, POLLIN, 0}, {kvcd_fd_, POLLIN, 0}};
      if (poll(fds, 2, 50) <= 0) continue;
      for (int i = 0; i < 2; ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        const ssize_t n = read(fds[i].fd, buf, sizeof(buf));
        if (n <= 0) return;
        const int to = i == 0 ? kvcd_fd_ : client_fd_;
        for (ssize_t off = 0; off < n;) {
          const ssize_t w = write(to, buf + off, static_cast<size_t>(n - off));
          if (w <= 0) return;
          off += w;
        }
      }
    }
  }

  const int kvcd_port_;
  int listen_fd_ = -1, client_fd_ = -1, kvcd_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stop_{false}, frozen_{false}, kvcd_closed_{false};
  std::thread thread_;
};

TEST(KvcdKeepaliveTest, AClientThatStopsAnsweringPingsIsDropped) {
  constexpr double kTime = 1, kTimeout = 1;
  auto kvcd = StartKvcd(
      {"--keepalive_time_seconds=1", "--keepalive_timeout_seconds=1", "--stream_idle_seconds=600"});
  ASSERT_NE(kvcd, nullptr);
  const std::string& address = kvcd->address();
  Relay relay(std::stoi(address.substr(address.rfind(':') + 1)));
  auto stub = testing::NewStub(relay.address());
  // An upload that sent its header and waits: the stream stays open (the idle time is long).
  testing::TestCache cache = testing::MakeTestCache("held", testing::Shape(1, 1, 1, 8, 16, 0),
                                                    pb::DTYPE_F32, pb::LAYOUT_HND, 1);
  grpc::ClientContext ctx;
  pb::PutCacheResponse resp;
  auto writer = stub->PutCache(&ctx, &resp);
  ASSERT_TRUE(writer->Write(testing::MakeRequests(cache, 4096)[0]));
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 1, absl::Seconds(30))
          .ok());
  // While the client answers, keepalive keeps the connection: still open after several pings.
  absl::SleepFor(absl::Seconds(3 * (kTime + kTimeout)));
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 1, absl::Seconds(1))
          .ok());
  EXPECT_FALSE(relay.kvcd_closed());
  relay.Freeze();
  const absl::Time frozen = absl::Now();
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 0, absl::Seconds(30))
          .ok());
  const double dropped = absl::ToDoubleSeconds(absl::Now() - frozen);
  std::printf(
      "a client that stopped answering pings was dropped after %.2f s (documented: "
      "%.0f s + %.0f s)\n",
      dropped, kTime, kTimeout);
  EXPECT_LE(dropped, kTime + kTimeout + 5);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (!relay.kvcd_closed() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(20));
  EXPECT_TRUE(relay.kvcd_closed()) << "kvcd should have closed the connection";
  ctx.TryCancel();
  writer->Finish();
}

}  // namespace
}  // namespace kvc

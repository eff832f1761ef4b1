// PutCache against a server that stops reading mid-upload. The chunks are sent without a copy, so
// PutCache may return only once gRPC's transport let go of them; this holds that it does so about
// the keepalive timeout after the server stopped reading, instead of waiting on the stalled socket
// for ever (TCP_USER_TIMEOUT, set through the channel's keepalive). The stall is a TCP relay
// between client and server that stops reading the client's bytes after the first 48 MiB: the
// relay's kernel keeps acknowledging with a zero window, so the connection looks alive.
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "kvc/client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "testing/kvc_rpc.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;

// Reads and drops every PutCache message until the stream ends or is cancelled.
class DrainService final : public pb::KvCache::Service {
 public:
  grpc::Status PutCache(grpc::ServerContext*, grpc::ServerReader<pb::PutCacheRequest>* reader,
                        pb::PutCacheResponse*) override {
    pb::PutCacheRequest m;
    while (reader->Read(&m)) {
    }
    return grpc::Status(grpc::StatusCode::ABORTED, "drained");
  }
};

// One-connection TCP relay to `port`. Server-to-client bytes always flow; client-to-server bytes
// stop after `pass_bytes`: the relay then no longer reads its client socket. Close() shuts both
// sockets down (it unblocks whatever still waits on them).
class StallingRelay {
 public:
  StallingRelay(int port, size_t pass_bytes) : server_port_(port), pass_bytes_(pass_bytes) {
    listener_ = socket(AF_INET, SOCK_STREAM, 0);
    // A small receive buffer (inherited by the accepted socket): the stall shows after a few
    // hundred KiB instead of the loopback's autotuned megabytes.
    int small = 64 << 10;
    setsockopt(listener_, SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bind(listener_, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    listen(listener_, 4);
    socklen_t len = sizeof(a);
    getsockname(listener_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { Run(); });
  }
  ~StallingRelay() {
    Close();
    thread_.join();
    close(listener_);
  }
  int port() const { return port_; }
  bool stalled() const { return stalled_.load(); }
  void Close() {
    closing_ = true;
    shutdown(listener_, SHUT_RDWR);
  }

 private:
  void Run() {
    pollfd lp{listener_, POLLIN, 0};
    while (!closing_ && poll(&lp, 1, 50) <= 0) {
    }
    if (closing_) return;
    const int c = accept(listener_, nullptr, nullptr);
    if (c < 0) return;
    const int s = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(server_port_));
    if (connect(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
      close(c);
      close(s);
      return;
    }
    std::vector<char> buf(64 << 10);
    size_t passed = 0;
    while (!closing_) {
      pollfd p[2] = {{c, static_cast<short>(passed < pass_bytes_ ? POLLIN : 0), 0}, {s, POLLIN, 0}};
      if (poll(p, 2, 50) <= 0) continue;
      if (p[0].revents & (POLLIN | POLLHUP | POLLERR)) {
        const size_t want = std::min(buf.size(), pass_bytes_ - passed);
        const ssize_t n = read(c, buf.data(), want);
        if (n <= 0 || !WriteAll(s, buf.data(), static_cast<size_t>(n))) break;
        passed += static_cast<size_t>(n);
        if (passed >= pass_bytes_) stalled_ = true;
      }
      if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
        const ssize_t n = read(s, buf.data(), buf.size());
        if (n <= 0 || !WriteAll(c, buf.data(), static_cast<size_t>(n))) break;
      }
    }
    shutdown(c, SHUT_RDWR);
    shutdown(s, SHUT_RDWR);
    close(c);
    close(s);
  }
  static bool WriteAll(int fd, const char* p, size_t n) {
    while (n > 0) {
      const ssize_t w = write(fd, p, n);
      if (w <= 0) return false;
      p += w;
      n -= static_cast<size_t>(w);
    }
    return true;
  }

  const int server_port_;
  const size_t pass_bytes_;
  int listener_ = -1;
  int port_ = 0;
  std::atomic<bool> closing_{false};
  std::atomic<bool> stalled_{false};
  std::thread thread_;
};

class StalledPeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &server_port_);
    b.SetMaxReceiveMessageSize(64 << 20);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
  }
  void TearDown() override { server_->Shutdown(std::chrono::system_clock::now()); }

  DrainService service_;
  int server_port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// TCP_USER_TIMEOUT of this process's TCP sockets connected to `port`, -1 each where unreadable.
std::vector<int> UserTimeoutsTo(int port) {
  std::vector<int> out;
  DIR* d = opendir("/proc/self/fd");
  if (d == nullptr) return out;
  while (dirent* e = readdir(d)) {
    const int fd = atoi(e->d_name);
    if (fd <= 2) continue;
    // gRPC's client sockets are dual-stack: an IPv4 peer shows as ::ffff:127.0.0.1.
    sockaddr_storage peer{};
    socklen_t len = sizeof(peer);
    if (getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &len) != 0) continue;
    int peer_port = -1;
    if (peer.ss_family == AF_INET) {
      peer_port = ntohs(reinterpret_cast<const sockaddr_in*>(&peer)->sin_port);
    } else if (peer.ss_family == AF_INET6) {
      peer_port = ntohs(reinterpret_cast<const sockaddr_in6*>(&peer)->sin6_port);
    }
    if (peer_port != port) continue;
    int v = -1;
    socklen_t vl = sizeof(v);
    if (getsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &v, &vl) != 0) v = -1;
    out.push_back(v);
  }
  closedir(d);
  return out;
}

TEST_F(StalledPeerTest, ChannelsSetTcpUserTimeoutToTheKeepaliveTimeout) {
  ClientOptions o;
  o.target = "127.0.0.1:" + std::to_string(server_port_);
  o.keepalive_timeout = absl::Seconds(3);
  auto c = Client::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  // Any call connects the channel; the fake service answers StatCache with UNIMPLEMENTED.
  EXPECT_EQ((*c)->StatCache("x").status().code(), absl::StatusCode::kUnimplemented);
  const std::vector<int> t = UserTimeoutsTo(server_port_);
  ASSERT_FALSE(t.empty()) << "no connection to the server found in /proc/self/fd";
  for (int v : t) EXPECT_EQ(v, 3000);
}

TEST_F(StalledPeerTest, PutCacheReturnsSoonAfterTheServerStopsReading) {
  StallingRelay relay(server_port_, size_t{48} << 20);
  ClientOptions o;
  o.target = "127.0.0.1:" + std::to_string(relay.port());
  o.stream_timeout = absl::Seconds(30);
  o.keepalive_timeout = absl::Seconds(2);
  o.max_attempts = 1;
  auto c = Client::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  // 2 layers, 8 KV heads x 16384 tokens x 128, fp16: 32 MiB each of K and V. The first 48 MiB
  // pass, so gRPC's flow-control window grows as it does against kvcd, and the client then has
  // more in flight than its socket buffer holds: a write stays on the socket when the relay
  // stops reading (measured: the client socket's send queue stays full, ~4 MiB).
  const testing::TestCache cache = testing::MakeTestCache(
      "stall", testing::Shape(2, 8, 8, 128, 16384, 0), pb::DTYPE_F16, pb::LAYOUT_HND, 1);
  std::vector<LayerTensors> views = {{cache.k[0].data(), cache.v[0].data(), nullptr},
                                     {cache.k[1].data(), cache.v[1].data(), nullptr}};
  const auto start = std::chrono::steady_clock::now();
  auto put = std::async(std::launch::async, [&] { return (*c)->PutCache(cache.header, views); });
  // The stalled write fails the connection 2 s (keepalive_timeout) after the relay stops, long
  // before the 30 s deadline; 60 s leaves a loaded machine ample room. Without TCP_USER_TIMEOUT
  // the deadline ends the call at 30 s and PutCache then waits on the stalled write for ever
  // (checked: this test fails with the channel's keepalive arguments removed).
  const bool returned = put.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_TRUE(relay.stalled()) << "the upload never filled the relay: the test proves nothing";
  if (!returned) relay.Close();  // let the transport fail so the test can end
  const absl::StatusOr<PutResult> r = put.get();
  EXPECT_TRUE(returned) << "PutCache still held the caller's tensors 60 s after it started";
  // UNAVAILABLE when the stalled write failed the connection before the deadline,
  // DEADLINE_EXCEEDED when the deadline came first; never a success.
  EXPECT_TRUE(r.status().code() == absl::StatusCode::kUnavailable ||
              r.status().code() == absl::StatusCode::kDeadlineExceeded)
      << r.status() << " after " << seconds << " s";
}

TEST(ClientOptionsKeepalive, LimitsAreChecked) {
  auto create = [](absl::Duration time, absl::Duration timeout) {
    ClientOptions o;
    o.keepalive_time = time;
    o.keepalive_timeout = timeout;
    return Client::Create(o).status();
  };
  EXPECT_TRUE(create(absl::Seconds(10), absl::Seconds(1)).ok());
  EXPECT_TRUE(create(absl::Hours(2), absl::Minutes(10)).ok());
  for (const auto& [time, timeout, field] :
       {std::tuple{absl::Seconds(9), absl::Seconds(20), "keepalive_time"},
        std::tuple{absl::Hours(2) + absl::Seconds(1), absl::Seconds(20), "keepalive_time"},
        std::tuple{absl::Seconds(30), absl::Milliseconds(999), "keepalive_timeout"},
        std::tuple{absl::Seconds(30), absl::Minutes(10) + absl::Seconds(1), "keepalive_timeout"}}) {
    const absl::Status s = create(time, timeout);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
  }
}

}  // namespace
}  // namespace kvc

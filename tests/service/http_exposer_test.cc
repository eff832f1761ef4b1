// The metrics endpoint against hostile clients: a trickling request or a pile of half-open
// connections must not keep a scraper out, and the whole-request deadline drops slow clients.
#include "metrics/http_exposer.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

int Connect(int port, bool blocking) {
  const int fd = socket(AF_INET, SOCK_STREAM | (blocking ? 0 : SOCK_NONBLOCK), 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  const int rc = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  if (rc != 0 && !(errno == EINPROGRESS && !blocking)) {
    close(fd);
    return -1;
  }
  return fd;
}

// One whole scrape within `limit` (every read waits at most what is left of it); "" on failure.
std::string Scrape(int port, absl::Duration limit,
                   const std::string& request = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n") {
  const absl::Time deadline = absl::Now() + limit;
  const int fd = Connect(port, /*blocking=*/false);
  if (fd < 0) return "";
  std::string response;
  size_t sent = 0;
  bool done = false;
  while (!done && absl::Now() < deadline) {
    pollfd p{fd, static_cast<short>(sent < request.size() ? POLLOUT : POLLIN), 0};
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(deadline - absl::Now())) + 1;
    if (poll(&p, 1, ms) <= 0) continue;
    if (sent < request.size()) {
      const ssize_t w = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (w > 0) sent += static_cast<size_t>(w);
      if (w < 0 && errno != EAGAIN && errno != EINPROGRESS) break;
      continue;
    }
    char buf[4096];
    const ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r > 0) {
      response.append(buf, static_cast<size_t>(r));
    } else if (r == 0 || errno != EAGAIN) {
      done = true;
    }
  }
  close(fd);
  return done ? response : "";
}

std::unique_ptr<HttpExposer> StartExposer() {
  auto e = HttpExposer::Start("127.0.0.1:0", [] { return std::string("kvc_up 1\n"); });
  EXPECT_TRUE(e.ok()) << e.status();
  return e.ok() ? *std::move(e) : nullptr;
}

TEST(HttpExposerTest, ServesMetricsAndRejectsTheRest) {
  auto e = StartExposer();
  ASSERT_NE(e, nullptr);
  const std::string ok = Scrape(e->port(), absl::Seconds(30));
  EXPECT_THAT(ok, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(ok, HasSubstr("\r\n\r\nkvc_up 1\n"));
  EXPECT_THAT(Scrape(e->port(), absl::Seconds(30), "GET /x HTTP/1.0\r\n\r\n"), HasSubstr(" 404 "));
  EXPECT_THAT(Scrape(e->port(), absl::Seconds(30), "PUT /metrics HTTP/1.0\r\n\r\n"),
              HasSubstr(" 405 "));
  EXPECT_THAT(Scrape(e->port(), absl::Seconds(30), "GET /metrics HTTP/2.0\r\n\r\n"),
              HasSubstr(" 400 "));
  EXPECT_THAT(Scrape(e->port(), absl::Seconds(30), "GET /metrics HTTP/1.1\r\nNoColon\r\n\r\n"),
              HasSubstr(" 400 "));
  // HEAD: the headers of GET, no body.
  const std::string head = Scrape(e->port(), absl::Seconds(30), "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_THAT(head, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(head, Not(HasSubstr("kvc_up")));
}

// The old exposer served one connection at a time, with a timeout per read: a client sending a
// byte a second held it (and every scraper) for as long as it liked.
TEST(HttpExposerTest, ATricklingClientDoesNotBlockAScrape) {
  auto e = StartExposer();
  ASSERT_NE(e, nullptr);
  const int slow = Connect(e->port(), /*blocking=*/true);
  ASSERT_GE(slow, 0);
  std::atomic<bool> stop{false};
  std::thread trickle([&] {
    const std::string never_ending = "GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaa";
    for (size_t i = 0; !stop.load(); i = (i + 1) % never_ending.size()) {
      if (send(slow, &never_ending[i], 1, MSG_NOSIGNAL) != 1) break;
      for (int t = 0; t < 10 && !stop.load(); ++t) absl::SleepFor(absl::Milliseconds(100));
    }
  });
  absl::SleepFor(absl::Milliseconds(300));  // the trickler is the first connection
  // Normally milliseconds; generous for a loaded machine, far below the time the trickler takes.
  const std::string r = Scrape(e->port(), absl::Seconds(8));
  stop.store(true);
  trickle.join();
  close(slow);
  EXPECT_THAT(r, HasSubstr("kvc_up 1"));
}

// The old exposer let 66 silent connections fill its one-at-a-time loop and its listen backlog.
TEST(HttpExposerTest, HalfOpenConnectionsDoNotLockScrapersOut) {
  auto e = StartExposer();
  ASSERT_NE(e, nullptr);
  std::vector<int> idle;
  for (int i = 0; i < 100; ++i) {
    const int fd = Connect(e->port(), /*blocking=*/false);
    if (fd >= 0) idle.push_back(fd);
  }
  ASSERT_GE(idle.size(), 66u);
  absl::SleepFor(absl::Milliseconds(300));
  const std::string r = Scrape(e->port(), absl::Seconds(8));
  EXPECT_THAT(r, HasSubstr("kvc_up 1"));
  EXPECT_GT(e->dropped(), 0);  // at the cap (64) the oldest went
  for (int fd : idle) close(fd);
}

TEST(HttpExposerTest, TheDeadlineCoversTheWholeRequest) {
  HttpExposer::Limits limits;
  limits.request_deadline = absl::Seconds(1);
  auto e = HttpExposer::Start(
      "127.0.0.1:0", [] { return std::string("kvc_up 1\n"); }, limits);
  ASSERT_TRUE(e.ok()) << e.status();
  const int slow = Connect((*e)->port(), /*blocking=*/true);
  ASSERT_GE(slow, 0);
  // A byte every 200 ms: each read is quick, but the request never completes. The exposer must
  // close the connection about a second after accepting it.
  const std::string partial = "GET /metrics HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa";
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  bool closed = false;
  for (size_t i = 0; !closed && absl::Now() < give_up; i = (i + 1) % partial.size()) {
    if (send(slow, &partial[i], 1, MSG_NOSIGNAL) != 1) {
      closed = true;
      break;
    }
    pollfd p{slow, POLLIN, 0};
    if (poll(&p, 1, 200) > 0) {
      char c;
      closed = recv(slow, &c, 1, 0) <= 0;
    }
  }
  close(slow);
  EXPECT_TRUE(closed);
  EXPECT_GE((*e)->dropped(), 1);
  EXPECT_THAT(Scrape((*e)->port(), absl::Seconds(30)), HasSubstr("kvc_up 1"));
}

TEST(HttpExposerTest, BadLimitsAreRejected) {
  HttpExposer::Limits limits;
  limits.max_connections = 0;
  EXPECT_FALSE(HttpExposer::Start(
                   "127.0.0.1:0", [] { return std::string(); }, limits)
                   .ok());
}

}  // namespace
}  // namespace kvc

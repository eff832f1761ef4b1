#include "metrics/http_exposer.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "metrics/http_request.h"

namespace kvc {
namespace {

std::string Response(int code, const char* reason, const std::string& content_type,
                     const std::string& body, bool head_only) {
  std::string out =
      absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                   "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  if (!head_only) out += body;
  return out;
}

}  // namespace

struct HttpExposer::Connection {
  int fd = -1;
  absl::Time deadline;
  std::string in;   // the request so far
  std::string out;  // the response, once the request is complete
  size_t sent = 0;  // bytes of `out` written
  bool responding = false;
};

absl::StatusOr<std::unique_ptr<HttpExposer>> HttpExposer::Start(const std::string& address,
                                                                std::function<std::string()> render,
                                                                Limits limits) {
  if (limits.request_deadline <= absl::ZeroDuration() || limits.max_connections < 1) {
    return absl::InvalidArgumentError(
        "metrics exposer: request_deadline and max_connections must be positive");
  }
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': expected host:port"));
  }
  std::string host = address.substr(0, colon);
  const std::string port_text = address.substr(colon + 1);
  int port_number = 0;
  if (!absl::SimpleAtoi(port_text, &port_number) || port_number < 0 || port_number > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': bad port '", port_text, "'"));
  }
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* res = nullptr;
  const int gai = getaddrinfo(host.empty() ? nullptr : host.c_str(), port_text.c_str(), &hints, &res);
  if (gai != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics address '", address, "': ", gai_strerror(gai)));
  }
  int fd = -1;
  std::string last_error = "no address";
  for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 128) == 0) break;
    last_error = std::strerror(errno);
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("metrics address '", address, "': cannot listen: ", last_error));
  }
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len);
  const int port = bound.ss_family == AF_INET6
                       ? ntohs(reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port)
                       : ntohs(reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  return std::unique_ptr<HttpExposer>(new HttpExposer(fd, port, std::move(render), limits));
}

HttpExposer::HttpExposer(int fd, int port, std::function<std::string()> render, Limits limits)
    : listen_fd_(fd), port_(port), render_(std::move(render)), limits_(limits) {
  thread_ = std::thread([this] { Serve(); });
}

HttpExposer::~HttpExposer() {
  stop_.store(true);
  if (thread_.joinable()) thread_.join();
  close(listen_fd_);
}

void HttpExposer::Serve() {
  std::deque<Connection> conns;  // in accept order: the front is the oldest
  std::vector<pollfd> fds;
  while (!stop_.load()) {
    fds.clear();
    fds.push_back({listen_fd_, POLLIN, 0});
    absl::Time next = absl::Now() + absl::Milliseconds(100);  // wake up regularly to see stop_
    for (const Connection& c : conns) {
      fds.push_back({c.fd, static_cast<short>(c.responding ? POLLOUT : POLLIN), 0});
      next = std::min(next, c.deadline);
    }
    const int64_t wait_ms = std::max<int64_t>(0, absl::ToInt64Milliseconds(next - absl::Now()) + 1);
    if (poll(fds.data(), fds.size(), static_cast<int>(wait_ms)) < 0 && errno != EINTR) break;

    const absl::Time now = absl::Now();
    std::deque<Connection> alive;
    for (size_t i = 0; i < conns.size(); ++i) {
      Connection& c = conns[i];
      const short ev = fds[i + 1].revents;
      bool keep = true;
      if (ev != 0) {
        // An exception (memory is out while rendering) drops this connection, not the thread.
        try {
          keep = c.responding ? OnWritable(c) : OnReadable(c);
        } catch (...) {
          keep = false;
          dropped_.fetch_add(1);
        }
      }
      if (keep && now >= c.deadline) {
        keep = false;
        dropped_.fetch_add(1);
      }
      if (keep) {
        alive.push_back(std::move(c));
      } else {
        close(c.fd);
      }
    }
    conns.swap(alive);

    if (fds[0].revents & POLLIN) {
      for (;;) {
        const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) break;  // EAGAIN: none left (or a transient error: poll again)
        if (static_cast<int>(conns.size()) >= limits_.max_connections) {
          // The oldest still sending its request has had the longest to do so: at the cap it
          // goes (a response being written is kept if there is another), so a pile of half-open
          // connections cannot keep a scraper out.
          auto victim = std::find_if(conns.begin(), conns.end(),
                                     [](const Connection& c) { return !c.responding; });
          if (victim == conns.end()) victim = conns.begin();
          close(victim->fd);
          conns.erase(victim);
          dropped_.fetch_add(1);
        }
        Connection c;
        c.fd = fd;
        c.deadline = absl::Now() + limits_.request_deadline;
        conns.push_back(std::move(c));
      }
    }
  }
  for (Connection& c : conns) close(c.fd);
}

bool HttpExposer::OnReadable(Connection& c) {
  char buf[4096];
  for (;;) {
    const ssize_t r = recv(c.fd, buf, sizeof(buf), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (r <= 0) return false;  // closed before a whole request, or broken
    c.in.append(buf, static_cast<size_t>(r));
    if (HttpHeadLength(c.in) != std::string::npos) {
      c.out = Respond(c.in);
    } else if (c.in.size() > kMaxHttpRequestHeadBytes) {
      c.out = Response(431, "Request Header Fields Too Large", "text/plain", "request too large\n",
                       false);
    } else {
      continue;
    }
    c.responding = true;
    c.in.clear();
    return OnWritable(c);
  }
}

bool HttpExposer::OnWritable(Connection& c) {
  while (c.sent < c.out.size()) {
    const ssize_t w = send(c.fd, c.out.data() + c.sent, c.out.size() - c.sent, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return true;
    if (w <= 0) return false;
    c.sent += static_cast<size_t>(w);
  }
  return false;  // all written: Connection: close
}

std::string HttpExposer::Respond(const std::string& head) {
  absl::StatusOr<HttpRequest> r = ParseHttpRequest(head);
  if (!r.ok()) {
    return Response(400, "Bad Request", "text/plain", absl::StrCat(r.status().message(), "\n"),
                    false);
  }
  const bool head_only = r->method == "HEAD";
  if (r->method != "GET" && !head_only) {
    return Response(405, "Method Not Allowed", "text/plain", "only GET and HEAD\n", false);
  }
  if (r->path != "/metrics") {
    return Response(404, "Not Found", "text/plain", "metrics are at /metrics\n", head_only);
  }
  return Response(200, "OK", "text/plain; version=0.0.4; charset=utf-8", render_(), head_only);
}

}  // namespace kvc

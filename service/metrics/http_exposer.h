// A minimal HTTP/1.1 server for Prometheus scrapes: GET /metrics answers the text exposition of a
// prometheus-cpp registry; every other path is 404, every other method 405, a malformed request
// 400 (metrics/http_request.h parses it).
//
// Why not prometheus::Exposer: the civetweb 1.15 that Debian 12 ships reads an uninitialized path
// buffer in its authorization check for callback-handled URIs (open_auth_file), which crashed
// kvcd on the first scrape in some link configurations (seen with OpenBLAS + the CUDA runtime in
// the same binary). Serving one read-only endpoint needs none of civetweb's features.
//
// One thread multiplexes every connection with poll() on non-blocking sockets, so a slow or
// silent client never delays another's scrape. Each connection gets `request_deadline` in all,
// from accept to the last byte of the response (not per read): a client trickling its request or
// not reading the response is dropped then. At most `max_connections` are open; accepting one
// more drops the oldest that has not sent a whole request (else the oldest), so half-open
// connections cannot lock scrapers out.
//
// Thread-safety: Start/destruction from one thread; scrapes run on the exposer's own thread
// (`render` is called there).
#ifndef KVC_SERVICE_METRICS_HTTP_EXPOSER_H_
#define KVC_SERVICE_METRICS_HTTP_EXPOSER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace kvc {

class HttpExposer {
 public:
  struct Limits {
    absl::Duration request_deadline = absl::Seconds(10);  // per connection, in all
    int max_connections = 64;                             // open at once; >= 1
  };

  // Binds host:port ("127.0.0.1:9464", "[::1]:0"; port 0 picks a free port) and starts serving;
  // `render` produces the exposition text for each scrape. UNAVAILABLE when the address cannot be
  // bound, INVALID_ARGUMENT when it does not parse or a limit is not positive.
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(const std::string& address,
                                                            std::function<std::string()> render,
                                                            Limits limits);
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(const std::string& address,
                                                            std::function<std::string()> render) {
    return Start(address, std::move(render), Limits());
  }
  ~HttpExposer();  // stops serving, closes every connection and joins the thread
  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;

  int port() const { return port_; }
  // Connections dropped at the deadline or to make room for a new one (for tests and logs).
  int dropped() const { return dropped_.load(); }

 private:
  struct Connection;
  HttpExposer(int fd, int port, std::function<std::string()> render, Limits limits);
  void Serve();
  // Reads what `c` sent; once its head is complete, fills its response. False: close it.
  bool OnReadable(Connection& c);
  // Writes what the socket takes. False: close it (written out, or broken).
  bool OnWritable(Connection& c);
  std::string Respond(const std::string& head);

  int listen_fd_;
  int port_;
  std::function<std::string()> render_;
  const Limits limits_;
  std::atomic<bool> stop_{false};
  std::atomic<int> dropped_{0};
  std::thread thread_;
};

}  // namespace kvc

#endif  // KVC_SERVICE_METRICS_HTTP_EXPOSER_H_

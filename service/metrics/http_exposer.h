// A minimal HTTP/1.1 server for Prometheus scrapes: GET /metrics answers the text exposition of a
// prometheus-cpp registry; every other path is 404, every other method 405.
//
// Why not prometheus::Exposer: the civetweb 1.15 that Debian 12 ships reads an uninitialized path
// buffer in its authorization check for callback-handled URIs (open_auth_file), which crashed
// kvcd on the first scrape in some link configurations (seen with OpenBLAS + the CUDA runtime in
// the same binary). Serving one read-only endpoint needs none of civetweb's features.
//
// Thread-safety: Start/Stop from one thread; scrapes run on the exposer's own thread.
#ifndef KVC_SERVICE_METRICS_HTTP_EXPOSER_H_
#define KVC_SERVICE_METRICS_HTTP_EXPOSER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/statusor.h"

namespace kvc {

class HttpExposer {
 public:
  // Binds host:port ("127.0.0.1:9464", "[::1]:0"; port 0 picks a free port) and starts serving;
  // `render` produces the exposition text for each scrape. UNAVAILABLE when the address cannot be
  // bound, INVALID_ARGUMENT when it does not parse.
  static absl::StatusOr<std::unique_ptr<HttpExposer>> Start(const std::string& address,
                                                           std::function<std::string()> render);
  ~HttpExposer();  // stops serving and joins the thread
  HttpExposer(const HttpExposer&) = delete;
  HttpExposer& operator=(const HttpExposer&) = delete;

  int port() const { return port_; }

 private:
  HttpExposer(int fd, int port, std::function<std::string()> render);
  void Serve();
  void HandleConnection(int fd);

  int listen_fd_;
  int port_;
  std::function<std::string()> render_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvc

#endif  // KVC_SERVICE_METRICS_HTTP_EXPOSER_H_

// KvcServer: kvcd assembled — engine backend, cache store, metrics exposer, compression pool, the
// KvCache gRPC service with grpc.health.v1 (and reflection when enabled) on the main port, a
// plaintext health-only port, and a periodic TTL sweep.
//
// Extra gRPC services (e.g. the NCCL transfer service) are added through
// Options::extra_services: each factory gets the server's resources and returns a service to
// register on the main port; the server owns it.
//
// Lifecycle: Create -> (serve) -> Drain -> Shutdown; the destructor shuts down if needed.
// Thread-safety: Drain/Shutdown may be called from any one thread (e.g. a signal-waiting thread).
#ifndef KVC_SERVICE_SERVER_SERVER_H_
#define KVC_SERVICE_SERVER_SERVER_H_

#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"
#include "kvc/metrics.h"
#include "kvc/thread_pool.h"
#include "server/config.h"
#include "server/service_impl.h"
#include "server/stream_guard.h"
#include "server/tls_files.h"
#include "server/upload_table.h"

namespace kvc::server {

// What an extra service may use; valid for the server's lifetime.
struct ServerResources {
  const ServerConfig* config;
  Backend* backend;
  CacheStore* store;
  Metrics* metrics;
  ServiceState* state;  // e.g. to set nccl_available
};

using ServiceFactory =
    std::function<absl::StatusOr<std::unique_ptr<grpc::Service>>(const ServerResources&)>;

class KvcServer {
 public:
  struct Options {
    ServerConfig config;
    std::string version = "0.1.0";
    std::vector<ServiceFactory> extra_services;
  };

  // Validates the config, builds everything and starts serving. INVALID_ARGUMENT for bad
  // configuration, UNAVAILABLE when an address cannot be bound or the backend is missing.
  static absl::StatusOr<std::unique_ptr<KvcServer>> Create(Options options);
  ~KvcServer();
  KvcServer(const KvcServer&) = delete;
  KvcServer& operator=(const KvcServer&) = delete;

  const std::string& address() const { return address_; }                  // host:port bound
  const std::string& health_address() const { return health_address_; }    // "" when disabled
  const std::string& metrics_address() const { return metrics_address_; }  // "" when disabled

  // Health -> NOT_SERVING on both ports, new RPCs -> UNAVAILABLE, then waits up to
  // --drain_seconds for in-flight streams to end.
  void Drain();
  // Stops the uploads still in flight (their compression is cancelled and their streams end
  // UNAVAILABLE), shuts the gRPC servers down (other in-flight calls get until
  // --shutdown_deadline_seconds), stops the sweep and joins the pools. A compression that has not
  // stopped kAbandonAfter after that (one long step that checks no cancellation, e.g. a device
  // kernel) is abandoned: the pools and everything their jobs use are leaked instead of destroyed
  // under them, and abandoned() is true; the process should then exit at once. Idempotent.
  void Shutdown();
  static constexpr absl::Duration kAbandonAfter = absl::Seconds(2);
  bool abandoned() const { return abandoned_; }

 private:
  KvcServer() = default;
  void SweepLoop();

  Options options_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<CacheStore> store_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<ThreadPool> pool_;     // compression jobs (niced)
  std::unique_ptr<ThreadPool> io_pool_;  // cheap jobs clients wait on
  std::unique_ptr<UploadTable> uploads_;
  std::unique_ptr<TokenAuth> auth_;
  std::unique_ptr<TlsFiles> tls_;  // null without TLS
  std::unique_ptr<StreamReaper> reaper_;
  std::unique_ptr<PeerStreams> peer_streams_;
  std::unique_ptr<StagingBudget> staging_budget_;
  std::unique_ptr<ServiceState> state_;
  std::unique_ptr<KvCacheServiceImpl> service_;
  std::vector<std::unique_ptr<grpc::Service>> extra_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<grpc::CallbackGenericService> probe_only_;  // UNIMPLEMENTED for all but health
  std::unique_ptr<grpc::Server> health_server_;
  std::string address_, health_address_, metrics_address_;
  absl::Notification stop_sweep_;
  std::thread sweeper_;
  bool shut_down_ = false;
  bool abandoned_ = false;
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_SERVER_H_

// Metrics: kvcd's Prometheus metrics behind small typed methods, so the server never touches
// prometheus-cpp types. Owns the registry and, optionally, an HTTP endpoint serving GET /metrics
// (text format 0.0.4) from its own thread.
//
// Families (DESIGN.md "Metrics"; base units):
//   grpc_server_started_total{grpc_method}                counter
//   grpc_server_handled_total{grpc_method,grpc_code}      counter
//   grpc_server_handling_seconds{grpc_method}             histogram, 100us .. 60s
//   kvc_ingest_bytes_total, kvc_served_bytes_total        counters
//   kvc_compress_duration_seconds{stage}                  histogram; score|select|pack|quantize|total
//   kvc_compression_ratio                                 histogram, 1 .. 64
//   kvc_store_used_bytes, kvc_store_capacity_bytes, kvc_store_entries     gauges
//   kvc_evictions_total{reason}                           counter; capacity|ttl|overwrite|deleted
//   kvc_rejected_requests_total{reason}                   counter; see RejectionReasonName
//   kvc_gpu_memory_used_bytes, kvc_active_streams          gauges
//   kvc_buffer_pool_idle_bytes, kvc_buffer_pool_capacity_bytes  gauges;
//   kvc_buffer_pool_requests_total{result}                counter; reused|mapped
//   kvc_staging_reserved_bytes, kvc_staging_capacity_bytes  gauges: the --staging_bytes budget
//   kvc_compressions_running                              gauge: layer compressions in progress
//   kvc_build_info{version,backend}                       gauge, always 1
// Series for the KvCache service's methods (with every gRPC code), the stages and the reasons
// exist from the start with value 0. Other method names are accepted and get series on first use.
//
// Thread-safety: every method may be called concurrently.
#ifndef KVC_METRICS_H_
#define KVC_METRICS_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status_code_enum.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"

namespace prometheus {
class Registry;
}  // namespace prometheus

namespace kvc {

enum class CompressStage { kScore, kSelect, kPack, kQuantize, kTotal };
const char* CompressStageName(CompressStage s);  // "score", "select", ...

// Why a request was refused before doing its work.
enum class RejectionReason {
  kInvalidArgument,   // "invalid_argument": bad header, shape, dtype, spec
  kTooLarge,          // "too_large": over max message size or max bytes per cache
  kBudget,            // "budget": the store cannot make room
  kLimit,             // "limit": too many concurrent streams
  kDraining,          // "draining": shutting down
  kUnauthenticated,   // "unauthenticated": missing or unknown token
  kPermissionDenied,  // "permission_denied": tenant may not touch the cache
  kStreamIdle,        // "stream_idle": no bytes moved for --stream_idle_seconds; stream ended
  kPeerStreams,       // "peer_streams": the peer (or tenant) holds --max_streams_per_peer
  kStaging,           // "staging": the upload's declared bytes exceed the free --staging_bytes
  kWork,              // "work": the spec's work is over the upload's budget (--work_*)
};
const char* RejectionReasonName(RejectionReason r);

class Metrics {
 public:
  struct Options {
    // host:port for the HTTP exposer ("[::1]:9464" for IPv6; port 0 picks a free one); "" serves
    // nothing (the registry still works, e.g. for Scrape()).
    std::string listen_address = "127.0.0.1:9464";
    // Initial kvc_build_info labels (SetBuildInfo replaces them, e.g. once the backend is known).
    std::string version = "unknown";
    std::string backend = "unknown";
  };

  // Builds every family and starts the HTTP endpoint. INVALID_ARGUMENT for a malformed
  // listen_address, UNAVAILABLE when it cannot be bound (e.g. the port is in use); never throws.
  static absl::StatusOr<std::unique_ptr<Metrics>> Create(const Options& options);
  ~Metrics();
  Metrics(const Metrics&) = delete;
  Metrics& operator=(const Metrics&) = delete;

  // The port the exposer listens on (useful with port 0), or 0 without an exposer.
  int port() const;

  // One RPC started / finished: `method` is the bare method name ("PutCache").
  void RecordRpcStarted(absl::string_view method);
  void RecordRpc(absl::string_view method, absl::StatusCode code, double seconds);
  void RecordRpc(absl::string_view method, grpc::StatusCode code, double seconds);

  void AddIngestBytes(uint64_t bytes);
  void AddServedBytes(uint64_t bytes);
  void ObserveCompress(CompressStage stage, double seconds);
  void ObserveCompressTimings(const CompressTimings& t);  // all five stages
  void ObserveCompressionRatio(double ratio);             // input bytes / stored bytes

  void SetStoreStats(const CacheStore::Stats& stats);
  void RecordEviction(EvictionReason reason);
  void RecordRejection(RejectionReason reason);

  void SetGpuMemoryUsed(uint64_t bytes);
  // The buffer pool (kvc/buffer_pool.h): idle bytes and cap as gauges; `reused` and `mapped` are
  // the pool's running totals of requests, exported as kvc_buffer_pool_requests_total{result}.
  void SetBufferPoolStats(uint64_t idle_bytes, uint64_t cap_bytes, uint64_t reused,
                          uint64_t mapped);
  // The upload staging budget (--staging_bytes): bytes reserved by uploads in flight and the cap.
  void SetStagingStats(uint64_t reserved_bytes, uint64_t capacity_bytes);
  void StreamStarted();   // kvc_active_streams + 1
  void StreamFinished();  // kvc_active_streams - 1
  // kvc_compressions_running + delta: layer compression jobs running in the engine.
  void AddCompressionsRunning(int delta);
  // Replaces the kvc_build_info series (only one exists at a time).
  void SetBuildInfo(const std::string& version, const std::string& backend);

  // The current text exposition (format 0.0.4), as served on /metrics.
  std::string Scrape() const;

  // The registry, for registering further collectables (e.g. in tests).
  std::shared_ptr<prometheus::Registry> registry() const;

 private:
  struct Impl;
  explicit Metrics(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvc

#endif  // KVC_METRICS_H_

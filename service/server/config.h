// kvcd's runtime configuration: every limit and address the daemon takes from its flags, with
// parsing of byte sizes and validation. Flags are declared in kvcd_main.cc; this struct is what
// the server code sees, so tests and embedders can build one directly.
#ifndef KVC_SERVICE_SERVER_CONFIG_H_
#define KVC_SERVICE_SERVER_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvc::server {

struct ServerConfig {
  std::string listen = "127.0.0.1:50051";         // host:port; port 0 picks a free port
  std::string health_listen = "127.0.0.1:50052";  // plaintext health-only port; "" disables
  std::string metrics_listen = "127.0.0.1:9464";  // Prometheus exposer; "" disables
  std::string port_file;                          // if set, the bound address is written here
  uint64_t store_bytes = uint64_t{1} << 30;
  uint32_t default_ttl_seconds = 0;  // 0 = entries never expire
  uint64_t max_message_bytes = 8ull << 20;
  uint64_t max_chunk_bytes = 4ull << 20;
  uint64_t max_cache_bytes = 0;  // 0 = a quarter of the store (EffectiveMaxCacheBytes)
  // Bytes all uploads in flight may stage: each upload reserves its declared K + V + Q_obs bytes
  // at its header and gives them back when it ends. 0 = max(store / 2, max cache bytes)
  // (EffectiveStagingBytes).
  uint64_t staging_bytes = 0;
  uint32_t max_concurrent_streams = 64;
  // Streams one peer may hold at once (the tenant with --auth_tokens_file, else the client's
  // address without its port). 0 = max(1, max_concurrent_streams / 4) (EffectiveStreamsPerPeer).
  uint32_t max_streams_per_peer = 0;
  // A stream that moves no bytes for this long ends with DEADLINE_EXCEEDED and frees its slot,
  // staging and lease: a PutCache waiting for the client's next message, a GetCache whose write
  // the client does not take. (0, 86400].
  double stream_idle_seconds = 10;
  // Idle large buffers (upload staging, freed compact blobs) kept for reuse by the process-wide
  // pool (kvc/buffer_pool.h); 0 disables reuse.
  uint64_t buffer_pool_bytes = 512ull << 20;
  std::string backend = "auto";  // auto | cpu | cuda
  int threads = 0;               // engine and compression pool threads; 0 = hardware concurrency
  // The CPU engine's scoring logits (kvc/layer.h ScoringMath): exact | integer.
  std::string scoring_math = "exact";
  // On SIGTERM, how long in-flight streams may take to end on their own; then uploads still
  // compressing are stopped (their compression abandoned) and the server shuts down.
  double drain_seconds = 5;
  double shutdown_deadline_seconds = 10;
  // The work budget of one upload (kvc/cost.h, server/ingest.h IngestLimits): its spec may cost
  // at most work_flops_per_byte * upload bytes + work_base_flops flops and
  // work_scratch_per_byte * upload bytes + work_base_scratch_bytes of engine scratch (reserved
  // from --staging_bytes with the upload). > 0 each (base scratch >= 0).
  double work_flops_per_byte = 8192;
  double work_base_flops = 1e9;
  double work_scratch_per_byte = 4;
  uint64_t work_base_scratch_bytes = 64ull << 20;
  // An upload whose compression has run this long (from its first layer's start) is stopped with
  // DEADLINE_EXCEEDED: the stream lifetime that covers compression. (0, 86400].
  double compress_timeout_seconds = 300;
  // Nice value added to the compression threads (Linux): RPC threads win the CPU over them, so
  // plain uploads and downloads keep their speed while a heavy spec compresses. [0, 19].
  int compress_nice = 10;
  // gRPC keepalive on the main port: a connection silent for keepalive_time_seconds is pinged,
  // and dropped (its streams cancelled) when the ping is not answered within
  // keepalive_timeout_seconds. [1, 86400] each.
  double keepalive_time_seconds = 60;
  double keepalive_timeout_seconds = 20;
  double ttl_sweep_seconds = 1;  // period of the TTL sweep and store gauge refresh
  bool enable_reflection = false;
  std::string auth_tokens_file;  // "TOKEN TENANT" lines; empty = no authentication (server/auth.h)
  // TLS on the main gRPC port (the health-only port stays plaintext for probes). PEM files,
  // checked at start. Cert and key: both or neither. Client CA: requires and verifies client
  // certificates signed by it (mutual TLS); needs cert and key.
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_client_ca_file;
  // Seconds between re-reads of the three files (certificate rotation: new connections get the
  // new files; open ones keep theirs). 0 = read once at start. [0, 86400].
  int tls_reload_seconds = 60;
};

// Parses "1073741824", "512K", "64MiB", "1G", "1GiB", "4KB" (K/M/G/T are powers of 1024, with
// or without "i"/"B"). INVALID_ARGUMENT naming `field` otherwise.
absl::StatusOr<uint64_t> ParseByteSize(const std::string& field, const std::string& text);

// Checks every field for consistency (addresses look like host:port, limits positive, chunk <=
// message, ...). The message names the offending flag.
absl::Status ValidateConfig(const ServerConfig& config);

// max_cache_bytes with the default resolved (a quarter of the store when 0, at least 1 byte).
inline uint64_t EffectiveMaxCacheBytes(const ServerConfig& c) {
  if (c.max_cache_bytes != 0) return c.max_cache_bytes;
  return c.store_bytes / 4 > 0 ? c.store_bytes / 4 : 1;
}

// staging_bytes with the default resolved: max(store / 2, EffectiveMaxCacheBytes) when 0.
inline uint64_t EffectiveStagingBytes(const ServerConfig& c) {
  if (c.staging_bytes != 0) return c.staging_bytes;
  const uint64_t max_cache = EffectiveMaxCacheBytes(c);
  return c.store_bytes / 2 > max_cache ? c.store_bytes / 2 : max_cache;
}

// threads with the default resolved: hardware concurrency (at least 1) when 0.
int EffectiveThreads(const ServerConfig& c);

// max_streams_per_peer with the default resolved: max(1, max_concurrent_streams / 4) when 0.
inline uint32_t EffectiveStreamsPerPeer(const ServerConfig& c) {
  if (c.max_streams_per_peer != 0) return c.max_streams_per_peer;
  return c.max_concurrent_streams / 4 > 0 ? c.max_concurrent_streams / 4 : 1;
}

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_CONFIG_H_

// kvc::Client: the C++ client of kvcd, for prefill workers (PutCache) and decode workers
// (GetCache). Bulk bytes go through raw gRPC byte buffers: uploads wrap the caller's tensor memory
// without copying it, downloads copy each payload byte exactly once, into the result.
//
// Replicas. `ClientOptions::target` names one server or a set of replicas:
//   "host:port"                  one server (any gRPC target string that is not "dns:///" works)
//   "a:port,b:port,c:port"       a fixed list of replicas
//   "dns:///name:port"           every address `name` resolves to (getaddrinfo), e.g. a Kubernetes
//                                headless Service; each address is one replica "ip:port"
// With several replicas, each cache id lives on the replica chosen by rendezvous hashing
// (kvc/replicas.h), so every client given the same replica set agrees on where a cache lives.
// PutCache, GetCache, StatCache and DeleteCache go to the owner; ListCaches fans out to every
// replica; GetServerInfo asks one. A replica that is down yields UNAVAILABLE for its own caches;
// the other replicas keep serving. The replica set is fixed when the client is created.
//
// Retries. Idempotent unary calls (StatCache, DeleteCache, ListCaches, GetServerInfo) are retried
// up to `max_attempts` times, with exponential backoff, on UNAVAILABLE (the request did not reach
// a serving server, or the connection broke) and on RESOURCE_EXHAUSTED (a server limit such as
// max concurrent streams; retrying after a backoff is safe for these calls). DEADLINE_EXCEEDED is
// never retried: the deadline covers the call with all its attempts. GetCache is retried on
// UNAVAILABLE only while nothing has been delivered to the caller. PutCache is never retried (the
// caller decides; with overwrite=false a retry may answer ALREADY_EXISTS). A DeleteCache whose
// first attempt reached the server but lost its answer can answer NOT_FOUND on the retry.
//
// Errors are absl::Status with the gRPC code carried over one to one and the server's message
// kept; client-side validation answers INVALID_ARGUMENT naming the offending field.
//
// Thread-safety: a Client is thread-safe; share one per process (each replica has one channel,
// and gRPC multiplexes concurrent calls on it).
#ifndef KVC_CLIENT_H_
#define KVC_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/optional.h"
#include "absl/types/span.h"
#include "kvc/bytes.h"
#include "kvc/protocol/status.h"
#include "kvcache/v1/kvcache.pb.h"

namespace grpc {
class Status;
}  // namespace grpc

namespace kvc {

// The wire messages are the result types: they carry every field the server reports.
using PutResult = kvcache::v1::PutCacheResponse;
using CacheInfo = kvcache::v1::CacheInfo;
using ServerInfo = kvcache::v1::ServerInfo;
using PutHeader = kvcache::v1::PutCacheHeader;

inline constexpr size_t kMinChunkBytes = size_t{1} << 20;  // 1 MiB
inline constexpr size_t kMaxChunkBytes = size_t{4} << 20;  // 4 MiB
inline constexpr size_t kDefaultChunkBytes = kMaxChunkBytes;

struct ClientOptions {
  std::string target = "127.0.0.1:50051";  // see the file comment for the accepted forms
  // Deadline of each unary call (all attempts together) and of each PutCache/GetCache stream.
  absl::Duration unary_timeout = absl::Seconds(10);
  absl::Duration stream_timeout = absl::Minutes(5);
  int max_attempts = 3;  // idempotent unary calls; 1 = no retry; [1, 10]
  absl::Duration initial_backoff = absl::Milliseconds(50);
  absl::Duration max_backoff = absl::Seconds(1);
  // Keepalive of every channel: during a call the client pings a connection silent for
  // keepalive_time, and the connection is dropped when a ping, or data already written to the
  // socket, stays unacknowledged for keepalive_timeout (gRPC sets the socket's TCP_USER_TIMEOUT
  // to it). A server that vanished or stopped reading is found within keepalive_timeout, which
  // also bounds how long PutCache waits after its stream ended for the transport to let go of the
  // caller's tensors. keepalive_time in [10 s, 2 h] (kvcd answers pings more frequent than every
  // 10 s with GOAWAY), keepalive_timeout in [1 s, 10 min].
  absl::Duration keepalive_time = absl::Seconds(30);
  absl::Duration keepalive_timeout = absl::Seconds(20);
  // Largest `data` payload per PutCache message, in [kMinChunkBytes, kMaxChunkBytes]. It must not
  // exceed the server's Limits.max_chunk_bytes (GetServerInfo).
  size_t max_chunk_bytes = kDefaultChunkBytes;
  // Sent as "authorization: Bearer <token>" on every call when not empty.
  std::string bearer_token;
  // Largest message the channel accepts and sends (GRPC_ARG_MAX_{RECEIVE,SEND}_MESSAGE_LENGTH);
  // must exceed the server's max_chunk_bytes plus a small header. [kMaxChunkBytes + 4096, 1 GiB].
  int max_message_bytes = 16 << 20;
  // TLS to every replica. The PEM files are read once by Client::Create.
  bool tls = false;
  std::string tls_ca_file;    // roots that verify the server; empty = the system roots
  std::string tls_cert_file;  // client certificate for mutual TLS; needs tls_key_file
  std::string tls_key_file;   // its private key; needs tls_cert_file
  // Name checked against the server certificate instead of the target host (e.g. when the target
  // is an IP the certificate does not list). Empty = the target host.
  std::string tls_server_name_override;
  // Fetched layers are ByteVectors; freed large ones are kept for the next fetch (no page faults,
  // no kernel zeroing) by the process-wide buffer pool (kvc/buffer_pool.h). Create raises the
  // pool's cap to this if it is lower (it never lowers a cap the application set); 0 leaves it.
  uint64_t buffer_pool_bytes = uint64_t{512} << 20;
};

// One layer's tensors for PutCache, in host memory, laid out as PutHeader.layout says (HND:
// K, V [Hkv, S, D], Q_obs [Hq, W, D]) in PutHeader.dtype. The memory must stay valid and
// unchanged until PutCache returns (it is sent without being copied). q_obs may be null only
// when shape.obs_window == 0. q_stats: with header.compression.eviction.query_stats (the
// "expected" policy), the layer's query statistics, float32 [Hq, D + D * D] whatever the dtype:
// per query head the mean of its un-rotated (pre-RoPE) queries, then their covariance row-major
// (see TENSOR_Q_STATS in kvcache.proto); the header then also needs `rope`. Null otherwise.
struct LayerTensors {
  const void* k = nullptr;
  const void* v = nullptr;
  const void* q_obs = nullptr;
  const float* q_stats = nullptr;
};

enum class CacheFormat { kPacked, kDense };

struct GetOptions {
  CacheFormat format = CacheFormat::kPacked;
  uint32_t layer_begin = 0;
  absl::optional<uint32_t> layer_end;  // one past the last layer; default: all layers
  // With kDense: the engine-ready export (FORMAT_DENSE_CONTIGUOUS), keys re-rotated under this
  // RoPE so kept token j goes in slot j of a plain cache and decoding continues at position
  // kept_tokens (positions still holds the original positions). See kvcache.proto.
  absl::optional<kvcache::v1::RopeSpec> contiguous_rope;
};

// One layer of a fetched cache. PACKED: `packed` is the layer's compact blob (parse it with
// kvc::CompactLayerView::Parse). DENSE: `k`, `v` are [Hkv, kept_tokens, D] in the cache's dtype
// with pruned channels zero-filled, `positions` is [Hkv, kept_tokens] original token positions.
// With head-adaptive budgets heads keep different counts: head h's real rows are its first
// counts[h], the rest (up to kept_tokens, the largest count) are zero rows with position -1.
// Byte parts are ByteVectors (kvc/bytes.h): large ones are huge-page mappings, recycled when the
// process gives the buffer pool a cap (kvc::LargeBuffers().set_cap, kvc/buffer_pool.h).
struct LayerData {
  uint32_t layer = 0;
  uint32_t kept_tokens = 0;
  ByteVector packed;
  ByteVector k;
  ByteVector v;
  std::vector<int32_t> positions;
  std::vector<uint32_t> counts;  // DENSE: [Hkv] real rows per head (all kept_tokens if uniform)
};

struct CacheData {
  CacheInfo info;
  std::vector<LayerData> layers;  // layer_begin .. layer_end-1, in order
};

class Client {
 public:
  // Resolves the target (all addresses of a "dns:///" name) and opens one channel per replica.
  // INVALID_ARGUMENT names the bad option; UNAVAILABLE when a DNS name resolves to nothing.
  static absl::StatusOr<std::unique_ptr<Client>> Create(const ClientOptions& options);

  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  virtual ~Client() = default;

  // Uploads one cache: the header, then every layer's K, V and Q_obs in chunks of at most
  // max_chunk_bytes, layer by layer (so the server compresses layer l while l+1 is in flight).
  // `layers` must have shape.num_layers entries. Blocks until the server has stored the cache.
  virtual absl::StatusOr<PutResult> PutCache(const PutHeader& header,
                                             absl::Span<const LayerTensors> layers) = 0;

  // Fetches a whole cache (or a layer range) into memory.
  virtual absl::StatusOr<CacheData> GetCache(const std::string& cache_id,
                                             const GetOptions& options = {}) = 0;

  // Streaming variant: `on_info` (may be empty) gets the CacheInfo first, then `on_layer` gets
  // each layer as soon as all its bytes have arrived (so decode can start on the first layer while
  // the rest is in flight). A non-OK status returned by a callback cancels the stream and is
  // returned. Callbacks run on the calling thread.
  virtual absl::Status GetCacheStreaming(
      const std::string& cache_id, const GetOptions& options,
      const std::function<absl::Status(const CacheInfo&)>& on_info,
      const std::function<absl::Status(LayerData&&)>& on_layer) = 0;

  virtual absl::StatusOr<CacheInfo> StatCache(const std::string& cache_id) = 0;
  // Returns the bytes freed.
  virtual absl::StatusOr<uint64_t> DeleteCache(const std::string& cache_id) = 0;
  // Every cache whose id starts with `prefix`, from every replica (all pages), sorted by id.
  // Fails if any replica fails (the message names it).
  virtual absl::StatusOr<std::vector<CacheInfo>> ListCaches(const std::string& prefix = "") = 0;
  // Server info of replica `replica` (index into replicas()).
  virtual absl::StatusOr<ServerInfo> GetServerInfo(size_t replica = 0) = 0;

  // The replica addresses, in a fixed order (sorted), and the index of the owner of `cache_id`.
  virtual const std::vector<std::string>& replicas() const = 0;
  virtual size_t ReplicaFor(const std::string& cache_id) const = 0;

 protected:
  Client() = default;
};

// grpc::Status -> absl::Status with the same code and message: FromGrpcStatus in
// kvc/protocol/status.h (included above).

// Name of a status code as gRPC spells it ("UNAVAILABLE", "NOT_FOUND", ...).
std::string StatusCodeName(absl::StatusCode code);

}  // namespace kvc

#endif  // KVC_CLIENT_H_

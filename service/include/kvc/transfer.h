// Public API of kvcd's NCCL transfer path (kvcache/v1/transfer.proto): the data-plane
// interfaces, the gRPC service and how kvcd registers it, and the client side.
//
// The data plane is a 2-rank point-to-point channel between kvcd (rank 0) and one client
// (rank 1). Production uses NCCL (libnccl.so.2 loaded at run time, so kvcd neither links nor
// requires it); tests use an in-process fake. gRPC is the control plane: it hands out the NCCL
// unique id and sequences and acknowledges every tensor. The same session also carries the
// download direction (Fetch): layers of a stored cache, read from a TransferSource, to the client.
//
//
// Wiring into kvcd (server side): create the service and register it on the main port, e.g.
// through KvcServer::Options::extra_services:
//   TransferServiceOptions topts;            // limits, CUDA device, NCCL on/off
//   topts.sink = my_sink;                    // receives every tensor (must outlive the server)
//   topts.source = my_source;                // serves Fetch (kvcd: StoreTransferSource)
//   options.extra_services.push_back([topts](const ServerResources& r) {
//     std::string why;
//     r.state->nccl_available = NcclTransportAvailable(topts.device, &why);
//     server::ShareStreamSlots(r.state, &topts);  // server/transfer_source.h
//     return CreateTransferService(topts);
//   });
// The service uses gRPC's callback API: a stream holds no thread while it waits for its client.
// The blocking work of a tensor or a fetch (the data plane, the sink, the source) runs on the
// service's own pool of TransferServiceOptions::worker_threads, so threads stay bounded however
// many streams are open. Each Transfer and Fetch stream is admitted through admit_stream (kvcd:
// a --max_concurrent_streams slot shared with PutCache and GetCache).
#ifndef KVC_TRANSFER_H_
#define KVC_TRANSFER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/grpcpp.h"
#include "kvc/communicator.h"
#include "kvc/metrics.h"
#include "kvc/protocol/status.h"
#include "kvcache/v1/transfer.grpc.pb.h"

namespace kvc::transfer {

// ---- Server side ----

struct TransferLimits {
  uint64_t max_tensor_bytes = uint64_t{1} << 30;    // per announcement
  int max_sessions = 64;                            // open sessions across all clients
  // A session unused this long (no announcement, fetch or reuse; nothing in flight) expires,
  // and a Transfer or Fetch stream whose client sends nothing this long is ended
  // (cancelled; recorded as DEADLINE_EXCEEDED), giving its stream slot back.
  absl::Duration session_idle_timeout = absl::Minutes(5);
  absl::Duration join_timeout = absl::Seconds(60);  // rank 0 waits this long for the client
  absl::Duration recv_timeout = absl::Seconds(60);  // per tensor, after POSTED
  uint64_t fetch_chunk_bytes = uint64_t{1} << 20;   // GRPC_BYTES fetches: bytes per message
};

// What a received tensor is.
struct TensorHeader {
  std::string client_id;
  std::string cache_id;
  uint32_t layer = 0;
  kvcache::v1::TensorKind tensor = kvcache::v1::TENSOR_UNSPECIFIED;
  uint64_t sequence = 0;
};

// Receives every tensor, in sequence order per session. `bytes` is host memory valid during the
// call. An error ends the Transfer stream with that status (the tensor may be announced again
// with the next sequence). Must be thread-safe across sessions.
// Sessions keep no record of the tensors they carried (a session serves any number of uploads,
// including re-uploads of one cache id), so refusing a (cache_id, layer, tensor) that the
// upload it belongs to already received is the sink's job: kvcd's sink writes each tensor
// through the upload's chunk path, which answers INVALID_ARGUMENT ("already received") and
// fails that upload, whichever session the repeat came through.
class TransferSink {
 public:
  virtual ~TransferSink() = default;
  virtual absl::Status Consume(const TensorHeader& header, absl::Span<const uint8_t> bytes) = 0;
};

// One fetch's view of a stored cache (kvcache/v1/transfer.proto, Fetch). It keeps the bytes it
// hands out valid, and the entry unevictable, until it is destroyed (kvcd: a store read lease).
// Used by one thread at a time.
class CacheReader {
 public:
  virtual ~CacheReader() = default;
  // The cache's CacheInfo, as GetCache's first message carries it.
  virtual const kvcache::v1::CacheInfo& info() const = 0;
  virtual uint32_t num_layers() const = 0;
  // The PACKED blob of `layer` (< num_layers()), every checksum block verified; valid while this
  // reader lives. DATA_LOSS naming the layer and block when it is corrupt.
  virtual absl::StatusOr<absl::Span<const uint8_t>> Layer(uint32_t layer) = 0;
  // `bytes` of a layer reached the client (kvcd counts them as served bytes).
  virtual void Delivered(uint64_t bytes) = 0;
};

// Where fetches read stored caches. Must be thread-safe.
class TransferSource {
 public:
  virtual ~TransferSource() = default;
  // NOT_FOUND for an unknown cache; DATA_LOSS when its metadata or block table is corrupt.
  virtual absl::StatusOr<std::unique_ptr<CacheReader>> Open(const std::string& client_id,
                                                            const std::string& cache_id) = 0;
};

struct TransferServiceOptions {
  TransferLimits limits;
  bool enable_nccl = true;  // false: only GRPC_BYTES sessions
  int device = 0;           // CUDA device of the NCCL groups
  // Data plane; null = NCCL (libnccl.so.2 loaded at run time). Must outlive the service.
  CommunicatorFactory* factory = nullptr;
  TransferSink* sink = nullptr;  // required; must outlive the service
  // Serves Fetch; null: Fetch answers FAILED_PRECONDITION. Must outlive the service.
  TransferSource* source = nullptr;
  // Per-method RPC series (grpc_server_started_total, grpc_server_handled_total by code,
  // grpc_server_handling_seconds), as the KvCache service records them; null records nothing.
  // Must outlive the service.
  Metrics* metrics = nullptr;
  // Threads that run tensors and fetches (each blocks one while it waits on the data plane or
  // a slow client, at most recv_timeout per step); more wait in turn.
  int worker_threads = 8;
  // Called as each Transfer or Fetch stream starts: an error ends the stream with it at once,
  // OK admits it, and release_stream is called when an admitted stream ends. Null admits all.
  std::function<absl::Status()> admit_stream;
  std::function<void()> release_stream;
  // The clock of session expiry; null: absl::Now. Tests inject one.
  std::function<absl::Time()> clock;
};

// INVALID_ARGUMENT when the sink is missing or a limit is not positive. The service is returned
// even when NCCL is unavailable (its OpenTransferSession then answers UNAVAILABLE for NCCL).
absl::StatusOr<std::unique_ptr<grpc::Service>> CreateTransferService(
    const TransferServiceOptions& options);

// True when NCCL sessions can be served on `device`; otherwise false and *why says why.
bool NcclTransportAvailable(int device, std::string* why);

// The gRPC <-> absl status conversions are kvc::ToGrpcStatus and kvc::FromGrpcStatus
// (kvc/protocol/status.h).

// ---- Client side ----

// The client side of the transfer protocol (kvcache/v1/transfer.proto): opens (or reuses) a session
// for a client id, joins the NCCL group as rank 1, and sends tensors one by one, each announced,
// sent after POSTED and confirmed by RECEIVED. When kvcd answers the NCCL session request with
// UNAVAILABLE or FAILED_PRECONDITION, or the client has no communicator factory, it falls back to
// a GRPC_BYTES session and sends the bytes inside the announcements.
// Thread-compatible: one Send at a time per TransferClient.
class TransferClient {
 public:
  struct Options {
    std::string client_id;                   // required
    CommunicatorFactory* factory = nullptr;  // null: never try NCCL
    absl::Duration join_timeout = absl::Seconds(60);
    absl::Duration send_timeout = absl::Seconds(60);
  };

  TransferClient(std::shared_ptr<grpc::Channel> channel, Options options);
  // Ends the stream; the session stays cached on the server until Close or until it expires
  // (another TransferClient of the same client id is ALREADY_EXISTS meanwhile).
  ~TransferClient();
  TransferClient(const TransferClient&) = delete;
  TransferClient& operator=(const TransferClient&) = delete;

  // Opens the session (NCCL if possible, else GRPC_BYTES) and the Transfer stream.
  absl::Status Open();
  kvcache::v1::TransferTransport transport() const { return transport_; }
  // Why NCCL was not used ("" when it was).
  const std::string& fallback_reason() const { return fallback_reason_; }
  const std::string& session_id() const { return session_id_; }
  // The session's secret (kvcache/v1/transfer.proto): only this client has it, and with it
  // reuses the session when opened again.
  const std::string& session_secret() const { return session_secret_; }
  bool is_open() const { return stream_ != nullptr; }

  // Sends `bytes` bytes at `data` (host memory, or device memory in an NCCL session) and waits
  // for RECEIVED. An error ends the stream (the status is kvcd's, e.g. INVALID_ARGUMENT).
  absl::Status Send(const std::string& cache_id, uint32_t layer, kvcache::v1::TensorKind tensor,
                    const void* data, uint64_t bytes);

  // Fetches layers [layer_begin, layer_end) (layer_end: num_layers when unset) of stored cache
  // `cache_id` over the session: `on_info` gets the CacheInfo first, then `on_layer` each PACKED
  // layer blob (exactly the bytes GetCache FORMAT_PACKED streams for it) in order, as host
  // memory valid during the call. NCCL sessions receive each layer over the data plane (staged
  // into host memory by the communicator), GRPC_BYTES sessions inside the stream. Errors are
  // kvcd's (NOT_FOUND, INVALID_ARGUMENT, DATA_LOSS: see transfer.proto) or a callback's, which
  // cancels the fetch. A data-plane failure also ends the Transfer stream, as in Send (Open
  // again to go on). Uploads and fetches may alternate on one client.
  using FetchInfoFn = std::function<absl::Status(const kvcache::v1::CacheInfo& info,
                                                 uint32_t layer_begin, uint32_t layer_end)>;
  using FetchLayerFn = std::function<absl::Status(uint32_t layer, absl::Span<const uint8_t> blob)>;
  absl::Status Fetch(const std::string& cache_id, uint32_t layer_begin,
                     std::optional<uint32_t> layer_end, const FetchInfoFn& on_info,
                     const FetchLayerFn& on_layer);

  // Fetch, collected: info and the blobs of layers layer_begin.. in order.
  struct FetchedCache {
    kvcache::v1::CacheInfo info;
    uint32_t layer_begin = 0;
    std::vector<std::vector<uint8_t>> layers;
  };
  absl::StatusOr<FetchedCache> Fetch(const std::string& cache_id, uint32_t layer_begin = 0,
                                     std::optional<uint32_t> layer_end = std::nullopt);

  // Ends the stream and closes the session on the server.
  absl::Status Close();

 private:
  absl::Status OpenSession(kvcache::v1::TransferTransport t,
                           kvcache::v1::OpenTransferSessionResponse* resp);
  absl::Status FinishStream();
  absl::Status ReadAck(uint64_t sequence, kvcache::v1::TransferAck::State state, uint64_t* bytes);

  std::unique_ptr<kvcache::v1::KvCacheTransfer::Stub> stub_;
  Options options_;
  kvcache::v1::TransferTransport transport_ = kvcache::v1::TRANSFER_TRANSPORT_UNSPECIFIED;
  std::string fallback_reason_;
  std::string session_id_;
  std::string session_secret_;
  uint64_t next_sequence_ = 0;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<kvcache::v1::TransferAnnouncement, kvcache::v1::TransferAck>>
      stream_;
};

// ---- A whole upload through the transfer service ----

// One tensor of an upload: `bytes` bytes at `data`, the whole of tensor `tensor` of `layer`.
struct TensorRef {
  uint32_t layer = 0;
  kvcache::v1::TensorKind tensor = kvcache::v1::TENSOR_UNSPECIFIED;
  const void* data = nullptr;
  uint64_t bytes = 0;
};

// Which way the bytes of an upload went.
enum class PutPath { kNccl, kGrpcBytes, kChunks };
const char* PutPathName(PutPath p);  // "nccl", "grpc_bytes", "chunks"

struct TransferPutResult {
  kvcache::v1::PutCacheResponse response;
  PutPath path = PutPath::kChunks;
  std::string fallback_reason;  // why NCCL (or the transfer service) was not used; "" for NCCL
};

struct TransferPutOptions {
  // Upload with ordinary chunk messages instead when kvcd serves no transfer service
  // (UNIMPLEMENTED, or FAILED_PRECONDITION for the external_payload header), or when the session
  // is GRPC_BYTES and a tensor does not fit kvcd's max_message_bytes. Requires host memory.
  bool allow_chunks_fallback = true;
  uint64_t chunk_bytes = uint64_t{1} << 20;   // chunk size of that fallback; >= 1
  absl::Duration timeout = absl::Minutes(5);  // deadline of the PutCache stream
};

// Uploads one cache: a PutCache stream whose header has external_payload set, each tensor sent
// once through `client` (NCCL session when possible, else GRPC_BYTES: see TransferClient), then
// the PutCache stream closed after the last RECEIVED ack; returns kvcd's PutCacheResponse and
// the path taken. `client` is opened if needed and left open (its session, and NCCL group, are
// reused by the next upload); it must talk to the kvcd behind `channel`. `header` must have
// external_payload set or is copied with it set. Tensor memory: host memory, or device memory
// when the path is NCCL (a caller with device buffers sets allow_chunks_fallback = false and
// gives `client` a factory; it then gets the TransferClient's reason if NCCL is unusable, as
// GRPC_BYTES sessions read host memory).
// Any number of uploads may go through one `client` in turn, including an overwrite of a cache
// id it uploaded before (header.overwrite); its session's memory does not grow with them.
// Errors: kvcd's status for the upload (e.g. INVALID_ARGUMENT for a tensor of the wrong size, a
// missing or repeated tensor, ALREADY_EXISTS); a transfer error cancels the PutCache stream, so
// nothing is stored, and closes `client` (after a failed tensor the data plane's state is
// unknown), so a retry with it opens a fresh session. INVALID_ARGUMENT for a null tensor pointer
// or chunk_bytes 0. Not thread-safe per `client`.
absl::StatusOr<TransferPutResult> PutCacheWithTransfer(
    const std::shared_ptr<grpc::Channel>& channel, TransferClient* client,
    const kvcache::v1::PutCacheHeader& header, absl::Span<const TensorRef> tensors,
    const TransferPutOptions& options = {});

// Initial-metadata key kvcd sets (value "registered") on a PutCache stream with external_payload
// once the upload accepts transferred tensors.
inline constexpr char kExternalPayloadMetadataKey[] = "kvc-external-payload";

}  // namespace kvc::transfer

#endif  // KVC_TRANSFER_H_

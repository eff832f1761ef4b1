// Public API of kvcd's NCCL transfer path (kvcache/v1/transfer.proto): the data-plane
// interfaces, the gRPC service and how kvcd registers it. The client side is
// kvc/transfer_client.h (client/transfer); the data plane kvc/communicator.h (proto/transport).
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
  uint64_t max_tensor_bytes = uint64_t{1} << 30;  // per announcement
  int max_sessions = 64;                          // open sessions across all clients
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

}  // namespace kvc::transfer

#endif  // KVC_TRANSFER_H_

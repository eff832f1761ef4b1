// The client side of kvcd's transfer path (kvcache/v1/transfer.proto): a TransferClient that
// opens a session (NCCL when both ends can, else GRPC_BYTES) and sends or fetches tensors, and
// PutCacheWithTransfer, a whole upload through it. The server side is kvc/transfer.h (service),
// the data plane kvc/communicator.h (proto/transport).
#ifndef KVC_TRANSFER_CLIENT_H_
#define KVC_TRANSFER_CLIENT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "grpcpp/grpcpp.h"
#include "kvc/communicator.h"
#include "kvc/protocol/status.h"
#include "kvcache/v1/kvcache.pb.h"
#include "kvcache/v1/transfer.grpc.pb.h"

namespace kvc::transfer {

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
    // How long kvcd may take over any one message: an answer (an ack, the next message of a
    // fetch, a session RPC's reply) or a write its flow control holds back. Past it the stream is
    // cancelled and the call returns DEADLINE_EXCEEDED, so a stalled kvcd or a silent network
    // never holds the caller for good. Must be > 0.
    absl::Duration message_timeout = absl::Seconds(60);
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
  // Device memory that GPU work produced must be complete before the data plane reads it (see
  // kvc/communicator.h): the producer synchronized, or `ready_event` (a cudaEvent_t recorded on
  // the producing stream after that work, as void*; null: none) is given and the send waits for
  // it on the device.
  absl::Status Send(const std::string& cache_id, uint32_t layer, kvcache::v1::TensorKind tensor,
                    const void* data, uint64_t bytes, const void* ready_event = nullptr);

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
  class StreamTimer;
  // Runs op(), one blocking operation of the call `ctx`, within options_.message_timeout: past it
  // the call is cancelled (op then fails) and *late is set.
  bool Bounded(grpc::ClientContext* ctx, bool* late, const std::function<bool()>& op);
  absl::Status LateError(const char* what) const;
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
  std::unique_ptr<StreamTimer> timer_;  // started by the first Bounded operation
  std::unique_ptr<grpc::ClientContext> ctx_;
  std::unique_ptr<
      grpc::ClientReaderWriter<kvcache::v1::TransferAnnouncement, kvcache::v1::TransferAck>>
      stream_;
};

// ---- A whole upload through the transfer service ----

// One tensor of an upload: `bytes` bytes at `data`, the whole of tensor `tensor` of `layer`.
// Device memory written by GPU work: `ready_event` is a cudaEvent_t recorded after that work on
// its stream (the NCCL send waits for it on the device), or null when the work has completed
// (see TransferClient::Send).
struct TensorRef {
  uint32_t layer = 0;
  kvcache::v1::TensorKind tensor = kvcache::v1::TENSOR_UNSPECIFIED;
  const void* data = nullptr;
  uint64_t bytes = 0;
  const void* ready_event = nullptr;
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

}  // namespace kvc::transfer

#endif  // KVC_TRANSFER_CLIENT_H_

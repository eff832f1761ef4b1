#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvc/transfer.h"
#include "transfer/transfer_sessions.h"

namespace kvc::transfer {
namespace {

using kvcache::v1::CloseTransferSessionRequest;
using kvcache::v1::CloseTransferSessionResponse;
using kvcache::v1::FetchRequest;
using kvcache::v1::FetchResponse;
using kvcache::v1::OpenTransferSessionRequest;
using kvcache::v1::OpenTransferSessionResponse;
using kvcache::v1::TransferAck;
using kvcache::v1::TransferAnnouncement;

// Records one RPC in the per-method series: started now, handled (with its code and time) when
// the handler returns through Done.
class Recorded {
 public:
  Recorded(Metrics* metrics, const char* method)
      : metrics_(metrics), method_(method), start_(absl::Now()) {
    if (metrics_ != nullptr) metrics_->RecordRpcStarted(method_);
  }
  grpc::Status Done(grpc::Status status) {
    if (metrics_ != nullptr) {
      metrics_->RecordRpc(method_, status.error_code(),
                          absl::ToDoubleSeconds(absl::Now() - start_));
    }
    return status;
  }

 private:
  Metrics* const metrics_;
  const char* const method_;
  const absl::Time start_;
};

class TransferServiceImpl final : public kvcache::v1::KvCacheTransfer::Service {
 public:
  TransferServiceImpl(const TransferServiceOptions& o, std::unique_ptr<CommunicatorFactory> owned)
      : owned_factory_(std::move(owned)),
        metrics_(o.metrics),
        sessions_(o.limits,
                  !o.enable_nccl ? nullptr : (o.factory ? o.factory : owned_factory_.get()), o.sink,
                  o.source) {}

  grpc::Status OpenTransferSession(grpc::ServerContext* ctx, const OpenTransferSessionRequest* req,
                                   OpenTransferSessionResponse* resp) override {
    Recorded rpc(metrics_, "OpenTransferSession");
    return rpc.Done(DoOpen(ctx, req, resp));
  }
  grpc::Status Transfer(
      grpc::ServerContext* ctx,
      grpc::ServerReaderWriter<TransferAck, TransferAnnouncement>* stream) override {
    Recorded rpc(metrics_, "Transfer");
    return rpc.Done(DoTransfer(ctx, stream));
  }
  grpc::Status Fetch(grpc::ServerContext* ctx,
                     grpc::ServerReaderWriter<FetchResponse, FetchRequest>* stream) override {
    Recorded rpc(metrics_, "Fetch");
    return rpc.Done(DoFetch(ctx, stream));
  }
  grpc::Status CloseTransferSession(grpc::ServerContext*, const CloseTransferSessionRequest* req,
                                    CloseTransferSessionResponse*) override {
    Recorded rpc(metrics_, "CloseTransferSession");
    return rpc.Done(ToGrpcStatus(sessions_.Close(req->client_id(), req->session_id())));
  }

 private:
  grpc::Status DoOpen(grpc::ServerContext*, const OpenTransferSessionRequest* req,
                      OpenTransferSessionResponse* resp) {
    absl::StatusOr<OpenTransferSessionResponse> r = sessions_.Open(*req);
    if (!r.ok()) return ToGrpcStatus(r.status());
    *resp = *std::move(r);
    return grpc::Status::OK;
  }

  grpc::Status DoTransfer(grpc::ServerContext* ctx,
                          grpc::ServerReaderWriter<TransferAck, TransferAnnouncement>* stream) {
    TransferAnnouncement a;
    while (stream->Read(&a)) {
      auto posted = [&]() -> absl::Status {
        TransferAck ack;
        ack.set_sequence(a.sequence());
        ack.set_state(TransferAck::STATE_POSTED);
        if (!stream->Write(ack)) return absl::CancelledError("transfer: the client went away");
        return absl::OkStatus();
      };
      absl::StatusOr<uint64_t> n = sessions_.Handle(a, posted);
      if (!n.ok()) return ToGrpcStatus(n.status());
      TransferAck ack;
      ack.set_sequence(a.sequence());
      ack.set_state(TransferAck::STATE_RECEIVED);
      ack.set_received_bytes(*n);
      if (!stream->Write(ack)) return grpc::Status(grpc::StatusCode::CANCELLED, "client gone");
    }
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
    return grpc::Status::OK;
  }

  grpc::Status DoFetch(grpc::ServerContext* ctx,
                       grpc::ServerReaderWriter<FetchResponse, FetchRequest>* stream) {
    FetchRequest first;
    if (!stream->Read(&first)) {
      if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "fetch: the stream ended before a start message");
    }
    if (!first.has_start()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "fetch: the first message must be start");
    }
    TransferSessions::FetchIo io;
    io.write = [stream](const FetchResponse& r) -> absl::Status {
      if (!stream->Write(r)) return absl::CancelledError("fetch: the client went away");
      return absl::OkStatus();
    };
    io.read = [stream]() -> absl::StatusOr<FetchRequest> {
      FetchRequest r;
      if (!stream->Read(&r)) {
        return absl::CancelledError("fetch: the client ended the stream before posting a layer");
      }
      return r;
    };
    return ToGrpcStatus(sessions_.Fetch(first.start(), io));
  }

  std::unique_ptr<CommunicatorFactory> owned_factory_;
  Metrics* const metrics_;
  TransferSessions sessions_;
};

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

absl::StatusOr<std::unique_ptr<grpc::Service>> CreateTransferService(
    const TransferServiceOptions& options) {
  if (options.sink == nullptr) return absl::InvalidArgumentError("sink: required");
  const TransferLimits& l = options.limits;
  if (l.max_tensor_bytes == 0) {
    return absl::InvalidArgumentError("limits.max_tensor_bytes: must be > 0");
  }
  if (l.max_sessions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("limits.max_sessions: ", l.max_sessions, " must be >= 1"));
  }
  if (l.fetch_chunk_bytes == 0) {
    return absl::InvalidArgumentError("limits.fetch_chunk_bytes: must be > 0");
  }
  if (l.join_timeout <= absl::ZeroDuration() || l.recv_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("limits.join_timeout/recv_timeout: must be > 0");
  }
  std::unique_ptr<CommunicatorFactory> owned;
  if (options.enable_nccl && options.factory == nullptr) {
    owned = CreateNcclCommunicatorFactory(options.device);
  }
  return std::unique_ptr<grpc::Service>(new TransferServiceImpl(options, std::move(owned)));
}

bool NcclTransportAvailable(int device, std::string* why) {
  const absl::Status s = CreateNcclCommunicatorFactory(device)->Available();
  if (!s.ok() && why != nullptr) *why = std::string(s.message());
  return s.ok();
}

}  // namespace kvc::transfer

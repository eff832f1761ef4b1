// PutCacheWithTransfer: the client side of an upload whose tensors travel through the transfer
// service (PutCacheHeader.external_payload), with the fallback to ordinary chunk messages.
#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "kvc/transfer_client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvc::transfer {
namespace {

using kvcache::v1::PutCacheHeader;
using kvcache::v1::PutCacheRequest;
using kvcache::v1::PutCacheResponse;

// Room for an announcement's fields besides the payload (ids, numbers, framing).
constexpr uint64_t kAnnouncementOverhead = 1024;

// The whole upload as ordinary chunk messages (host memory).
absl::StatusOr<PutCacheResponse> PutWithChunks(const std::shared_ptr<grpc::Channel>& channel,
                                               PutCacheHeader header,
                                               absl::Span<const TensorRef> tensors,
                                               const TransferPutOptions& options) {
  header.set_external_payload(false);
  auto stub = kvcache::v1::KvCache::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  PutCacheResponse resp;
  auto writer = stub->PutCache(&ctx, &resp);
  PutCacheRequest req;
  *req.mutable_header() = header;
  bool ok = writer->Write(req);
  for (const TensorRef& t : tensors) {
    for (uint64_t off = 0; ok && off < t.bytes; off += options.chunk_bytes) {
      const uint64_t n = std::min(options.chunk_bytes, t.bytes - off);
      req.Clear();
      req.mutable_chunk()->set_layer(t.layer);
      req.mutable_chunk()->set_tensor(t.tensor);
      req.mutable_chunk()->set_offset(off);
      req.set_data(static_cast<const char*>(t.data) + off, n);
      ok = writer->Write(req);
    }
    if (!ok) break;
  }
  if (ok) writer->WritesDone();
  // When a write failed kvcd already ended the stream; Finish returns its status.
  if (absl::Status s = FromGrpcStatus(writer->Finish()); !s.ok()) return s;
  return resp;
}

}  // namespace

const char* PutPathName(PutPath p) {
  switch (p) {
    case PutPath::kNccl:
      return "nccl";
    case PutPath::kGrpcBytes:
      return "grpc_bytes";
    case PutPath::kChunks:
      return "chunks";
  }
  return "unknown";
}

absl::StatusOr<TransferPutResult> PutCacheWithTransfer(
    const std::shared_ptr<grpc::Channel>& channel, TransferClient* client,
    const PutCacheHeader& header, absl::Span<const TensorRef> tensors,
    const TransferPutOptions& options) {
  if (channel == nullptr || client == nullptr) {
    return absl::InvalidArgumentError("channel/client: required");
  }
  if (options.chunk_bytes == 0) return absl::InvalidArgumentError("chunk_bytes: must be >= 1");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].data == nullptr && tensors[i].bytes > 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensors[", i, "].data: null"));
    }
  }
  TransferPutResult result;
  auto chunks = [&](std::string why) -> absl::StatusOr<TransferPutResult> {
    absl::StatusOr<PutCacheResponse> r = PutWithChunks(channel, header, tensors, options);
    if (!r.ok()) return r.status();
    result.response = *std::move(r);
    result.path = PutPath::kChunks;
    result.fallback_reason = std::move(why);
    return result;
  };

  if (!client->is_open()) {
    absl::Status s = client->Open();
    if (s.code() == absl::StatusCode::kUnimplemented && options.allow_chunks_fallback) {
      return chunks(absl::StrCat("kvcd serves no transfer service: ", s.message()));
    }
    if (!s.ok()) return s;
  }
  result.path = client->transport() == kvcache::v1::TRANSFER_TRANSPORT_NCCL ? PutPath::kNccl
                                                                            : PutPath::kGrpcBytes;
  result.fallback_reason = client->fallback_reason();
  if (result.path == PutPath::kGrpcBytes && options.allow_chunks_fallback) {
    // A GRPC_BYTES announcement carries a whole tensor in one message: tensors that do not fit
    // kvcd's message limit go as chunks instead.
    auto stub = kvcache::v1::KvCache::NewStub(channel);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
    kvcache::v1::ServerInfo info;
    if (absl::Status s =
            FromGrpcStatus(stub->GetServerInfo(&ctx, kvcache::v1::GetServerInfoRequest(), &info));
        !s.ok()) {
      return s;
    }
    const uint64_t limit = info.limits().max_message_bytes();
    for (const TensorRef& t : tensors) {
      if (limit > 0 && t.bytes + kAnnouncementOverhead > limit) {
        TransferPutOptions o = options;
        if (info.limits().max_chunk_bytes() > 0) {
          o.chunk_bytes = std::min(o.chunk_bytes, info.limits().max_chunk_bytes());
        }
        absl::StatusOr<PutCacheResponse> r = PutWithChunks(channel, header, tensors, o);
        if (!r.ok()) return r.status();
        result.response = *std::move(r);
        result.path = PutPath::kChunks;
        result.fallback_reason = absl::StrCat(
            result.fallback_reason, "; a tensor of ", t.bytes,
            " bytes does not fit one gRPC message (kvcd's max_message_bytes ", limit, ")");
        return result;
      }
    }
  }

  // The PutCache stream: header first; kvcd's initial metadata says the upload is registered
  // (a stream that fails before that ends with trailers only, without the key).
  auto stub = kvcache::v1::KvCache::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  PutCacheResponse resp;
  auto writer = stub->PutCache(&ctx, &resp);
  PutCacheRequest req;
  *req.mutable_header() = header;
  req.mutable_header()->set_external_payload(true);
  if (writer->Write(req)) writer->WaitForInitialMetadata();
  const auto& md = ctx.GetServerInitialMetadata();
  if (md.find(kExternalPayloadMetadataKey) == md.end()) {
    writer->WritesDone();
    absl::Status s = FromGrpcStatus(writer->Finish());
    if (s.ok()) return absl::InternalError("PutCache: kvcd neither registered nor refused");
    if (s.code() == absl::StatusCode::kFailedPrecondition && options.allow_chunks_fallback) {
      return chunks(std::string(s.message()));
    }
    return s;
  }

  for (const TensorRef& t : tensors) {
    absl::Status s =
        client->Send(header.cache_id(), t.layer, t.tensor, t.data, t.bytes, t.ready_event);
    if (!s.ok()) {
      // kvcd has failed the upload already (or the data plane broke): make sure nothing is
      // stored, whatever the PutCache stream would say.
      ctx.TryCancel();
      writer->Finish().ok();
      // The stream has ended, and after a data-plane failure the group's state is unknown: a
      // retry starts from a fresh session.
      client->Close().IgnoreError();
      return s;
    }
  }
  writer->WritesDone();
  if (absl::Status s = FromGrpcStatus(writer->Finish()); !s.ok()) return s;
  result.response = std::move(resp);
  return result;
}

}  // namespace kvc::transfer

// kvcd's bulk messages on the shared reader and framing (kvc/protocol/wire.h).
#include "server/wire.h"

#include <cstring>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvc/stream_copy.h"

namespace kvc::server {

void RawPutRequest::CopyDataTo(uint8_t* dst) const {
  for (const auto& s : data) {
    StreamCopy(dst, s.ptr, s.size);
    dst += s.size;
  }
}

absl::StatusOr<RawPutRequest> ParsePutRequest(grpc::ByteBuffer* buffer) {
  RawPutRequest req;
  kvcache::v1::PutCacheRequest fields;
  const absl::Status parsed = ParseRawMessage(*buffer, &fields, &req.raw);
  buffer->Clear();
  if (!parsed.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed PutCacheRequest: ", parsed.message()));
  }
  switch (fields.kind_case()) {
    case kvcache::v1::PutCacheRequest::kHeader:
      req.kind = RawPutRequest::Kind::kHeader;
      req.header.Swap(fields.mutable_header());
      break;
    case kvcache::v1::PutCacheRequest::kChunk:
      req.kind = RawPutRequest::Kind::kChunk;
      req.chunk.Swap(fields.mutable_chunk());
      break;
    default:
      break;
  }
  req.raw.ForEachPiece([&req](const uint8_t* p, size_t n) { req.data.push_back({p, n}); });
  req.data_size = req.raw.size();
  return req;
}

grpc::ByteBuffer MakeChunkResponse(const kvcache::v1::LayerChunk& chunk, const uint8_t* data,
                                   size_t size, std::shared_ptr<const void> keepalive) {
  kvcache::v1::GetCacheResponse head;
  *head.mutable_chunk() = chunk;
  return FrameWithData(head, data, size, std::move(keepalive));
}

}  // namespace kvc::server

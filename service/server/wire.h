// kvcd's side of the raw wire handling of the two bulk messages, PutCacheRequest and
// GetCacheResponse, so that the `data` payload (field 15) is never copied through protobuf
// parsing. The reader and the framing are the ones the client uses (kvc/protocol/wire.h).
#ifndef KVC_SERVICE_SERVER_WIRE_H_
#define KVC_SERVICE_SERVER_WIRE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "kvc/protocol/wire.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc::server {

// A PutCacheRequest with its payload left in the received slices.
struct RawPutRequest {
  enum class Kind { kNone, kHeader, kChunk };
  Kind kind = Kind::kNone;
  kvcache::v1::PutCacheHeader header;  // when kind == kHeader
  kvcache::v1::ChunkHeader chunk;      // when kind == kChunk
  // Keeps the received slices alive; `data` points into them.
  RawData raw;
  struct Segment {
    const uint8_t* ptr;
    size_t size;
  };
  std::vector<Segment> data;  // the payload, in order, possibly spread over several slices
  size_t data_size = 0;

  // Copies the payload to `dst` (data_size bytes).
  void CopyDataTo(uint8_t* dst) const;
};

// Parses one serialized PutCacheRequest held in `buffer`. Follows protobuf semantics (fields in
// any order; for a repeated singular field the last one wins; oneof: the last member wins) but
// rejects malformed input with INVALID_ARGUMENT. `buffer` is consumed (its slices are moved).
absl::StatusOr<RawPutRequest> ParsePutRequest(grpc::ByteBuffer* buffer);

// Builds a serialized GetCacheResponse whose `chunk` is `chunk` and whose `data` is the
// `size` bytes at `data`, without copying them. `keepalive` is held until gRPC no longer needs
// the bytes (it owns or leases the memory `data` points to).
grpc::ByteBuffer MakeChunkResponse(const kvcache::v1::LayerChunk& chunk, const uint8_t* data,
                                   size_t size, std::shared_ptr<const void> keepalive);

// Parses an ordinary (small) request message (kvc::ParseMessage, kvc/protocol/wire.h).
using ::kvc::ParseMessage;

// Serializes an ordinary message into a ByteBuffer (for the info message and the Put response).
inline grpc::ByteBuffer SerializeToByteBuffer(const google::protobuf::MessageLite& message) {
  return FrameMessage(message);
}

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_WIRE_H_

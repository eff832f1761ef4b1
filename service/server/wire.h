// Raw wire handling for the two bulk messages, PutCacheRequest and GetCacheResponse, so that the
// `data` payload (field 15) is never copied through protobuf parsing: requests are walked over
// the slices of the received ByteBuffer, and responses are a small serialized prefix plus a slice
// that references the payload in place.
#ifndef KVC_SERVICE_SERVER_WIRE_H_
#define KVC_SERVICE_SERVER_WIRE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc::server {

// A PutCacheRequest with its payload left in the received slices.
struct RawPutRequest {
  enum class Kind { kNone, kHeader, kChunk };
  Kind kind = Kind::kNone;
  kvcache::v1::PutCacheHeader header;  // when kind == kHeader
  kvcache::v1::ChunkHeader chunk;      // when kind == kChunk
  // Keeps the slices alive; `data` points into them.
  std::vector<grpc::Slice> slices;
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

// Parses an ordinary (small) request message held in `buffer` into `message`. INVALID_ARGUMENT
// naming the message type when the bytes are not a valid serialization, including a string field
// that is not UTF-8. Raw unary handlers use it: gRPC's own handler answers an unparsable request
// with UNIMPLEMENTED and no message.
absl::Status ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message);

// Serializes an ordinary message into a ByteBuffer (for the info message and the Put response).
grpc::ByteBuffer SerializeToByteBuffer(const google::protobuf::MessageLite& message);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_WIRE_H_

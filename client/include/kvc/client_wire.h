// Raw framing of the two bulk messages (PutCacheRequest, GetCacheResponse), used by kvc::Client
// and by tests that check it against the generated protobuf code. Public so tests and tools can
// use it; most users want kvc/client.h instead.
//
// A bulk message on the wire is the protobuf encoding of its non-data fields followed by field 15
// (`bytes data`): tag 0x7A, varint length, payload. Framing builds that as a small serialized
// prefix plus a slice that points at the caller's memory (no copy); parsing walks the received
// slices, hands the non-data fields to protobuf and leaves `data` in place until it is copied
// once into its destination.
//
// Thread-safety: pure functions; a RawData is not synchronized.
#ifndef KVC_CLIENT_WIRE_H_
#define KVC_CLIENT_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kvc/bytes.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc {

inline constexpr uint32_t kDataFieldNumber = 15;

// How a tensor of `total` bytes is cut into chunks of at most `max_chunk` bytes (max_chunk > 0):
// consecutive, in order, each max_chunk long except possibly the last. total == 0 gives none.
struct ChunkSpan {
  uint64_t offset = 0;
  uint64_t size = 0;
};
std::vector<ChunkSpan> SplitChunks(uint64_t total, uint64_t max_chunk);

// A PutCacheRequest carrying `chunk` and the `size` bytes at `data` as its data field. The bytes
// are not copied: `data` must stay valid until the message has been sent (the call has ended).
grpc::ByteBuffer FramePutChunk(const kvcache::v1::ChunkHeader& chunk, const void* data,
                               size_t size);

// Any message without a data field, serialized into one slice.
grpc::ByteBuffer FrameMessage(const google::protobuf::MessageLite& message);

// The data field of a parsed message: pieces of the received slices, kept alive by `slices`.
class RawData {
 public:
  size_t size() const { return size_; }
  // Copies the payload to dst (size() bytes).
  void CopyTo(uint8_t* dst) const;
  // Appends the payload to *dst.
  void AppendTo(ByteVector* dst) const;

 private:
  friend absl::Status ParseRawMessage(const grpc::ByteBuffer&, google::protobuf::MessageLite*,
                                      RawData*);
  struct Piece {
    size_t slice = 0;
    size_t offset = 0;
    size_t size = 0;
  };
  std::vector<grpc::Slice> slices_;
  std::vector<Piece> pieces_;
  size_t size_ = 0;
};

// Parses `buffer`: every field except 15 into `fields` (by protobuf), field 15 into `data`
// (without copying). A repeated data field keeps the last occurrence, as protobuf does.
// INVALID_ARGUMENT on malformed wire bytes.
absl::Status ParseRawMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* fields,
                             RawData* data);

}  // namespace kvc

#endif  // KVC_CLIENT_WIRE_H_

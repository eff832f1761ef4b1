// Raw framing of the two bulk messages (PutCacheRequest, GetCacheResponse), shared by kvcd and
// the kvc client so that a payload is never copied through protobuf parsing.
//
// A bulk message on the wire is the protobuf encoding of its non-data fields followed by field 15
// (`bytes data`): tag 0x7A, varint length, payload. Framing builds that as a small serialized
// prefix plus a slice that points at the caller's memory (no copy); parsing walks the received
// slices, hands the non-data fields to protobuf and leaves `data` in place until it is copied
// once into its destination. Tags, lengths, groups and nesting are read exactly as protobuf reads
// them, so a message is accepted exactly when the generated parser would accept it (the fuzzers
// in tests/fuzz check this).
//
// Thread-safety: pure functions; a RawData is not synchronized.
#ifndef KVC_PROTOCOL_WIRE_H_
#define KVC_PROTOCOL_WIRE_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "google/protobuf/message_lite.h"
#include "kvc/bytes.h"

namespace kvc {

inline constexpr uint32_t kDataFieldNumber = 15;

// The data field of a parsed message: pieces of the received slices, kept alive by the RawData.
class RawData {
 public:
  size_t size() const { return size_; }
  // Copies the payload to dst (size() bytes).
  void CopyTo(uint8_t* dst) const;
  // Appends the payload to *dst.
  void AppendTo(ByteVector* dst) const;
  // Calls fn for each contiguous piece, in order.
  void ForEachPiece(absl::FunctionRef<void(const uint8_t* data, size_t size)> fn) const;

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
// INVALID_ARGUMENT on malformed wire bytes ("message: ..." or "data: ...").
absl::Status ParseRawMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* fields,
                             RawData* data);

// A message made of `fields` and, as its data field, the `size` bytes at `data`, which are not
// copied. `keepalive` is held until gRPC no longer needs the bytes (it owns or leases the memory
// `data` points to); with a null keepalive the caller keeps `data` valid until the call has ended.
grpc::ByteBuffer FrameWithData(const google::protobuf::MessageLite& fields, const void* data,
                               size_t size, std::shared_ptr<const void> keepalive = nullptr);

// Any message without a data field, serialized into one slice.
grpc::ByteBuffer FrameMessage(const google::protobuf::MessageLite& message);

// Parses an ordinary (small) message held in `buffer`. INVALID_ARGUMENT naming the message type
// ("malformed kvcache.v1.StatCacheRequest: ...") when the bytes are not a valid serialization,
// including a string field that is not UTF-8. An invalid (never filled) buffer is the empty
// message.
absl::Status ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message);

}  // namespace kvc

#endif  // KVC_PROTOCOL_WIRE_H_

// Raw framing of the bulk messages (kvc/protocol/wire.h).
#include "kvc/protocol/wire.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace kvc {
namespace {

constexpr uint32_t kWireVarint = 0;
constexpr uint32_t kWireFixed64 = 1;
constexpr uint32_t kWireBytes = 2;
constexpr uint32_t kWireStartGroup = 3;
constexpr uint32_t kWireEndGroup = 4;
constexpr uint32_t kWireFixed32 = 5;

void AppendVarint(uint64_t v, std::string* out) {
  while (v >= 0x80) {
    out->push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out->push_back(static_cast<char>(v));
}

// Reads across slice boundaries; large payloads usually arrive as several slices.
class SliceCursor {
 public:
  explicit SliceCursor(const std::vector<grpc::Slice>& slices) : slices_(slices) { Normalize(); }

  bool done() const { return index_ == slices_.size(); }
  size_t index() const { return index_; }
  size_t offset() const { return offset_; }

  bool ReadByte(uint8_t* b) {
    if (done()) return false;
    *b = slices_[index_].begin()[offset_];
    ++offset_;
    Normalize();
    return true;
  }

  bool ReadVarint(uint64_t* v, std::string* copy) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      if (copy != nullptr) copy->push_back(static_cast<char>(b));
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }

  // A field tag as protobuf reads it: at most 5 bytes, bits beyond 32 dropped.
  bool ReadTag(uint32_t* tag, std::string* copy) {
    uint64_t v;
    const size_t start = copy->size();
    if (!ReadVarint(&v, copy) || copy->size() - start > 5) return false;
    *tag = static_cast<uint32_t>(v);
    return true;
  }

  // Advances n bytes; appends them to `copy` when given, records them as pieces when given.
  template <typename OnPiece>
  bool Advance(uint64_t n, std::string* copy, OnPiece on_piece) {
    while (n > 0) {
      if (done()) return false;
      const size_t avail = slices_[index_].size() - offset_;
      const size_t take = static_cast<size_t>(std::min<uint64_t>(avail, n));
      if (copy != nullptr) {
        copy->append(reinterpret_cast<const char*>(slices_[index_].begin()) + offset_, take);
      }
      on_piece(index_, offset_, take);
      offset_ += take;
      n -= take;
      Normalize();
    }
    return true;
  }

 private:
  void Normalize() {
    while (index_ < slices_.size() && offset_ == slices_[index_].size()) {
      ++index_;
      offset_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t offset_ = 0;
};

// Nesting protobuf allows (its default recursion limit).
constexpr int kMaxGroupDepth = 100;

// Copies the value of a field other than data, whose tag was just read, to `rest`; protobuf
// parses it there. A group (wire type 3) runs to its matching end tag, nesting at most `depth`
// deep, so that a data field inside an unknown group stays part of that group, as in protobuf.
bool CopyValue(SliceCursor& cur, uint32_t tag, int depth, std::string* rest) {
  auto no_piece = [](size_t, size_t, size_t) {};
  uint64_t v;
  switch (tag & 7) {
    case kWireVarint:
      return cur.ReadVarint(&v, rest);
    case kWireFixed64:
      return cur.Advance(8, rest, no_piece);
    case kWireBytes:
      return cur.ReadVarint(&v, rest) && cur.Advance(v, rest, no_piece);
    case kWireStartGroup:
      if (--depth < 0) return false;
      for (;;) {
        uint32_t inner;
        if (!cur.ReadTag(&inner, rest) || inner == 0) return false;
        if ((inner & 7) == kWireEndGroup) return inner == tag + 1;
        if ((inner >> 3) == 0 || !CopyValue(cur, inner, depth, rest)) return false;
      }
    case kWireFixed32:
      return cur.Advance(4, rest, no_piece);
    default:
      return false;
  }
}

void FreeKeepalive(void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }

}  // namespace

grpc::ByteBuffer FrameWithData(const google::protobuf::MessageLite& fields, const void* data,
                               size_t size, std::shared_ptr<const void> keepalive) {
  std::string prefix = fields.SerializeAsString();
  AppendVarint((kDataFieldNumber << 3) | kWireBytes, &prefix);
  AppendVarint(size, &prefix);
  if (size == 0) {
    grpc::Slice slice(prefix);
    return grpc::ByteBuffer(&slice, 1);
  }
  grpc::Slice slices[2] = {
      grpc::Slice(prefix),
      keepalive == nullptr ? grpc::Slice(data, size, grpc::Slice::STATIC_SLICE)
                           : grpc::Slice(const_cast<void*>(data), size, &FreeKeepalive,
                                         new std::shared_ptr<const void>(std::move(keepalive)))};
  return grpc::ByteBuffer(slices, 2);
}

grpc::ByteBuffer FrameMessage(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

void RawData::CopyTo(uint8_t* dst) const {
  for (const Piece& p : pieces_) {
    std::memcpy(dst, slices_[p.slice].begin() + p.offset, p.size);
    dst += p.size;
  }
}

void RawData::AppendTo(ByteVector* dst) const {
  for (const Piece& p : pieces_) {
    const uint8_t* begin = slices_[p.slice].begin() + p.offset;
    dst->insert(dst->end(), begin, begin + p.size);
  }
}

void RawData::ForEachPiece(absl::FunctionRef<void(const uint8_t*, size_t)> fn) const {
  for (const Piece& p : pieces_) fn(slices_[p.slice].begin() + p.offset, p.size);
}

absl::Status ParseRawMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* fields,
                             RawData* data) {
  data->slices_.clear();
  data->pieces_.clear();
  data->size_ = 0;
  if (!buffer.Dump(&data->slices_).ok()) {
    return absl::InvalidArgumentError("message: cannot read the received byte buffer");
  }
  SliceCursor cur(data->slices_);
  std::string rest;  // every field but data, re-encoded for protobuf
  // Tags, lengths and groups are read as protobuf reads them, so a message is accepted exactly
  // when the generated parser would accept it (tests/fuzz checks this).
  while (!cur.done()) {
    const size_t tag_start = rest.size();
    uint32_t tag;
    if (!cur.ReadTag(&tag, &rest)) return absl::InvalidArgumentError("message: bad tag");
    const uint32_t field = tag >> 3;
    const uint32_t wire = tag & 7;
    if (field == 0) return absl::InvalidArgumentError("message: field number 0");
    if (field == kDataFieldNumber && wire == kWireBytes) {
      rest.resize(tag_start);
      // A length as protobuf reads it: at most 5 bytes, below 2^31.
      uint64_t len;
      std::string len_bytes;
      if (!cur.ReadVarint(&len, &len_bytes) || len_bytes.size() > 5 || len >= (uint64_t{1} << 31)) {
        return absl::InvalidArgumentError("data: bad length");
      }
      data->pieces_.clear();  // last occurrence wins
      data->size_ = 0;
      const bool ok = cur.Advance(len, nullptr, [data](size_t s, size_t off, size_t n) {
        data->pieces_.push_back({s, off, n});
        data->size_ += n;
      });
      if (!ok) return absl::InvalidArgumentError(absl::StrCat("data: truncated (", len, " bytes)"));
      continue;
    }
    if (wire == kWireEndGroup) {
      return absl::InvalidArgumentError("message: end of a group that was not started");
    }
    if (!CopyValue(cur, tag, kMaxGroupDepth, &rest)) {
      return absl::InvalidArgumentError(
          absl::StrCat("message: field ", field, " (wire type ", wire, ") is bad or truncated"));
    }
  }
  if (!fields->ParseFromString(rest)) {
    return absl::InvalidArgumentError("message: fields do not parse as the expected message");
  }
  return absl::OkStatus();
}

absl::Status ParseMessage(const grpc::ByteBuffer& buffer, google::protobuf::MessageLite* message) {
  std::vector<grpc::Slice> slices;
  // An invalid (never filled) buffer holds no bytes: the empty message.
  if (buffer.Valid() && !buffer.Dump(&slices).ok()) {
    return absl::InvalidArgumentError(absl::StrCat("unreadable ", message->GetTypeName()));
  }
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  if (!message->ParseFromString(bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat("malformed ", message->GetTypeName(),
                     ": not a valid serialization (string fields must be UTF-8)"));
  }
  return absl::OkStatus();
}

}  // namespace kvc

#include "server/wire.h"

#include <cstring>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/io/coded_stream.h"

namespace kvc::server {
namespace {

// Sequential reader over a list of slices; handles fields split across slice boundaries.
class SliceReader {
 public:
  explicit SliceReader(const std::vector<grpc::Slice>& slices) : slices_(slices) { Skip0(); }

  bool AtEnd() const { return index_ >= slices_.size(); }

  bool ReadByte(uint8_t* b) {
    if (AtEnd()) return false;
    *b = slices_[index_].begin()[pos_];
    Advance(1);
    return true;
  }

  bool ReadVarint(uint64_t* out) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) {
        *out = v;
        return true;
      }
    }
    return false;
  }

  // A field tag as protobuf reads it: at most 5 bytes, bits beyond 32 dropped.
  bool ReadTag(uint32_t* out) {
    uint32_t v = 0;
    for (int i = 0; i < 5; ++i) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      v |= static_cast<uint32_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        *out = v;
        return true;
      }
    }
    return false;
  }

  // A length prefix as protobuf reads it: at most 5 bytes, below 2^31.
  bool ReadLength(uint64_t* out) {
    uint64_t v = 0;
    for (int i = 0; i < 5; ++i) {
      uint8_t b;
      if (!ReadByte(&b)) return false;
      v |= static_cast<uint64_t>(b & 0x7f) << (7 * i);
      if ((b & 0x80) == 0) {
        *out = v;
        return v < (uint64_t{1} << 31);
      }
    }
    return false;
  }

  // Appends the next n bytes as segments (no copy).
  bool Take(uint64_t n, std::vector<RawPutRequest::Segment>* segs) {
    while (n > 0) {
      if (AtEnd()) return false;
      const size_t avail = slices_[index_].size() - pos_;
      const size_t take = n < avail ? static_cast<size_t>(n) : avail;
      if (segs) segs->push_back({slices_[index_].begin() + pos_, take});
      Advance(take);
      n -= take;
    }
    return true;
  }

  bool Copy(uint64_t n, std::string* out) {
    std::vector<RawPutRequest::Segment> segs;
    if (!Take(n, &segs)) return false;
    out->clear();
    out->reserve(n);
    for (const auto& s : segs) out->append(reinterpret_cast<const char*>(s.ptr), s.size);
    return true;
  }

 private:
  void Advance(size_t n) {
    pos_ += n;
    Skip0();
  }
  // Moves past exhausted (and empty) slices.
  void Skip0() {
    while (index_ < slices_.size() && pos_ >= slices_[index_].size()) {
      ++index_;
      pos_ = 0;
    }
  }

  const std::vector<grpc::Slice>& slices_;
  size_t index_ = 0;
  size_t pos_ = 0;
};

absl::Status Malformed(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("malformed PutCacheRequest: ", what));
}

void FreeKeepalive(void* p) { delete static_cast<std::shared_ptr<const void>*>(p); }

// Nesting protobuf allows (its default recursion limit): groups and sub-messages count alike.
constexpr int kMaxDepth = 100;

// Skips the value of an ignored field whose tag was just read. A group (wire type 3) is skipped up
// to its matching end tag, nesting at most `depth` deep, as protobuf keeps unknown groups.
bool SkipValue(SliceReader& r, uint32_t tag, int depth) {
  uint64_t n;
  switch (tag & 7) {
    case 0:
      return r.ReadVarint(&n);
    case 1:
      return r.Take(8, nullptr);
    case 2:
      return r.ReadLength(&n) && r.Take(n, nullptr);
    case 3:
      if (--depth < 0) return false;
      for (;;) {
        uint32_t inner;
        if (!r.ReadTag(&inner) || inner == 0) return false;
        if ((inner & 7) == 4) return inner == tag + 1;  // the end of this group, not another
        if ((inner >> 3) == 0 || !SkipValue(r, inner, depth)) return false;
      }
    case 5:
      return r.Take(4, nullptr);
    default:
      return false;
  }
}

// Merges serialized `bytes` into `msg` as protobuf merges a sub-message one level down.
bool MergeSubMessage(const std::string& bytes, google::protobuf::MessageLite* msg) {
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  in.SetRecursionLimit(kMaxDepth - 1);
  return msg->MergeFromCodedStream(&in) && in.ConsumedEntireMessage();
}

}  // namespace

void RawPutRequest::CopyDataTo(uint8_t* dst) const {
  for (const auto& s : data) {
    std::memcpy(dst, s.ptr, s.size);
    dst += s.size;
  }
}

absl::StatusOr<RawPutRequest> ParsePutRequest(grpc::ByteBuffer* buffer) {
  RawPutRequest req;
  if (!buffer->Dump(&req.slices).ok()) return Malformed("unreadable buffer");
  buffer->Clear();
  SliceReader r(req.slices);
  std::string scratch;
  while (!r.AtEnd()) {
    // Tags, lengths, groups and nesting are read exactly as protobuf reads them, so that kvcd
    // accepts a request exactly when the generated parser would (tests/fuzz checks this).
    uint32_t tag;
    if (!r.ReadTag(&tag)) return Malformed("truncated tag");
    const uint32_t field = tag >> 3;
    const int wire_type = static_cast<int>(tag & 7);
    if (field == 0) return Malformed("field number 0");
    if (wire_type == 2 && (field == 1 || field == 2 || field == 15)) {
      uint64_t len;
      if (!r.ReadLength(&len)) return Malformed("bad length");
      if (field == 15) {
        req.data.clear();
        if (!r.Take(len, &req.data)) return Malformed("truncated data");
        req.data_size = static_cast<size_t>(len);
        continue;
      }
      if (!r.Copy(len, &scratch)) return Malformed("truncated header");
      // A oneof member seen again merges into the previous one; a different member replaces.
      bool ok;
      if (field == 1) {
        if (req.kind != RawPutRequest::Kind::kHeader) req.header.Clear();
        ok = MergeSubMessage(scratch, &req.header);
        req.kind = RawPutRequest::Kind::kHeader;
      } else {
        if (req.kind != RawPutRequest::Kind::kChunk) req.chunk.Clear();
        ok = MergeSubMessage(scratch, &req.chunk);
        req.kind = RawPutRequest::Kind::kChunk;
      }
      if (!ok) return Malformed(field == 1 ? "bad header" : "bad chunk");
    } else if (wire_type == 4) {
      return Malformed("end of a group that was not started");
    } else if (!SkipValue(r, tag, kMaxDepth)) {
      return Malformed(
          absl::StrCat("bad or truncated field ", field, " (wire type ", wire_type, ")"));
    }
  }
  return req;
}

grpc::ByteBuffer MakeChunkResponse(const kvcache::v1::LayerChunk& chunk, const uint8_t* data,
                                   size_t size, std::shared_ptr<const void> keepalive) {
  kvcache::v1::GetCacheResponse head;
  *head.mutable_chunk() = chunk;
  std::string prefix = head.SerializeAsString();
  // Field 15, wire type 2, then the payload length as a varint.
  prefix.push_back(static_cast<char>((15 << 3) | 2));
  uint64_t n = size;
  while (n >= 0x80) {
    prefix.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  prefix.push_back(static_cast<char>(n));
  grpc::Slice slices[2] = {
      grpc::Slice(prefix),
      size == 0 ? grpc::Slice()
                : grpc::Slice(const_cast<uint8_t*>(data), size, &FreeKeepalive,
                              new std::shared_ptr<const void>(std::move(keepalive)))};
  return grpc::ByteBuffer(slices, size == 0 ? 1 : 2);
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

grpc::ByteBuffer SerializeToByteBuffer(const google::protobuf::MessageLite& message) {
  grpc::Slice slice(message.SerializeAsString());
  return grpc::ByteBuffer(&slice, 1);
}

}  // namespace kvc::server

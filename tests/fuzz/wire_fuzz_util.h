// Helpers shared by the wire-format harnesses: turning fuzz input into a multi-slice ByteBuffer
// (the raw parsers must handle fields split across slices, as large gRPC messages arrive) and
// failing loudly.
#ifndef KVC_TESTS_FUZZ_WIRE_FUZZ_UTIL_H_
#define KVC_TESTS_FUZZ_WIRE_FUZZ_UTIL_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "google/protobuf/message.h"
#include "google/protobuf/stubs/logging.h"
#include "google/protobuf/util/field_comparator.h"
#include "google/protobuf/util/message_differencer.h"
#include "grpcpp/support/byte_buffer.h"
#include "grpcpp/support/slice.h"

namespace kvc::fuzz {

// Protobuf logs every string field with invalid UTF-8 it rejects; millions of lines help no one.
inline void QuietProtobuf() { google::protobuf::SetLogHandler(nullptr); }

inline void Check(bool ok, const char* harness, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "%s: %s\n", harness, what);
    std::abort();
  }
}

// Field-by-field equality where a NaN equals a NaN: a double field holding NaN bits (e.g.
// CacheInfo.compression_ratio) is the same value to both parsers, though NaN != NaN.
inline bool SameFields(const google::protobuf::Message& a, const google::protobuf::Message& b) {
  google::protobuf::util::DefaultFieldComparator comparator;
  comparator.set_treat_nan_as_equal(true);
  google::protobuf::util::MessageDifferencer differencer;
  differencer.set_field_comparator(&comparator);
  return differencer.Compare(a, b);
}

// The first input byte picks how the rest is cut: (b & 3) + 1 slices, cut points moved by
// b >> 2, so one message is seen whole and split in many places. `message` receives the bytes
// after the control byte (what protobuf parses).
inline grpc::ByteBuffer SlicedBuffer(const uint8_t* data, size_t size, std::string* message) {
  const uint8_t control = size > 0 ? data[0] : 0;
  if (size > 0) ++data, --size;
  message->assign(reinterpret_cast<const char*>(data), size);
  const size_t pieces = (control & 3) + 1;
  std::vector<grpc::Slice> slices;
  size_t begin = 0;
  for (size_t i = 1; i <= pieces; ++i) {
    size_t end = i == pieces ? size : std::min(size, size * i / pieces + (control >> 2));
    end = std::max(end, begin);
    slices.emplace_back(data + begin, end - begin);  // copies
    begin = end;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace kvc::fuzz

#endif  // KVC_TESTS_FUZZ_WIRE_FUZZ_UTIL_H_

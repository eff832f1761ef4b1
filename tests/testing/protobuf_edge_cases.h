// Inputs on which a hand-written protobuf parser easily parts ways with protobuf itself: unknown
// groups (valid protobuf, which proto3 parsers keep as unknown fields), group nesting at the
// recursion limit, 5-byte tags whose bits beyond 32 protobuf drops, over-long tags and length
// prefixes. Written for messages whose field 1 is a sub-message and field 15 the raw data field
// (PutCacheRequest, GetCacheResponse); each test compares its parser with protobuf's on them.
#ifndef KVC_TESTS_TESTING_PROTOBUF_EDGE_CASES_H_
#define KVC_TESTS_TESTING_PROTOBUF_EDGE_CASES_H_

#include <string>
#include <utility>
#include <vector>

namespace kvc::testing {

// (what, bytes) pairs.
inline std::vector<std::pair<std::string, std::string>> ProtobufEdgeCases() {
  auto nested = [](int depth) {
    return std::string(depth, '\x4b') + std::string(depth, '\x4c');  // field 9 groups
  };
  auto in_field_1 = [](const std::string& body) {  // as field 1 (a sub-message)
    return std::string("\x0a", 1) + static_cast<char>(body.size()) + body;
  };
  return {
      {"unknown group", std::string("\x4b\x48\x05\x4c", 4)},
      {"group ended by another field's end tag", std::string("\x4b\x54", 2)},
      {"unterminated group", std::string("\x4b\x48\x05", 3)},
      {"tag 0 inside a group", std::string("\x4b\x00\x4c", 3)},
      {"end group without a start", std::string("\x4c", 1)},
      {"groups nested 100 deep", nested(100)},
      {"groups nested 101 deep", nested(101)},
      {"groups nested 99 deep in a sub-message", in_field_1(nested(99))},
      {"groups nested 100 deep in a sub-message", in_field_1(nested(100))},
      {"data field 15 inside a group", std::string("\x4b\x7a\x02xy\x4c", 6)},
      {"5-byte tag naming field 15 after truncation", std::string("\xfa\x80\x80\x80\x10\x02xy", 8)},
      {"6-byte tag", std::string("\xc8\x80\x80\x80\x80\x00\x05", 7)},
      {"6-byte data length", std::string("\x7a\x82\x80\x80\x80\x80\x00xy", 9)},
      {"5-byte data length", std::string("\x7a\x82\x80\x80\x80\x00xy", 8)},
      {"length of 2^31", std::string("\x52\x80\x80\x80\x80\x08", 6)},
      {"10-byte varint", std::string("\x48\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 11)},
      {"11-byte varint", std::string("\x48\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", 12)},
      {"wire type 6", std::string("\x4e\x00", 2)},
  };
}

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_PROTOBUF_EDGE_CASES_H_

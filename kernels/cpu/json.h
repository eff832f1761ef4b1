// A small strict JSON (RFC 8259) reader and string quoting, enough for safetensors headers.
// Internal to kernels/. Integers that fit int64 are kept exactly; other numbers are parsed as
// double. Objects keep document order and reject duplicate keys. Nesting is limited to
// kMaxDepth so hostile input cannot exhaust the stack. Thread-compatible.
#ifndef KVC_CPU_JSON_H_
#define KVC_CPU_JSON_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace kvc::json {

inline constexpr int kMaxDepth = 64;

struct Value {
  enum class Kind { kNull, kBool, kInt, kDouble, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;  // kDouble
  std::string string;
  std::vector<Value> array;
  std::vector<std::pair<std::string, Value>> object;  // document order, unique keys

  const Value* Find(absl::string_view key) const;  // object member or null
};

absl::string_view KindName(Value::Kind k);  // "null", "bool", "integer", "number", ...

// Parses one JSON value; surrounding whitespace is allowed, anything else after it is an error.
// Errors are INVALID_ARGUMENT and give the byte offset.
absl::StatusOr<Value> Parse(absl::string_view text);

// `s` as a JSON string literal with quotes; ", \ and control characters are escaped, other bytes
// are copied unchanged.
std::string Quote(absl::string_view s);

}  // namespace kvc::json

#endif  // KVC_CPU_JSON_H_

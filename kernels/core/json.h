// Strict JSON (RFC 8259) reading and string quoting for safetensors headers, on nlohmann-json.
// Internal to kernels/. The library does the lexing, number and UTF-8 handling; Parse adds what a
// file header from an untrusted source needs: duplicate object keys and nesting deeper than
// kMaxDepth are errors, objects keep document order, and nothing throws. Thread-compatible.
#ifndef KVC_CORE_JSON_H_
#define KVC_CORE_JSON_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace kvc::json {

// Objects keep their members in document order. Integers come back as number_integer (negative)
// or number_unsigned (non-negative); integers beyond 64 bits and other numbers as number_float.
using Value = nlohmann::ordered_json;

inline constexpr int kMaxDepth = 64;  // nested arrays/objects accepted

// Parses one JSON value; surrounding whitespace is allowed, anything else after it is an error,
// as are invalid UTF-8 in strings, duplicate keys within one object and nesting deeper than
// kMaxDepth. Errors are INVALID_ARGUMENT and give the byte offset. Costs time and memory linear in
// the input, whatever its shape.
absl::StatusOr<Value> Parse(absl::string_view text);

// True when `s` is valid UTF-8 (what Parse accepts inside strings and Quote writes unchanged).
bool IsValidUtf8(absl::string_view s);

// `s` as a JSON string literal with quotes; ", \ and control characters are escaped, other valid
// UTF-8 is copied unchanged, and each invalid UTF-8 byte sequence becomes U+FFFD (callers that
// must round-trip check IsValidUtf8 first).
std::string Quote(absl::string_view s);

}  // namespace kvc::json

#endif  // KVC_CORE_JSON_H_

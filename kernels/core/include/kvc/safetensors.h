// Safetensors (HuggingFace) read and write: an 8-byte little-endian header length, a JSON header
// {"name": {"dtype": "F16", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the raw little-endian tensor bytes. Tensor names kvc uses are documented in README.md.
#ifndef KVC_SAFETENSORS_H_
#define KVC_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvc/dtype.h"

namespace kvc {

enum class StDType : uint8_t { kF32, kF16, kBF16, kI32, kI64, kU8 };
size_t StDTypeSize(StDType t);
std::string_view StDTypeName(StDType t);  // "F32", "F16", "BF16", "I32", "I64", "U8"
StDType ToStDType(DType t);
absl::StatusOr<DType> ToDType(StDType t);  // INVALID_ARGUMENT for integer types

struct StTensor {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // exactly product(shape) * StDTypeSize(dtype) bytes
};

struct StFile {
  std::map<std::string, std::string> metadata;
  std::vector<StTensor> tensors;
  const StTensor* Find(std::string_view name) const;  // null when absent
};

// Largest JSON header accepted (and written): 100 MiB, as in the reference implementation.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

// Rejects truncated files, bad or oversized headers, unknown dtypes, offsets out of range,
// overlapping or not covering the data section, duplicate names and shape/size mismatches, with a
// message that says which (INVALID_ARGUMENT). Tensors come back in data-offset order, so a file
// written by SerializeSafetensors round-trips with its order. Thread-safe (no shared state).
absl::StatusOr<StFile> ParseSafetensors(absl::Span<const uint8_t> bytes);
// Reads and parses a file: NOT_FOUND when it does not exist, INTERNAL on other I/O errors, the
// parse errors above otherwise; every message starts with the path.
absl::StatusOr<StFile> ReadSafetensors(const std::string& path);

// INVALID_ARGUMENT when a name is duplicated or "__metadata__", a name or metadata string is not
// UTF-8 (JSON strings are), a dimension is negative, or a tensor's data size is not
// product(shape) * element size.
absl::Status ValidateStFile(const StFile& file);
// The file's bytes: header with "__metadata__" first (when not empty) and the tensors in vector
// order, laid out contiguously in that order; the header is padded with spaces to a multiple of
// 8 bytes. Precondition: ValidateStFile(file) is OK (offsets follow data.size() regardless).
std::vector<uint8_t> SerializeSafetensors(const StFile& file);
// Validates, serializes and writes through a temporary file renamed over `path`; INTERNAL (with
// the path) on I/O errors.
absl::Status WriteSafetensors(const std::string& path, const StFile& file);

}  // namespace kvc

#endif  // KVC_SAFETENSORS_H_

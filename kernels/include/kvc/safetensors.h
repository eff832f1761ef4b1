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

// Rejects truncated files, bad or oversized headers, unknown dtypes, offsets out of range or
// overlapping, and shape/size mismatches, with a message that says which.
absl::StatusOr<StFile> ParseSafetensors(absl::Span<const uint8_t> bytes);
absl::StatusOr<StFile> ReadSafetensors(const std::string& path);
std::vector<uint8_t> SerializeSafetensors(const StFile& file);
absl::Status WriteSafetensors(const std::string& path, const StFile& file);

}  // namespace kvc

#endif  // KVC_SAFETENSORS_H_

#include "kvc/dtype.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace kvc {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kF16:
      return "f16";
    case DType::kBF16:
      return "bf16";
  }
  return "unknown";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "f32" || n == "fp32" || n == "float32") return DType::kF32;
  if (n == "f16" || n == "fp16" || n == "float16") return DType::kF16;
  if (n == "bf16" || n == "bfloat16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: unknown '", std::string(name), "' (expected f32, f16 or bf16)"));
}

std::string_view LayoutName(Layout l) { return l == Layout::kHND ? "HND" : "NHD"; }

absl::StatusOr<Layout> ParseLayout(std::string_view name) {
  const std::string n = absl::AsciiStrToUpper(std::string(name));
  if (n == "HND") return Layout::kHND;
  if (n == "NHD") return Layout::kNHD;
  return absl::InvalidArgumentError(
      absl::StrCat("layout: unknown '", std::string(name), "' (expected HND or NHD)"));
}

}  // namespace kvc

// Backend, attention-math and scoring-math names (kvc/backend_interface.h); creating a backend is
// the registry's (kvc/backend.h).
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "kvc/backend_interface.h"

namespace kvc {

absl::StatusOr<BackendKind> ParseBackendKind(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "auto") return BackendKind::kAuto;
  if (n == "cpu") return BackendKind::kCpu;
  if (n == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("backend: unknown '", std::string(name), "' (expected auto, cpu or cuda)"));
}

absl::StatusOr<AttentionMath> ParseAttentionMath(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "auto") return AttentionMath::kAuto;
  if (n == "exact") return AttentionMath::kExact;
  if (n == "integer") return AttentionMath::kInteger;
  return absl::InvalidArgumentError(absl::StrCat("attention_math: unknown '", std::string(name),
                                                 "' (expected auto, exact or integer)"));
}

absl::StatusOr<ScoringMath> ParseScoringMath(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "exact") return ScoringMath::kExact;
  if (n == "integer") return ScoringMath::kInteger;
  return absl::InvalidArgumentError(absl::StrCat("scoring_math: unknown '", std::string(name),
                                                 "' (expected exact or integer)"));
}

}  // namespace kvc

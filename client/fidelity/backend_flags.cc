#include "kvc/fidelity/backend_flags.h"

#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int, threads, 1, "CPU backend threads (0 = all cores)");
ABSL_FLAG(std::string, attention_math, "auto",
          "decoding on the compact cache: how quantized (2/4/8-bit) blocks are multiplied: auto "
          "(integer dot products for 2- and 4-bit heads keeping >= 32 channels, fp32 otherwise), "
          "exact (fp32 on the dequantized codes) or integer (integer dot products everywhere)");
ABSL_FLAG(std::string, scoring_math, "exact",
          "compression: attention scoring's logits (h2o, snapkv, keyformer, kvzip): exact, or "
          "integer (int8 dot products on AVX-512 VNNI or AVX2; exact below AVX2 and on AMX)");

namespace kvc::fidelity {

absl::StatusOr<BackendOptions> BackendOptionsFromFlags() {
  BackendOptions options;
  options.num_threads = absl::GetFlag(FLAGS_threads);
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads: ", options.num_threads, " must be >= 0 (0 = all cores)"));
  }
  absl::StatusOr<AttentionMath> math = ParseAttentionMath(absl::GetFlag(FLAGS_attention_math));
  if (!math.ok()) return absl::InvalidArgumentError(absl::StrCat("--", math.status().message()));
  options.attention_math = *math;
  absl::StatusOr<ScoringMath> scoring = ParseScoringMath(absl::GetFlag(FLAGS_scoring_math));
  if (!scoring.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", scoring.status().message()));
  }
  options.scoring_math = *scoring;
  return options;
}

}  // namespace kvc::fidelity

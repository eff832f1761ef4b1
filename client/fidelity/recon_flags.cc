#include "kvc/fidelity/recon_flags.h"

#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, kvzip_prompt, "",
          "kvzip rows: token ids (spaces or commas) of the reconstruction prompt run between the "
          "compressed context and its copy; empty (the default) repeats the context right after "
          "itself. A pass needs the compressed context + these + its chunk positions of the "
          "model");
ABSL_FLAG(std::string, kvzip_part_prompt, "",
          "kvzip rows, a context longer than --kvzip_chunk: token ids of a later pass's "
          "instruction, run before the previous chunk's last 8 tokens and --kvzip_part_suffix");
ABSL_FLAG(std::string, kvzip_part_suffix, "",
          "kvzip rows: token ids run between a later pass's overlap and its chunk");
ABSL_FLAG(int, kvzip_chunk, kvc::kDefaultPassTokens,
          "kvzip rows: context tokens one reconstruction pass repeats (a longer context takes one "
          "pass a chunk, each normalised over the sinks and its chunk); 0: one pass");

namespace kvc::fidelity {

absl::StatusOr<ReconPrompts> ReconPromptsFromFlags() {
  return ParseReconPrompts(
      absl::GetFlag(FLAGS_kvzip_prompt), absl::GetFlag(FLAGS_kvzip_part_prompt),
      absl::GetFlag(FLAGS_kvzip_part_suffix), absl::GetFlag(FLAGS_kvzip_chunk));
}

}  // namespace kvc::fidelity

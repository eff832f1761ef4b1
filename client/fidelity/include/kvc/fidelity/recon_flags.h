// The kvzip reconstruction flags of kvcfidelity and kvcpasskey (--kvzip_prompt,
// --kvzip_part_prompt, --kvzip_part_suffix, --kvzip_chunk), defined once for both tools.
#ifndef KVC_FIDELITY_RECON_FLAGS_H_
#define KVC_FIDELITY_RECON_FLAGS_H_

#include "absl/status/statusor.h"
#include "kvc/fidelity/recon.h"

namespace kvc::fidelity {

// The passes' prompts and chunk from the parsed flags; INVALID_ARGUMENT naming the flag.
absl::StatusOr<ReconPrompts> ReconPromptsFromFlags();

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_RECON_FLAGS_H_

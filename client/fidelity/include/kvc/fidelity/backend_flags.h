// The CPU backend flags of kvcfidelity and kvcpasskey (--threads, --attention_math,
// --scoring_math), defined once for both tools.
#ifndef KVC_FIDELITY_BACKEND_FLAGS_H_
#define KVC_FIDELITY_BACKEND_FLAGS_H_

#include "absl/status/statusor.h"
#include "kvc/backend_interface.h"

namespace kvc::fidelity {

// The backend's options from the parsed flags; INVALID_ARGUMENT naming the flag (--threads < 0,
// an unknown --attention_math or --scoring_math).
absl::StatusOr<BackendOptions> BackendOptionsFromFlags();

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_BACKEND_FLAGS_H_

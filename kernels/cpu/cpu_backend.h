// The CPU engine's entry points for the backend registry (kernels/registry.cc), internal to
// kernels/.
#ifndef KVC_KERNELS_CPU_CPU_BACKEND_H_
#define KVC_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "absl/status/statusor.h"
#include "core/host_fallback.h"
#include "kvc/backend_interface.h"
#include "kvc/thread_pool.h"

namespace kvc::cpu {

// Compresses one layer on `pool` as the CPU backend does: validates the input and spec
// (INVALID_ARGUMENT naming the field), selects tokens and channels, packs; fills `timings` when
// not null. A failed allocation is RESOURCE_EXHAUSTED: no exception leaves.
// `early`: scores from ScoreKeysOnPool for this input and spec (the value weighting, selection,
// channels and packing then run from them), or null (score here).
absl::StatusOr<CompactLayer> CompressOnPool(const LayerInput& in, const CompressionSpec& spec,
                                            ThreadPool* pool, CompressTimings* timings,
                                            KeyScores* early = nullptr);
// Backend::ScoreKeys on `pool`: validates what it reads (in.v may be null), then the policy's
// scores before value weighting.
absl::StatusOr<KeyScores> ScoreKeysOnPool(const LayerInput& in, const CompressionSpec& spec,
                                          ThreadPool* pool);

// The CPU backend with its own pool of options.num_threads threads at options.thread_nice
// (0 = hardware concurrency; must be >= 0, the registry checks it); Attend multiplies quantized
// blocks as options.attention_math says, scoring computes logits as options.scoring_math says.
std::unique_ptr<Backend> NewCpuBackend(const BackendOptions& options);

// The host engine other backends fall back to (core/host_fallback.h), running on
// ThreadPool::Default(). Process-wide, never destroyed, thread-safe.
const HostFallback& HostEngine();

}  // namespace kvc::cpu

#endif  // KVC_KERNELS_CPU_CPU_BACKEND_H_

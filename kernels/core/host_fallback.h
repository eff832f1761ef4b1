// What a device backend may hand to the host engine, internal to kernels/. The CUDA backend has no
// device path for a few steps (the head-adaptive allocation and its ragged pack, expected
// attention's query statistics, a policy without a CUDA scorer); the backend registry
// (kernels/registry.cc) gives it the CPU engine's implementation of this interface, so that
// kernels/cuda never includes or links kernels/cpu and both backends run the same host code for
// these steps.
#ifndef KVC_KERNELS_CORE_HOST_FALLBACK_H_
#define KVC_KERNELS_CORE_HOST_FALLBACK_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kvc/backend_interface.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

// Expected-attention query statistics of a layer, rotated to the average of the next `horizon`
// positions: mean [Hq, D] and covariance [Hq, D, D] (row-major), float.
struct ExpectedStats {
  std::vector<float> mean;
  std::vector<float> cov;
};

// Thread-safe: every method may be called concurrently. Preconditions for every method: input
// and spec already validated (ValidateInput, ValidateSpec, ValidateSpecInput).
class HostFallback {
 public:
  virtual ~HostFallback() = default;

  // The whole layer, exactly as the CPU backend compresses it (for a policy that has no device
  // scorer; cuda/scorers.h). Fills `timings` when not null.
  virtual absl::StatusOr<CompactLayer> Compress(const LayerInput& in, const CompressionSpec& spec,
                                                CompressTimings* timings) const = 0;

  // From in.q_stats when spec.query_stats, else from the un-rotated Q_obs rows (see ScoreTokens in
  // kvc/selection.h). Requires in.rope.
  virtual ExpectedStats ExpectedStatistics(const LayerInput& in,
                                           const EvictionSpec& spec) const = 0;

  // Token selection from given scores ([num_kv_heads, S] as the CPU engine computes them; may be
  // modified), then channel selection and packing, all on the host: the same code the CPU backend
  // runs after scoring. Fills timings->select and timings->pack when `timings` is not null.
  virtual absl::StatusOr<CompactLayer> CompressFromScores(const LayerInput& in,
                                                          const CompressionSpec& spec,
                                                          std::vector<float>* scores,
                                                          CompressTimings* timings) const = 0;
};

}  // namespace kvc

#endif  // KVC_KERNELS_CORE_HOST_FALLBACK_H_

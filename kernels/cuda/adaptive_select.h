// Head-adaptive budgets (EvictionSpec::adaptive) on the CUDA backend. The scores are computed on
// the device as for every policy; the cross-head allocation, the channel selection on the ragged
// kept sets and the ragged pack then run on the host (the host fallback, core/host_fallback.h,
// which the registry fills with the CPU engine), from the device's scores copied back. That is the
// same code the CPU backend runs after scoring, so the two backends keep the same sets wherever
// their scores agree (up to floating-point near-ties). Moving the allocation onto the device would
// save one [Hkv, S] copy per layer; the ragged pack would need per-head offsets in the pack
// kernels, which assume one count for every head.
#ifndef KVC_KERNELS_CUDA_ADAPTIVE_SELECT_H_
#define KVC_KERNELS_CUDA_ADAPTIVE_SELECT_H_

#include <cuda_runtime_api.h>

#include "absl/status/statusor.h"
#include "core/host_fallback.h"
#include "kvc/backend_interface.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc::cuda {

// `device_scores`: [Hkv, S] floats on the device, written by work queued on `stream` (pooled for
// snapkv). Waits for the stream, then selects, prunes and packs on the host with `host` from `in`
// (host memory). Fills `timings` when not null (score: the wait for the queued score kernels and
// the copy; total: from this call on). Input and spec must already be valid.
absl::StatusOr<CompactLayer> AdaptiveFromDeviceScores(
    const LayerInput& in, const CompressionSpec& spec, const HostFallback& host,
    const float* device_scores, cudaStream_t stream, CompressTimings* timings);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_ADAPTIVE_SELECT_H_

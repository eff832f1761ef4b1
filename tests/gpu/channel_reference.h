// Double-precision channel scores as kernels/cpu/channels.cc defines them, for telling a real
// channel-selection mismatch from a tie broken differently by float rounding.
#ifndef KVC_TESTS_GPU_CHANNEL_REFERENCE_H_
#define KVC_TESTS_GPU_CHANNEL_REFERENCE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "kvc/compact.h"
#include "kvc/spec.h"

namespace kvc::gpu_testing {

// Scores [D] of head h's key channels (values == false) or value channels (values == true), over
// the kept tokens of `view` (the first n_kept - n_recent of them vote).
std::vector<double> ReferenceChannelScores(const Layer& layer, const CompressionSpec& spec,
                                           const CompactLayerView& view, int h, bool values);

// True when every channel kept by only one of the two lists scores within tolerance of every
// channel kept only by the other.
bool ChannelDifferencesAreTies(const int32_t* a, const int32_t* b, int n,
                               const std::vector<double>& score, std::string* why);

}  // namespace kvc::gpu_testing

#endif  // KVC_TESTS_GPU_CHANNEL_REFERENCE_H_

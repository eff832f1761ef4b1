// Test helpers for the selection tests: build a layer's K/V/Q_obs buffers in any dtype and layout
// from float data given in HND order, and a plain double-precision reference of the attention
// scores to compare the engine against.
#ifndef KVC_TESTS_KERNELS_SELECT_UTIL_H_
#define KVC_TESTS_KERNELS_SELECT_UTIL_H_

#include <cstdint>
#include <vector>

#include "kvc/layer.h"
#include "kvc/selection.h"
#include "kvc/spec.h"

namespace kvc::testing {

// Owns the buffers behind a LayerInput. k, v: HND [Hkv, S, D]; q: HND [Hq, W, D] floats.
struct TestLayer {
  LayerShape shape;
  DType dtype = DType::kF32;
  Layout layout = Layout::kHND;
  int layer_index = 0;
  std::vector<uint8_t> k, v, q;
  LayerInput input() const;
};

TestLayer MakeLayer(const LayerShape& shape, const std::vector<float>& k_hnd,
                    const std::vector<float>& v_hnd, const std::vector<float>& q_hnd,
                    DType dtype = DType::kF32, Layout layout = Layout::kHND);

// Gaussian-ish random values (sum of uniforms), deterministic for a seed.
std::vector<float> RandomValues(size_t n, uint64_t seed, float scale = 1.0f);

// A random layer of the given shape.
TestLayer RandomLayer(const LayerShape& shape, uint64_t seed, DType dtype = DType::kF32,
                      Layout layout = Layout::kHND);

// Kept positions of head h.
std::vector<int32_t> HeadPositions(const TokenSelection& sel, int h);
std::vector<int32_t> HeadKeyChannels(const ChannelSelection& sel, int h);
std::vector<int32_t> HeadValueChannels(const ChannelSelection& sel, int h);

// Reference h2o/keyformer/snapkv (unpooled) and kvzip score, computed naively in double from the
// layer's (dtype-rounded) values: [Hkv, S]. kvzip: with `q_stats` ([Hq, W] row log-masses) each
// row's denominator also holds exp(q_stats[row]); with spec.pass_rows a row of pass p sees keys
// [0, min(sink_tokens, lo)) and [lo, hi), its pass's chunk, only; with spec.top_rows > 1 a token's
// score is the mean of the top_rows largest probabilities it gets (absent ones zeros).
std::vector<double> ReferenceAttentionScores(const TestLayer& layer, const EvictionSpec& spec,
                                             const float* q_stats = nullptr);

}  // namespace kvc::testing

#endif  // KVC_TESTS_KERNELS_SELECT_UTIL_H_

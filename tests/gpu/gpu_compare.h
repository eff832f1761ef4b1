// CPU-vs-CUDA comparison of one compressed layer, shared by the backend test's grid, its edge
// cases and the 128K case. Selection: kept token sets identical, or different only where the
// CPU's own scores tie within float tolerance at the boundary (channels: the same rule against a
// double-precision channel score). Blobs: header and per-head descriptors always; each head whose
// selections agree block by block (full-precision blocks byte for byte, quantization scales/zeros
// within 1e-6, codes within one step); for a head whose kept sets differ at ties, the rows of the
// positions both kept. Decode attention over each blob by both backends, whatever the selections.
#ifndef KVC_TESTS_GPU_GPU_COMPARE_H_
#define KVC_TESTS_GPU_GPU_COMPARE_H_

#include <memory>
#include <string>

#include "gpu_util.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/spec.h"

namespace kvc::gpu_testing {

// Process-wide backends (the CUDA one on device 0), created on first use.
Backend& Cpu();
Backend& Gpu();

struct CompareOptions {
  // NaN/Inf inputs: outputs may hold NaN; values compare equal when both are NaN.
  bool allow_nan = false;
  int attention_n_q = 2;  // decode queries per head (with n_q + 1 new tokens)
  uint64_t attention_seed = 99;
};

// Compares the two backends' blobs of `layer` (its input `in`, which may be device-resident for
// the CUDA side: the CPU always gets layer.input()) under `spec`, with gtest expectations. `name`
// labels the notes it prints (how many heads differed at ties).
void CompareCompressed(const std::string& name, const Layer& layer, const LayerInput& in,
                       const CompressionSpec& spec, const CompareOptions& options = {});

// Both backends attend over `view` (n_q queries per head and n_q + 1 new tokens, random); their
// outputs must agree within 2e-3 (and be finite unless allow_nan).
void CompareAttention(const CompactLayerView& view, int num_q_heads,
                      const CompareOptions& options = {});

}  // namespace kvc::gpu_testing

#endif  // KVC_TESTS_GPU_GPU_COMPARE_H_

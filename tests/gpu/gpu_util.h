// Helpers shared by the GPU test and benchmark binaries: random layers in any dtype/layout, and
// the skip protocol (exit code 77 with a printed reason when no CUDA device is visible).
#ifndef KVC_TESTS_GPU_GPU_UTIL_H_
#define KVC_TESTS_GPU_GPU_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kvc/layer.h"

namespace kvc::gpu_testing {

inline constexpr int kSkipExitCode = 77;

// Returns true when a CUDA device is visible; otherwise prints
// "SKIPPED: no CUDA device: <reason>" to stdout and returns false.
bool DeviceOrSkipMessage();

// Owns one layer's K, V and Q_obs buffers.
struct Layer {
  LayerShape shape;
  DType dtype = DType::kF16;
  Layout layout = Layout::kHND;
  int layer_index = 0;
  std::vector<uint8_t> k, v, q;
  LayerInput input() const;
};

// Random layer. Values are Gaussian-ish; key channel c of every head is scaled by a distinct
// factor (a seeded permutation of 1 + 3c/D), so that key channels differ in energy as real ones
// do and channel pruning has something to find.
Layer RandomLayer(const LayerShape& shape, DType dtype, Layout layout, uint64_t seed,
                  int layer_index = 0);

}  // namespace kvc::gpu_testing

#endif  // KVC_TESTS_GPU_GPU_UTIL_H_

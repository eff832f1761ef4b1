// Helpers shared by the GPU test and benchmark binaries: random layers in any dtype/layout, device
// copies of them, the skip protocol (exit code 77 with a printed reason when no CUDA device is
// visible) and the fault check that names the test whose kernel broke the CUDA context.
#ifndef KVC_TESTS_GPU_GPU_UTIL_H_
#define KVC_TESTS_GPU_GPU_UTIL_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kvc/layer.h"

namespace kvc::gpu_testing {

inline constexpr int kSkipExitCode = 77;
// A test left the CUDA context broken (a kernel fault): the binary stops at once, after printing
// "KVC-GPU-FAULT: <Suite.Test>: <error>" (tests/gpu/run.sh reruns the tests after it).
inline constexpr int kFaultExitCode = 3;

// Returns true when a CUDA device is visible; otherwise prints
// "SKIPPED: no CUDA device: <reason>" to stdout and returns false. The reason names the CUDA
// error and the driver's and runtime's CUDA versions (a driver older than the runtime kvc links
// statically looks like "no device" to the runtime; tests/gpu/run.sh fails such a skip when
// nvidia-smi sees a GPU).
bool DeviceOrSkipMessage();

// main() of a GPU test binary: parses GoogleTest's flags, skips (77) without a device, or when
// `also_needed` (may be empty) prints its own SKIPPED line and returns false, unless only listing
// tests; installs the fault check; runs the tests.
int RunGpuTests(int argc, char** argv, const std::function<bool()>& also_needed = {});

// Owns one layer's K, V and Q_obs buffers.
struct Layer {
  LayerShape shape;
  DType dtype = DType::kF16;
  Layout layout = Layout::kHND;
  int layer_index = 0;
  std::vector<uint8_t> k, v, q;
  LayerInput input() const;
};

// Random layer. Values are Gaussian-ish (a sum of three uniforms from a counter hash, so that large
// layers are generated on all cores in a second); key channel c of every head is scaled by a
// distinct factor (a seeded permutation of 1 + 3c/D), so that key channels differ in energy as
// real ones do and channel pruning has something to find.
Layer RandomLayer(const LayerShape& shape, DType dtype, Layout layout, uint64_t seed,
                  int layer_index = 0);

// The layer's K, V and Q_obs copied to device memory of `device` (freed by the destructor);
// input() views them with memory = kDevice. `ok` is false (with `error`) when a CUDA call failed.
class DeviceLayer {
 public:
  DeviceLayer(const Layer& layer, int device = 0);
  ~DeviceLayer();
  DeviceLayer(const DeviceLayer&) = delete;
  DeviceLayer& operator=(const DeviceLayer&) = delete;
  LayerInput input() const;
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  const Layer& layer_;
  void* k_ = nullptr;
  void* v_ = nullptr;
  void* q_ = nullptr;
  std::string error_;
};

// Number of visible CUDA devices (0 when none or on error).
int DeviceCount();

}  // namespace kvc::gpu_testing

#endif  // KVC_TESTS_GPU_GPU_UTIL_H_

// Test helper: kvc/noise.h evaluated on the device, for comparing it with the host bit for bit.
#ifndef KVC_TESTS_GPU_NOISE_KERNEL_H_
#define KVC_TESTS_GPU_NOISE_KERNEL_H_

#include <cuda_runtime_api.h>

#include <cstdint>

namespace kvc::gpu_testing {

// out[j] = CounterGumbel(seed, layer, head, row, col0 + j) and uniform[j] = CounterUniform(...)
// for j in [0, n), computed on the device (device pointers); synchronous.
cudaError_t DeviceNoise(uint64_t seed, uint32_t layer, uint32_t head, uint32_t row, uint32_t col0,
                        int n, float* uniform, float* gumbel);

// out[i] = NoiseLog(x[i]) on the device (device pointers); synchronous.
cudaError_t DeviceNoiseLog(const float* x, int n, float* out);

}  // namespace kvc::gpu_testing

#endif  // KVC_TESTS_GPU_NOISE_KERNEL_H_

#include "kvc/noise.h"
#include "noise_kernel.h"

namespace kvc::gpu_testing {
namespace {

__global__ void NoiseKernel(uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                            uint32_t col0, int n, float* uniform, float* gumbel) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= n) return;
  const uint32_t col = col0 + static_cast<uint32_t>(j);
  uniform[j] = CounterUniform(seed, layer, head, row, col);
  gumbel[j] = CounterGumbel(seed, layer, head, row, col);
}

__global__ void LogKernel(const float* x, int n, float* out) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = NoiseLog(x[i]);
}

}  // namespace

cudaError_t DeviceNoise(uint64_t seed, uint32_t layer, uint32_t head, uint32_t row, uint32_t col0,
                        int n, float* uniform, float* gumbel) {
  cudaGetLastError();  // drop a stale error: the check below is this launch's
  NoiseKernel<<<(n + 255) / 256, 256>>>(seed, layer, head, row, col0, n, uniform, gumbel);
  const cudaError_t e = cudaGetLastError();
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

cudaError_t DeviceNoiseLog(const float* x, int n, float* out) {
  cudaGetLastError();  // drop a stale error: the check below is this launch's
  LogKernel<<<(n + 255) / 256, 256>>>(x, n, out);
  const cudaError_t e = cudaGetLastError();
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

}  // namespace kvc::gpu_testing

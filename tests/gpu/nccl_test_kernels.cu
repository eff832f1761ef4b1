#include "nccl_test_kernels.h"

namespace kvc::gpu_testing {
namespace {

__global__ void SpinKernel(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

__global__ void FillKernel(uint8_t* dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = static_cast<uint8_t>(i * 131 + 7);
  }
}

}  // namespace

cudaError_t LaunchSlowFill(uint8_t* dst, size_t n, int spin_ms, cudaStream_t stream) {
  int device = 0, khz = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, device);
  if (khz <= 0) khz = 1500000;
  cudaGetLastError();  // drop a stale error: the check below is this launch's
  SpinKernel<<<1, 1, 0, stream>>>(static_cast<long long>(khz) * spin_ms);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  FillKernel<<<256, 256, 0, stream>>>(dst, n);
  return cudaGetLastError();
}

}  // namespace kvc::gpu_testing

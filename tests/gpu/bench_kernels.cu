#include <cuda_fp16.h>

#include <cmath>

#include "bench_kernels.h"

namespace kvc::gpu_testing {
namespace {

__device__ __forceinline__ float BlockMaxOrSum(float v, bool max, float* red) {
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, v, o);
    v = max ? fmaxf(v, w) : v + w;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();
  float r = max ? -INFINITY : 0.f;
  if (lane < warps) r = red[lane];
  for (int o = 16; o > 0; o >>= 1) {
    const float w = __shfl_xor_sync(0xffffffffu, r, o);
    r = max ? fmaxf(r, w) : r + w;
  }
  __syncthreads();
  return r;
}

__global__ void SoftmaxToHalfKernel(const float* __restrict__ scores, int cols,
                                    __half* __restrict__ probs) {
  __shared__ float red[32];
  const float* row = scores + static_cast<size_t>(blockIdx.x) * cols;
  __half* out = probs + static_cast<size_t>(blockIdx.x) * cols;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) mx = fmaxf(mx, row[j]);
  mx = BlockMaxOrSum(mx, true, red);
  float sum = 0.f;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) sum += expf(row[j] - mx);
  sum = BlockMaxOrSum(sum, false, red);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < cols; j += blockDim.x) {
    out[j] = __float2half(expf(row[j] - mx) * inv);
  }
}

}  // namespace

cudaError_t LaunchSoftmaxToHalf(const float* scores, int rows, int cols, void* probs_half,
                                cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (cols < 1) return cudaErrorInvalidValue;
  cudaGetLastError();  // drop a stale error: the check below is this launch's
  SoftmaxToHalfKernel<<<rows, 256, 0, stream>>>(scores, cols, static_cast<__half*>(probs_half));
  return cudaGetLastError();
}

}  // namespace kvc::gpu_testing

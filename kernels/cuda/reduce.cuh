// Block-wide reductions used by several kernels (blockDim.x a multiple of 32, <= 1024). All are
// shuffle trees of a fixed shape: deterministic, no atomics.
#ifndef KVC_KERNELS_CUDA_REDUCE_CUH_
#define KVC_KERNELS_CUDA_REDUCE_CUH_

#include <cuda_runtime.h>

namespace kvc::cuda {

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Every thread of the block gets the result. `smem` holds >= 32 floats; callers may reuse it
// after the call returns (the trailing barrier protects it).
template <bool kMax>
__device__ __forceinline__ float BlockReduce(float v, float* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = kMax ? WarpMax(v) : WarpSum(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  float r = kMax ? -INFINITY : 0.0f;
  if (lane < warps) r = smem[lane];
  r = kMax ? WarpMax(r) : WarpSum(r);
  __syncthreads();
  return r;
}

__device__ __forceinline__ double WarpSumDouble(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// BlockReduce<false> in double: every thread gets the sum; `smem` holds >= 32 doubles. The order
// of the additions is fixed by the block shape, so results repeat run to run.
__device__ __forceinline__ double BlockSumDouble(double v, double* smem) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = (blockDim.x + 31) >> 5;
  v = WarpSumDouble(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  double r = lane < warps ? smem[lane] : 0.0;
  r = WarpSumDouble(r);
  __syncthreads();
  return r;
}

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_REDUCE_CUH_

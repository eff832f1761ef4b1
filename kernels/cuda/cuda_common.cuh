// Device-side helpers shared by the CUDA kernels: element loads for fp32/fp16/bf16, tensor
// strides for HND/NHD, and the dispatch macros that turn runtime dtype and head_dim into template
// parameters (fixed head_dim 64/128/256, and a generic path for any other head_dim in [8, 256]).
#ifndef KVC_KERNELS_CUDA_CUDA_COMMON_CUH_
#define KVC_KERNELS_CUDA_CUDA_COMMON_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

#include "cuda/kernels.h"

namespace kvc::cuda {

// Element type tags; `Load` widens to fp32 exactly like kvc/dtype.h's LoadAsFloat.
struct F32 {
  using T = float;
  static __device__ __forceinline__ float Load(const T* p, size_t i) { return p[i]; }
};
struct F16 {
  using T = __half;
  static __device__ __forceinline__ float Load(const T* p, size_t i) { return __half2float(p[i]); }
};
struct BF16 {
  using T = __nv_bfloat16;
  static __device__ __forceinline__ float Load(const T* p, size_t i) {
    return __bfloat162float(p[i]);
  }
};

// Head-dim tag: kD > 0 is a compile-time head_dim (loops fully unrolled), 0 the generic path.
template <int kD>
struct HeadDim {
  static constexpr int kValue = kD;
  __device__ __forceinline__ static int Get(int runtime_d) { return kD > 0 ? kD : runtime_d; }
};

#define KVC_DISPATCH_DTYPE(dtype, TAG, ...) \
  [&]() -> cudaError_t {                    \
    switch (dtype) {                        \
      case ::kvc::cuda::ElemType::kF32: {   \
        using TAG = ::kvc::cuda::F32;       \
        return __VA_ARGS__();               \
      }                                     \
      case ::kvc::cuda::ElemType::kF16: {   \
        using TAG = ::kvc::cuda::F16;       \
        return __VA_ARGS__();               \
      }                                     \
      case ::kvc::cuda::ElemType::kBF16: {  \
        using TAG = ::kvc::cuda::BF16;      \
        return __VA_ARGS__();               \
      }                                     \
    }                                       \
    return cudaErrorInvalidValue;           \
  }()

#define KVC_DISPATCH_HEAD_DIM(head_dim, HD, ...)                          \
  [&]() -> cudaError_t {                                                  \
    if ((head_dim) < 8 || (head_dim) > 256) return cudaErrorInvalidValue; \
    switch (head_dim) {                                                   \
      case 64: {                                                          \
        using HD = ::kvc::cuda::HeadDim<64>;                              \
        return __VA_ARGS__();                                             \
      }                                                                   \
      case 128: {                                                         \
        using HD = ::kvc::cuda::HeadDim<128>;                             \
        return __VA_ARGS__();                                             \
      }                                                                   \
      case 256: {                                                         \
        using HD = ::kvc::cuda::HeadDim<256>;                             \
        return __VA_ARGS__();                                             \
      }                                                                   \
      default: {                                                          \
        using HD = ::kvc::cuda::HeadDim<0>;                               \
        return __VA_ARGS__();                                             \
      }                                                                   \
    }                                                                     \
  }()

// Launches kernel<<<grid, block, smem, stream>>>(args...) and returns the error of this launch:
// a bad configuration, or an earlier fault that broke the context. Unlike cudaGetLastError after
// <<<...>>>, it never reports an error that an earlier, unrelated runtime call left behind.
template <typename... KernelArgs, typename... Args>
inline cudaError_t Launch(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem,
                          cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

__device__ __forceinline__ int CeilDiv(int a, int b) { return (a + b - 1) / b; }

// Blocks of `threads` that cover n elements (a 1-D launch's grid).
inline unsigned Blocks(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// Total order on floats for selection, consistent with the CPU's comparisons: NaN sorts below
// everything (it never wins a slot) and -0 equals +0 (so the position breaks that tie).
__device__ __forceinline__ uint32_t OrderedKey(float f) {
  if (isnan(f)) return 0u;
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_CUDA_COMMON_CUH_

// Gather of kept tokens and channels into the compact blob (kvc/compact.h), and KIVI-style
// quantization of the old blocks. Quantization mirrors kernels/core/quantize.cc operation by
// operation with explicitly rounded intrinsics (no contraction into FMA), so that codes, scales
// and zeros are bit-identical to the CPU backend's for the same input.
#include "cuda/cuda_common.cuh"

namespace kvc::cuda {
namespace {

// Raw element bits: full-precision blocks are copied, never converted, so they are exact.
template <int kBytes>
struct Raw;
template <>
struct Raw<2> {
  using T = uint16_t;
};
template <>
struct Raw<4> {
  using T = uint32_t;
};

// Grid (n_kept, Hkv): block (j, h) writes kept row j of head h: the old part (pruned channels,
// raw or to the fp32 scratch for quantization) or the recent part (all D channels).
template <typename E, int kBytes>
__global__ void GatherKernel(PackArgs a) {
  using R = typename Raw<kBytes>::T;
  const int j = blockIdx.x, h = blockIdx.y;
  const HeadOffsets& off = a.offsets[h];
  const R* k = static_cast<const R*>(a.k);
  const R* v = static_cast<const R*>(a.v);
  const int32_t pos = a.positions[static_cast<size_t>(h) * a.n_kept + j];
  const int m = a.n_kept - a.n_recent;
  const int64_t krow = h * a.ks.head + pos * a.ks.token;
  const int64_t vrow = h * a.vs.head + pos * a.vs.token;
  if (threadIdx.x == 0) reinterpret_cast<int32_t*>(a.blob + off.positions)[j] = pos;
  if (j == 0) {
    for (int c = threadIdx.x; c < a.key_channels; c += blockDim.x) {
      reinterpret_cast<int32_t*>(a.blob + off.key_idx)[c] =
          a.key_idx[static_cast<size_t>(h) * a.key_channels + c];
    }
    for (int c = threadIdx.x; c < a.value_channels; c += blockDim.x) {
      reinterpret_cast<int32_t*>(a.blob + off.value_idx)[c] =
          a.value_idx[static_cast<size_t>(h) * a.value_channels + c];
    }
  }
  if (j < m) {
    const int32_t* kidx = a.key_idx + static_cast<size_t>(h) * a.key_channels;
    const int32_t* vidx = a.value_idx + static_cast<size_t>(h) * a.value_channels;
    // Full-precision old rows are copied into the blob; quantized ones gathered as fp32 into
    // the scratch (keys, then values, per head) for LaunchQuantize.
    const auto* ke = static_cast<const typename E::T*>(a.k);
    const auto* ve = static_cast<const typename E::T*>(a.v);
    const size_t per_head = static_cast<size_t>(m) * (a.key_channels + a.value_channels);
    if (a.bits == 0) {
      R* kd = reinterpret_cast<R*>(a.blob + off.key_old) + static_cast<size_t>(j) * a.key_channels;
      for (int c = threadIdx.x; c < a.key_channels; c += blockDim.x) kd[c] = k[krow + kidx[c]];
    } else {
      float* kd = a.scratch + h * per_head + static_cast<size_t>(j) * a.key_channels;
      for (int c = threadIdx.x; c < a.key_channels; c += blockDim.x) {
        kd[c] = E::Load(ke, krow + kidx[c]);
      }
    }
    if (a.value_bits == 0) {
      R* vd =
          reinterpret_cast<R*>(a.blob + off.value_old) + static_cast<size_t>(j) * a.value_channels;
      for (int c = threadIdx.x; c < a.value_channels; c += blockDim.x) vd[c] = v[vrow + vidx[c]];
    } else {
      float* vd = a.scratch + h * per_head + static_cast<size_t>(m) * a.key_channels +
                  static_cast<size_t>(j) * a.value_channels;
      for (int c = threadIdx.x; c < a.value_channels; c += blockDim.x) {
        vd[c] = E::Load(ve, vrow + vidx[c]);
      }
    }
  } else {
    const size_t r = static_cast<size_t>(j - m) * a.head_dim;
    R* kd = reinterpret_cast<R*>(a.blob + off.key_recent) + r;
    R* vd = reinterpret_cast<R*>(a.blob + off.value_recent) + r;
    for (int c = threadIdx.x; c < a.head_dim; c += blockDim.x) {
      kd[c] = k[krow + c];
      vd[c] = v[vrow + c];
    }
  }
}

// code = clamp(round((x - zero) * inv)) exactly as the CPU computes it; NaN maps to 0.
__device__ __forceinline__ uint32_t Encode(float x, float zero, float inv, float qmax) {
  float v = __fmul_rn(__fsub_rn(x, zero), inv);
  v = v > 0.0f ? v : 0.0f;
  v = v < qmax ? v : qmax;
  return static_cast<uint32_t>(static_cast<int>(__fadd_rn(v, 0.5f)));
}

__device__ __forceinline__ float InvScale(float sc) {
  return sc > 0.0f ? __fdiv_rn(1.0f, sc) : 0.0f;
}

// Grid (ceil(m / G), Hkv): keys are quantized per channel over groups of G tokens.
__global__ void QuantizeKeysKernel(PackArgs a) {
  const int gi = blockIdx.x, h = blockIdx.y;
  const int m = a.n_kept - a.n_recent, t = a.key_channels;
  const int r0 = gi * a.group, rows = min(a.group, m - r0);
  const float qmax = static_cast<float>((1 << a.bits) - 1);
  const size_t per_head = static_cast<size_t>(m) * (a.key_channels + a.value_channels);
  const float* x = a.scratch + h * per_head + static_cast<size_t>(r0) * t;
  const HeadOffsets& off = a.offsets[h];
  float* scale = reinterpret_cast<float*>(a.blob + off.key_scale) + static_cast<size_t>(gi) * t;
  float* zero = reinterpret_cast<float*>(a.blob + off.key_zero) + static_cast<size_t>(gi) * t;
  for (int c = threadIdx.x; c < t; c += blockDim.x) {
    float lo = x[c], hi = x[c];
    for (int r = 1; r < rows; ++r) {
      const float y = x[static_cast<size_t>(r) * t + c];
      lo = y < lo ? y : lo;
      hi = y > hi ? y : hi;
    }
    scale[c] = __fdiv_rn(__fsub_rn(hi, lo), qmax);
    zero[c] = lo;
  }
  __syncthreads();
  const int per_byte = 8 / a.bits;
  const int row_bytes = (t * a.bits + 7) / 8;
  uint8_t* codes = a.blob + off.key_codes;
  for (int e = threadIdx.x; e < rows * row_bytes; e += blockDim.x) {
    const int r = e / row_bytes, b = e % row_bytes;
    const float* xr = x + static_cast<size_t>(r) * t;
    uint32_t byte = 0;
    for (int i = 0; i < per_byte; ++i) {
      const int c = b * per_byte + i;
      if (c >= t) break;
      byte |= Encode(xr[c], zero[c], InvScale(scale[c]), qmax) << (i * a.bits);
    }
    codes[static_cast<size_t>(r0 + r) * row_bytes + b] = static_cast<uint8_t>(byte);
  }
}

// Grid (m, Hkv): values are quantized per token over groups of G channels.
__global__ void QuantizeValuesKernel(PackArgs a) {
  const int j = blockIdx.x, h = blockIdx.y;
  const int m = a.n_kept - a.n_recent, t = a.value_channels;
  const int groups = 1 + (t - 1) / a.group;  // t >= 1
  const int bits = a.value_bits;
  const float qmax = static_cast<float>((1 << bits) - 1);
  const size_t per_head = static_cast<size_t>(m) * (a.key_channels + a.value_channels);
  const float* x = a.scratch + h * per_head + static_cast<size_t>(m) * a.key_channels +
                   static_cast<size_t>(j) * t;
  const HeadOffsets& off = a.offsets[h];
  float* scale =
      reinterpret_cast<float*>(a.blob + off.value_scale) + static_cast<size_t>(j) * groups;
  float* zero = reinterpret_cast<float*>(a.blob + off.value_zero) + static_cast<size_t>(j) * groups;
  for (int gi = threadIdx.x; gi < groups; gi += blockDim.x) {
    const int c0 = gi * a.group, n = min(a.group, t - c0);
    float lo = x[c0], hi = x[c0];
    for (int c = c0 + 1; c < c0 + n; ++c) {
      lo = x[c] < lo ? x[c] : lo;
      hi = x[c] > hi ? x[c] : hi;
    }
    scale[gi] = __fdiv_rn(__fsub_rn(hi, lo), qmax);
    zero[gi] = lo;
  }
  __syncthreads();
  const int per_byte = 8 / bits;
  const int row_bytes = (t * bits + 7) / 8;
  uint8_t* codes = a.blob + off.value_codes + static_cast<size_t>(j) * row_bytes;
  for (int b = threadIdx.x; b < row_bytes; b += blockDim.x) {
    uint32_t byte = 0;
    for (int i = 0; i < per_byte; ++i) {
      const int c = b * per_byte + i;
      if (c >= t) break;
      const int gi = c / a.group;
      byte |= Encode(x[c], zero[gi], InvScale(scale[gi]), qmax) << (i * bits);
    }
    codes[b] = static_cast<uint8_t>(byte);
  }
}

}  // namespace

size_t PackScratchFloats(int num_kv_heads, int m, int key_channels, int value_channels) {
  return static_cast<size_t>(num_kv_heads) * m *
         (static_cast<size_t>(key_channels) + value_channels);
}

cudaError_t LaunchPack(const PackArgs& a, cudaStream_t stream) {
  if (a.n_kept < 1 || a.num_kv_heads < 1) return cudaErrorInvalidValue;
  const dim3 grid(a.n_kept, a.num_kv_heads);
  const int threads = a.head_dim >= 128 ? 128 : 64;
  return KVC_DISPATCH_DTYPE(a.dtype, E, [&] {
    return Launch(GatherKernel<E, static_cast<int>(sizeof(typename E::T))>, grid, threads, 0,
                  stream, a);
  });
}

cudaError_t LaunchQuantize(const PackArgs& a, cudaStream_t stream) {
  const int m = a.n_kept - a.n_recent;
  if (m == 0) return cudaSuccess;
  if (a.bits > 0) {
    KVC_CUDA_CALL(Launch(QuantizeKeysKernel, dim3(1 + (m - 1) / a.group, a.num_kv_heads), 128, 0,
                         stream, a));
  }
  if (a.value_bits == 0) return cudaSuccess;
  return Launch(QuantizeValuesKernel, dim3(m, a.num_kv_heads), 64, 0, stream, a);
}

}  // namespace kvc::cuda

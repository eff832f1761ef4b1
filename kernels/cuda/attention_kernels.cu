// Decode attention directly over the packed blob: pruned key channels are absent from the dot
// product, pruned value channels contribute zero, quantized blocks are dequantized on the fly,
// and the uncompressed new tokens are attended causally after the cache.
#include "cuda/cuda_common.cuh"
#include "cuda/reduce.cuh"

namespace kvc::cuda {
namespace {

__device__ __forceinline__ uint32_t CodeAt(const uint8_t* row, int i, int bits) {
  const int bit = i * bits;
  return (row[bit >> 3] >> (bit & 7)) & ((1u << bits) - 1u);
}

template <typename T>
__device__ __forceinline__ const T* At(const uint8_t* blob, uint64_t off) {
  return reinterpret_cast<const T*>(blob + off);
}

// One block per (query head, query row).
template <typename E>
__global__ void PackedAttentionKernel(AttnArgs a) {
  using T = typename E::T;
  __shared__ float sq[256];
  __shared__ int vinv[256];
  __shared__ float red[32];
  const int hq = blockIdx.x / a.n_q, i = blockIdx.x % a.n_q;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int h = hq / group;
  const AttnHead hd = a.heads[h];
  const int d = a.head_dim, m = hd.n_kept - hd.n_recent;
  const int n_new_vis = a.n_new - a.n_q + i + 1;
  const int total = hd.n_kept + n_new_vis;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const int32_t* kidx = At<int32_t>(a.blob, hd.key_idx);
  const int32_t* vidx = At<int32_t>(a.blob, hd.value_idx);
  const int kq_bytes = (hd.key_channels * a.bits + 7) / 8;
  const int vq_bytes = (hd.value_channels * a.bits + 7) / 8;
  // Written without Tv + G - 1: G comes from the blob header and may be as large as INT32_MAX.
  const int v_groups =
      a.bits > 0 && hd.value_channels > 0 ? 1 + (hd.value_channels - 1) / a.group : 0;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    sq[c] = a.q[(static_cast<size_t>(hq) * a.n_q + i) * d + c];
    vinv[c] = -1;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < hd.value_channels; c += blockDim.x) vinv[vidx[c]] = c;
  float* p = a.scratch + static_cast<size_t>(blockIdx.x) * (a.max_kept + a.n_new);
  float mx = -INFINITY;
  for (int t = threadIdx.x; t < total; t += blockDim.x) {
    float s = 0.f;
    if (t < m) {
      if (a.bits == 0) {
        const T* row = At<T>(a.blob, hd.key_old) + static_cast<size_t>(t) * hd.key_channels;
        for (int c = 0; c < hd.key_channels; ++c) s = fmaf(sq[kidx[c]], E::Load(row, c), s);
      } else {
        const float* sc =
            At<float>(a.blob, hd.key_scale) + static_cast<size_t>(t / a.group) * hd.key_channels;
        const float* ze =
            At<float>(a.blob, hd.key_zero) + static_cast<size_t>(t / a.group) * hd.key_channels;
        const uint8_t* row = At<uint8_t>(a.blob, hd.key_codes) + static_cast<size_t>(t) * kq_bytes;
        for (int c = 0; c < hd.key_channels; ++c) {
          const float x = static_cast<float>(CodeAt(row, c, a.bits)) * sc[c] + ze[c];
          s = fmaf(sq[kidx[c]], x, s);
        }
      }
    } else if (t < hd.n_kept) {
      const T* row = At<T>(a.blob, hd.key_recent) + static_cast<size_t>(t - m) * d;
      for (int c = 0; c < d; ++c) s = fmaf(sq[c], E::Load(row, c), s);
    } else {
      const float* row = a.k_new + (static_cast<size_t>(h) * a.n_new + (t - hd.n_kept)) * d;
      for (int c = 0; c < d; ++c) s = fmaf(sq[c], row[c], s);
    }
    s *= scale;
    p[t] = s;
    mx = fmaxf(mx, s);
  }
  mx = BlockReduce<true>(mx, red);
  float sum = 0.f;
  for (int t = threadIdx.x; t < total; t += blockDim.x) {
    const float e = expf(p[t] - mx);
    p[t] = e;
    sum += e;
  }
  sum = BlockReduce<false>(sum, red);
  const float inv = 1.0f / sum;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    const int ci = vinv[c];
    if (ci >= 0) {
      for (int t = 0; t < m; ++t) {
        float x;
        if (a.bits == 0) {
          x = E::Load(At<T>(a.blob, hd.value_old) + static_cast<size_t>(t) * hd.value_channels, ci);
        } else {
          const size_t g = static_cast<size_t>(t) * v_groups + ci / a.group;
          const uint8_t* row =
              At<uint8_t>(a.blob, hd.value_codes) + static_cast<size_t>(t) * vq_bytes;
          x = static_cast<float>(CodeAt(row, ci, a.bits)) * At<float>(a.blob, hd.value_scale)[g] +
              At<float>(a.blob, hd.value_zero)[g];
        }
        acc = fmaf(p[t], x, acc);
      }
    }
    const T* vr = At<T>(a.blob, hd.value_recent);
    for (int t = m; t < hd.n_kept; ++t) {
      acc = fmaf(p[t], E::Load(vr, static_cast<size_t>(t - m) * d + c), acc);
    }
    for (int t = hd.n_kept; t < total; ++t) {
      acc = fmaf(p[t], a.v_new[(static_cast<size_t>(h) * a.n_new + (t - hd.n_kept)) * d + c], acc);
    }
    a.out[(static_cast<size_t>(hq) * a.n_q + i) * d + c] = acc * inv;
  }
}

}  // namespace

size_t AttnScratchFloats(int num_q_heads, int n_q, int max_kept, int n_new) {
  return static_cast<size_t>(num_q_heads) * n_q * (static_cast<size_t>(max_kept) + n_new);
}

cudaError_t LaunchPackedAttention(const AttnArgs& a, cudaStream_t stream) {
  if (a.n_q < 1 || a.num_q_heads < 1 || a.head_dim < 8 || a.head_dim > 256) {
    return cudaErrorInvalidValue;
  }
  return KVC_DISPATCH_DTYPE(a.dtype, E, [&] {
    PackedAttentionKernel<E><<<a.num_q_heads * a.n_q, 128, 0, stream>>>(a);
    return LastLaunchError();
  });
}

}  // namespace kvc::cuda

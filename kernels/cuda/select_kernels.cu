// Selection: top-k kept positions per head (radix select on an order-preserving key, then an
// ordered scan so ties go to the lower position) and key/value channel selection.
#include <cub/block/block_scan.cuh>

#include "cuda/cuda_common.cuh"
#include "cuda/reduce.cuh"

namespace kvc::cuda {
namespace {

constexpr int kSelectThreads = 512;
constexpr uint32_t kProtectedKey = 0xffffffffu;  // above OrderedKey(+inf)

__device__ __forceinline__ uint32_t TokenKey(const float* row, int j, int sink_end,
                                             int recent_begin) {
  return (j < sink_end || j >= recent_begin) ? kProtectedKey : OrderedKey(row[j]);
}

// One block per row. Four 8-bit radix passes find the k-th largest key T and how many elements
// equal to T still fit (`need`); a final ordered pass keeps key > T and the first `need`
// positions with key == T, writing them in ascending order.
__global__ void TopKKernel(const float* __restrict__ scores, int seq_len, int k, int sink_end,
                           int recent_begin, int32_t* __restrict__ out) {
  using Scan = cub::BlockScan<int, kSelectThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int hist[256];
  __shared__ uint32_t s_prefix;
  __shared__ int s_remaining;
  __shared__ int s_running_eq, s_running_keep;
  const float* row = scores + static_cast<size_t>(blockIdx.x) * seq_len;
  int32_t* dst = out + static_cast<size_t>(blockIdx.x) * k;
  if (threadIdx.x == 0) {
    s_prefix = 0;
    s_remaining = k;
  }
  uint32_t mask = 0;
  for (int shift = 24; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < 256; b += blockDim.x) hist[b] = 0;
    __syncthreads();
    const uint32_t prefix = s_prefix;
    for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
      const uint32_t key = TokenKey(row, j, sink_end, recent_begin);
      if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      int above = 0;
      int b = 255;
      for (; b > 0; --b) {
        if (above + hist[b] >= s_remaining) break;
        above += hist[b];
      }
      s_remaining -= above;
      s_prefix = prefix | (static_cast<uint32_t>(b) << shift);
    }
    mask |= 0xffu << shift;
    __syncthreads();
  }
  const uint32_t threshold = s_prefix;
  const int need = s_remaining;
  if (threadIdx.x == 0) {
    s_running_eq = 0;
    s_running_keep = 0;
  }
  __syncthreads();
  for (int base = 0; base < seq_len; base += blockDim.x) {
    const int j = base + threadIdx.x;
    const uint32_t key = j < seq_len ? TokenKey(row, j, sink_end, recent_begin) : 0u;
    const int eq = (j < seq_len && key == threshold) ? 1 : 0;
    int eq_rank, eq_total;
    Scan(scan_tmp).ExclusiveSum(eq, eq_rank, eq_total);
    __syncthreads();
    const int keep =
        (j < seq_len && (key > threshold || (eq && s_running_eq + eq_rank < need))) ? 1 : 0;
    int keep_rank, keep_total;
    Scan(scan_tmp).ExclusiveSum(keep, keep_rank, keep_total);
    if (keep && s_running_keep + keep_rank < k) dst[s_running_keep + keep_rank] = j;
    __syncthreads();
    if (threadIdx.x == 0) {
      s_running_eq += eq_total;
      s_running_keep += keep_total;
    }
    __syncthreads();
  }
}

// One block per KV head, one thread per channel: key channel scores over the m oldest kept
// tokens, in the CPU engine's order of operations.
template <typename E>
__global__ void KeyChannelScoreKernel(ChannelArgs a, float* __restrict__ key_scores) {
  const int h = blockIdx.x, c = threadIdx.x;
  if (c >= a.head_dim) return;
  const auto* k = static_cast<const typename E::T*>(a.k);
  const int32_t* pos = a.positions + static_cast<size_t>(h) * a.n_kept;
  float s = 0.f;
  for (int j = 0; j < a.m; ++j) {
    const float x = E::Load(k, h * a.ks.head + pos[j] * a.ks.token + c);
    s = a.key_policy == 2 ? s + fabsf(x) : fmaf(x, x, s);
  }
  if (a.key_policy == 3) {
    s = sqrtf(s);
  } else if (a.key_policy == 1) {
    const auto* q = static_cast<const typename E::T*>(a.q);
    const int group = a.num_q_heads / a.num_kv_heads;
    float qsq = 0.f;
    for (int g = 0; g < group; ++g) {
      for (int i = 0; i < a.obs_window; ++i) {
        const float x = E::Load(q, (h * group + g) * a.qs.head + i * a.qs.token + c);
        qsq = fmaf(x, x, qsq);
      }
    }
    const float inv =
        a.m > 0 ? 1.0f / (static_cast<float>(group * a.obs_window) * static_cast<float>(a.m))
                : 0.0f;
    s *= qsq * inv;
  }
  key_scores[h * a.head_dim + c] = s;
}

// One block per (query head, query row): the causal softmax over all n_kept kept tokens (what
// decode attention will see), then o[c] = sum over the m old tokens of p_j v[pos_j, c].
template <typename E>
__global__ void ValueAttnKernel(ChannelArgs a, float* __restrict__ probs, float* __restrict__ o) {
  __shared__ float sq[256];
  __shared__ float red[32];
  const int r = blockIdx.x;
  const int hq = r / a.obs_window, i = r % a.obs_window;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int h = hq / group;
  const auto* q = static_cast<const typename E::T*>(a.q);
  const auto* k = static_cast<const typename E::T*>(a.k);
  const auto* v = static_cast<const typename E::T*>(a.v);
  const int32_t* pos = a.positions + static_cast<size_t>(h) * a.n_kept;
  const int qpos = a.seq_len - a.obs_window + i;
  const float scale = 1.0f / sqrtf(static_cast<float>(a.head_dim));
  for (int c = threadIdx.x; c < a.head_dim; c += blockDim.x) {
    sq[c] = E::Load(q, hq * a.qs.head + i * a.qs.token + c);
  }
  __syncthreads();
  float* p = probs + static_cast<size_t>(r) * a.n_kept;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < a.n_kept; j += blockDim.x) {
    float x = -INFINITY;
    if (pos[j] <= qpos) {
      const int64_t row = h * a.ks.head + pos[j] * a.ks.token;
      float s = 0.f;
      for (int c = 0; c < a.head_dim; ++c) s = fmaf(sq[c], E::Load(k, row + c), s);
      x = s * scale;
    }
    p[j] = x;
    mx = fmaxf(mx, x);
  }
  mx = BlockReduce<true>(mx, red);
  float sum = 0.f;
  for (int j = threadIdx.x; j < a.n_kept; j += blockDim.x) {
    const float e = p[j] == -INFINITY ? 0.f : expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  sum = BlockReduce<false>(sum, red);
  const float inv = sum > 0.f ? 1.0f / sum : 0.f;
  for (int c = threadIdx.x; c < a.head_dim; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < a.m; ++j) {
      acc = fmaf(p[j] * inv, E::Load(v, h * a.vs.head + pos[j] * a.vs.token + c), acc);
    }
    o[static_cast<size_t>(r) * a.head_dim + c] = acc;
  }
}

__global__ void ValueChannelScoreKernel(const float* __restrict__ o, int group, int obs_window,
                                        int head_dim, float* __restrict__ value_scores) {
  const int h = blockIdx.x, c = threadIdx.x;
  if (c >= head_dim) return;
  float s = 0.f;
  for (int r = h * group * obs_window; r < (h + 1) * group * obs_window; ++r) {
    const float x = o[static_cast<size_t>(r) * head_dim + c];
    s = fmaf(x, x, s);
  }
  value_scores[h * head_dim + c] = s;
}

// One block per head: keeps the `keep` channels of highest score (ties: lower index), ascending.
__global__ void ChannelTopKernel(const float* __restrict__ scores, int head_dim, int keep,
                                 int32_t* __restrict__ out) {
  __shared__ uint32_t keys[256];
  __shared__ int flags[256];
  const int h = blockIdx.x, c = threadIdx.x;
  if (c < head_dim) keys[c] = OrderedKey(scores[h * head_dim + c]);
  __syncthreads();
  if (c < head_dim) {
    int rank = 0;
    for (int o = 0; o < head_dim; ++o) {
      rank += (keys[o] > keys[c] || (keys[o] == keys[c] && o < c)) ? 1 : 0;
    }
    flags[c] = rank < keep ? 1 : 0;
  }
  __syncthreads();
  if (c == 0) {
    int n = 0;
    for (int o = 0; o < head_dim; ++o) {
      if (flags[o]) out[h * keep + n++] = o;
    }
  }
}

__global__ void IotaKernel(int num_heads, int n, int32_t* __restrict__ out) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx < num_heads * n) out[idx] = idx % n;
}

}  // namespace

cudaError_t LaunchTopKPositions(const float* scores, int rows, int seq_len, int k, int sink_end,
                                int recent_begin, int32_t* out, cudaStream_t stream) {
  if (k < 1 || k > seq_len || rows < 1) return cudaErrorInvalidValue;
  TopKKernel<<<rows, kSelectThreads, 0, stream>>>(scores, seq_len, k, sink_end, recent_begin, out);
  return LastLaunchError();
}

size_t ChannelScratchFloats(int num_kv_heads, int num_q_heads, int obs_window, int n_kept,
                            int head_dim) {
  return 2 * static_cast<size_t>(num_kv_heads) * head_dim +
         static_cast<size_t>(num_q_heads) * obs_window * (static_cast<size_t>(n_kept) + head_dim);
}

cudaError_t LaunchSelectChannels(const ChannelArgs& a, cudaStream_t stream) {
  float* key_scores = a.scratch;
  float* value_scores = key_scores + static_cast<size_t>(a.num_kv_heads) * a.head_dim;
  float* probs = value_scores + static_cast<size_t>(a.num_kv_heads) * a.head_dim;
  float* o = probs + static_cast<size_t>(a.num_q_heads) * a.obs_window * a.n_kept;
  const int hkv = a.num_kv_heads, d = a.head_dim;
  cudaError_t err = cudaSuccess;
  if (a.key_policy != 0 && a.key_channels < d) {
    err = KVC_DISPATCH_DTYPE(a.dtype, E, [&] {
      KeyChannelScoreKernel<E><<<hkv, 256, 0, stream>>>(a, key_scores);
      return LastLaunchError();
    });
    if (err != cudaSuccess) return err;
    ChannelTopKernel<<<hkv, 256, 0, stream>>>(key_scores, d, a.key_channels, a.key_idx);
  } else {
    IotaKernel<<<(hkv * a.key_channels + 255) / 256, 256, 0, stream>>>(hkv, a.key_channels,
                                                                       a.key_idx);
  }
  KVC_CUDA_CALL(LastLaunchError());
  if (a.prune_values && a.value_channels < d) {
    err = KVC_DISPATCH_DTYPE(a.dtype, E, [&] {
      ValueAttnKernel<E><<<a.num_q_heads * a.obs_window, 256, 0, stream>>>(a, probs, o);
      return LastLaunchError();
    });
    if (err != cudaSuccess) return err;
    ValueChannelScoreKernel<<<hkv, 256, 0, stream>>>(o, a.num_q_heads / hkv, a.obs_window, d,
                                                     value_scores);
    KVC_CUDA_CALL(LastLaunchError());
    ChannelTopKernel<<<hkv, 256, 0, stream>>>(value_scores, d, a.value_channels, a.value_idx);
  } else {
    IotaKernel<<<(hkv * a.value_channels + 255) / 256, 256, 0, stream>>>(hkv, a.value_channels,
                                                                         a.value_idx);
  }
  return LastLaunchError();
}

}  // namespace kvc::cuda

// Token scoring: Q_obs K^T (causal), softmax (with optional Gumbel noise), group average, SnapKV
// pooling, key norms and seeded random scores.
//
// Q K^T is a tiled kernel on CUDA cores with fp32 accumulation (32 queries x 64 keys per block,
// head_dim streamed through shared memory in chunks of 32). The observation window is small
// (W = 32 by default), so the product is bandwidth-bound on K and tensor cores would add little.
#include <cmath>

#include "cuda/cuda_common.cuh"
#include "cuda/reduce.cuh"
#include "kvc/noise.h"

namespace kvc::cuda {
namespace {

constexpr int kTileQ = 32;
constexpr int kTileK = 64;
constexpr int kChunk = 32;
constexpr int kThreads = 256;

template <typename E, typename HD>
__global__ void QKLogitsKernel(const typename E::T* __restrict__ q, Strides qs,
                               const typename E::T* __restrict__ k, Strides ks, int group,
                               int obs_window, int row0, int rows, int seq_len, int runtime_d,
                               float scale, float* __restrict__ logits) {
  __shared__ float sq[kTileQ][kChunk + 1];
  __shared__ float sk[kTileK][kChunk + 1];
  const int d = HD::Get(runtime_d);
  const int hq = blockIdx.z, hkv = hq / group;
  const int i0 = blockIdx.y * kTileQ, j0 = blockIdx.x * kTileK;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  // Local row i is query row0 + i, at prompt position seq_len - obs_window + row0 + i; it sees
  // keys j <= that position.
  const int first_pos = seq_len - obs_window + row0 + i0;
  const int last_pos = first_pos + kTileQ - 1;
  const bool all_masked = j0 > last_pos;

  float acc[2][4] = {};
  if (!all_masked) {
    for (int c0 = 0; c0 < d; c0 += kChunk) {
      for (int e = tid; e < kTileQ * kChunk; e += kThreads) {
        const int r = e / kChunk, c = e % kChunk;
        const int i = i0 + r, ch = c0 + c;
        sq[r][c] =
            (i < rows && ch < d) ? E::Load(q, hq * qs.head + (row0 + i) * qs.token + ch) : 0.f;
      }
      for (int e = tid; e < kTileK * kChunk; e += kThreads) {
        const int r = e / kChunk, c = e % kChunk;
        const int j = j0 + r, ch = c0 + c;
        sk[r][c] = (j < seq_len && ch < d) ? E::Load(k, hkv * ks.head + j * ks.token + ch) : 0.f;
      }
      __syncthreads();
#pragma unroll 8
      for (int c = 0; c < kChunk; ++c) {
        const float a0 = sq[ty * 2][c], a1 = sq[ty * 2 + 1][c];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float b = sk[tx + 16 * x][c];
          acc[0][x] = fmaf(a0, b, acc[0][x]);
          acc[1][x] = fmaf(a1, b, acc[1][x]);
        }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int y = 0; y < 2; ++y) {
    const int i = i0 + ty * 2 + y;
    if (i >= rows) continue;
    const int pos = seq_len - obs_window + row0 + i;
    float* row = logits + (static_cast<size_t>(hq) * rows + i) * seq_len;
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int j = j0 + tx + 16 * x;
      if (j < seq_len) row[j] = j <= pos ? acc[y][x] * scale : -INFINITY;
    }
  }
}

__global__ void SoftmaxRowsKernel(float* __restrict__ logits, int obs_window, int row0, int rows,
                                  int seq_len, bool gumbel, uint64_t seed, uint32_t layer,
                                  float inv_tau) {
  __shared__ float red[32];
  const int r = blockIdx.x;
  const int hq = r / rows, i = row0 + r % rows;    // i: the query's row in the whole window
  const int valid = seq_len - obs_window + i + 1;  // keys 0 .. pos
  float* row = logits + static_cast<size_t>(r) * seq_len;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < valid; j += blockDim.x) {
    float x = row[j];
    if (gumbel) {
      x = (x + CounterGumbel(seed, layer, static_cast<uint32_t>(hq), static_cast<uint32_t>(i),
                             static_cast<uint32_t>(j))) *
          inv_tau;
      row[j] = x;
    }
    mx = fmaxf(mx, x);
  }
  mx = BlockReduce<true>(mx, red);
  float sum = 0.f;
  for (int j = threadIdx.x; j < valid; j += blockDim.x) sum += expf(row[j] - mx);
  sum = BlockReduce<false>(sum, red);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    row[j] = j < valid ? expf(row[j] - mx) * inv : 0.f;
  }
}

__global__ void GroupColumnSumKernel(const float* __restrict__ probs, int group, int rows,
                                     int seq_len, int num_kv_heads, bool accumulate,
                                     float* __restrict__ scores) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(num_kv_heads) * seq_len) return;
  const int h = static_cast<int>(idx / seq_len), j = static_cast<int>(idx % seq_len);
  float s = 0.f;
  for (int g = 0; g < group; ++g) {
    const float* p = probs + static_cast<size_t>(h * group + g) * rows * seq_len + j;
    for (int i = 0; i < rows; ++i) s += p[static_cast<size_t>(i) * seq_len];
  }
  s /= static_cast<float>(group);
  scores[idx] = accumulate ? scores[idx] + s : s;
}

__global__ void Pool1dKernel(const float* __restrict__ in, int rows, int seq_len, int len,
                             int kernel, bool avg, float* __restrict__ out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(rows) * seq_len) return;
  const int j = static_cast<int>(idx % seq_len);
  const float* row = in + (idx - j);
  if (j >= len) {
    out[idx] = row[j];
    return;
  }
  const int lo = max(0, j - kernel / 2), hi = min(len - 1, j + kernel / 2);
  float acc = avg ? 0.f : -INFINITY;
  // Same order of operations as the CPU (running max from the left, left-to-right sum).
  if (!avg) acc = row[lo];
  for (int t = avg ? lo : lo + 1; t <= hi; ++t) acc = avg ? acc + row[t] : fmaxf(acc, row[t]);
  out[idx] = avg ? acc / static_cast<float>(hi - lo + 1) : acc;
}

// One warp per (head, token) so that the channel loads of a token are coalesced.
template <typename E>
__global__ void KeyNormKernel(const typename E::T* __restrict__ k, Strides ks, int num_kv_heads,
                              int seq_len, int head_dim, float* __restrict__ scores) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<int64_t>(num_kv_heads) * seq_len) return;
  const int h = static_cast<int>(w / seq_len), j = static_cast<int>(w % seq_len);
  float s = 0.f;
  for (int c = lane; c < head_dim; c += 32) {
    const float x = E::Load(k, h * ks.head + j * ks.token + c);
    s = fmaf(x, x, s);
  }
  s = WarpSum(s);
  if (lane == 0) scores[w] = -sqrtf(s);
}

__global__ void RandomScoresKernel(int num_kv_heads, int seq_len, uint64_t seed, uint32_t layer,
                                   float* __restrict__ scores) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(num_kv_heads) * seq_len) return;
  const int h = static_cast<int>(idx / seq_len), j = static_cast<int>(idx % seq_len);
  scores[idx] = CounterUniform(seed, layer, static_cast<uint32_t>(h), 0u, static_cast<uint32_t>(j));
}

__global__ void SumHeadsKernel(const float* __restrict__ scores, int num_kv_heads, int seq_len,
                               float* __restrict__ out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= seq_len) return;
  float s = 0.f;
  for (int h = 0; h < num_kv_heads; ++h) s += scores[static_cast<size_t>(h) * seq_len + j];
  out[j] = s;
}

unsigned Blocks(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

}  // namespace

cudaError_t LaunchQKLogits(ElemType dtype, const void* q, Strides qs, const void* k, Strides ks,
                           int num_q_heads, int num_kv_heads, int obs_window, QueryRows qr,
                           int seq_len, int head_dim, float scale, float* logits,
                           cudaStream_t stream) {
  if (qr.rows <= 0) return cudaSuccess;
  if (qr.row0 < 0 || qr.row0 + qr.rows > obs_window) return cudaErrorInvalidValue;
  const dim3 grid((seq_len + kTileK - 1) / kTileK, (qr.rows + kTileQ - 1) / kTileQ, num_q_heads);
  const int group = num_q_heads / num_kv_heads;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    return KVC_DISPATCH_HEAD_DIM(head_dim, HD, [&] {
      QKLogitsKernel<E, HD><<<grid, kThreads, 0, stream>>>(
          static_cast<const typename E::T*>(q), qs, static_cast<const typename E::T*>(k), ks, group,
          obs_window, qr.row0, qr.rows, seq_len, head_dim, scale, logits);
      return LastLaunchError();
    });
  });
}

cudaError_t LaunchSoftmaxRows(float* logits, int num_q_heads, int obs_window, QueryRows qr,
                              int seq_len, bool gumbel, uint64_t seed, uint32_t layer,
                              float inv_tau, cudaStream_t stream) {
  const int rows = num_q_heads * qr.rows;
  if (rows <= 0) return cudaSuccess;
  if (qr.row0 < 0 || qr.row0 + qr.rows > obs_window) return cudaErrorInvalidValue;
  SoftmaxRowsKernel<<<rows, 256, 0, stream>>>(logits, obs_window, qr.row0, qr.rows, seq_len, gumbel,
                                              seed, layer, inv_tau);
  return LastLaunchError();
}

cudaError_t LaunchGroupColumnSum(const float* probs, int num_q_heads, int num_kv_heads, int rows,
                                 int seq_len, bool accumulate, float* scores, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(num_kv_heads) * seq_len;
  GroupColumnSumKernel<<<Blocks(n, 256), 256, 0, stream>>>(
      probs, num_q_heads / num_kv_heads, rows, seq_len, num_kv_heads, accumulate, scores);
  return LastLaunchError();
}

cudaError_t LaunchPool1d(const float* in, int rows, int seq_len, int len, int kernel, bool avg,
                         float* out, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * seq_len;
  Pool1dKernel<<<Blocks(n, 256), 256, 0, stream>>>(in, rows, seq_len, len, kernel, avg, out);
  return LastLaunchError();
}

cudaError_t LaunchKeyNormScores(ElemType dtype, const void* k, Strides ks, int num_kv_heads,
                                int seq_len, int head_dim, float* scores, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(num_kv_heads) * seq_len * 32;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    KeyNormKernel<E><<<Blocks(threads, 256), 256, 0, stream>>>(
        static_cast<const typename E::T*>(k), ks, num_kv_heads, seq_len, head_dim, scores);
    return LastLaunchError();
  });
}

cudaError_t LaunchRandomScores(int num_kv_heads, int seq_len, uint64_t seed, uint32_t layer,
                               float* scores, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(num_kv_heads) * seq_len;
  RandomScoresKernel<<<Blocks(n, 256), 256, 0, stream>>>(num_kv_heads, seq_len, seed, layer,
                                                         scores);
  return LastLaunchError();
}

cudaError_t LaunchSumHeads(const float* scores, int num_kv_heads, int seq_len, float* out,
                           cudaStream_t stream) {
  SumHeadsKernel<<<Blocks(seq_len, 256), 256, 0, stream>>>(scores, num_kv_heads, seq_len, out);
  return LastLaunchError();
}

}  // namespace kvc::cuda

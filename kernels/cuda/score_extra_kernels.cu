// KeyDiff, expected attention and value weighting on the device. These scores are one pass over
// K (or V) per head with small per-head reductions; simple warp-per-token kernels are enough
// next to the attention scores' Q K^T. Expected attention's statistics (a few D x D matrices per
// layer) are computed on the host by the shared CPU code and copied in.
#include <cmath>

#include "cuda/cuda_common.cuh"
#include "cuda/reduce.cuh"
#include "cuda/score_extra_kernels.h"

namespace kvc::cuda {
namespace {

constexpr int kThreads = 256;

unsigned BlocksFor(int64_t n, int threads) {
  return static_cast<unsigned>((n + threads - 1) / threads);
}

// One warp per (head, token): out[h, j] = ||x[h, j]||.
template <typename E>
__global__ void RowNormKernel(const typename E::T* __restrict__ x, Strides xs, int heads,
                              int seq_len, int head_dim, float* __restrict__ out) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<int64_t>(heads) * seq_len) return;
  const int h = static_cast<int>(w / seq_len), j = static_cast<int>(w % seq_len);
  float s = 0.f;
  for (int c = lane; c < head_dim; c += 32) {
    const float v = E::Load(x, h * xs.head + j * xs.token + c);
    s = fmaf(v, v, s);
  }
  s = WarpSum(s);
  if (lane == 0) out[w] = sqrtf(s);
}

// One block per head, one thread per channel: unit[h] = m / ||m||, m = mean_j k_j / ||k_j||
// (inv_norm[h, j] = 1 / ||k_j||, 0 for a zero key). Zero when m is 0.
template <typename E>
__global__ void KeyDiffMeanKernel(const typename E::T* __restrict__ k, Strides ks, int seq_len,
                                  int head_dim, const float* __restrict__ norms,
                                  float* __restrict__ unit) {
  __shared__ float red[32];
  const int h = blockIdx.x;
  float acc = 0.f;
  const int c = threadIdx.x;
  if (c < head_dim) {
    for (int j = 0; j < seq_len; ++j) {
      const float n = norms[static_cast<size_t>(h) * seq_len + j];
      if (n > 0.f) acc += E::Load(k, h * ks.head + j * ks.token + c) / n;
    }
    acc /= static_cast<float>(seq_len);
  }
  const float sq = BlockReduce<false>(c < head_dim ? acc * acc : 0.f, red);
  const float mn = sqrtf(sq);
  if (c < head_dim) unit[static_cast<size_t>(h) * head_dim + c] = mn > 0.f ? acc / mn : 0.f;
}

// One warp per (head, token): scores = -(k . unit) / ||k|| (norms in, scores out; may alias).
template <typename E>
__global__ void KeyDiffScoreKernel(const typename E::T* __restrict__ k, Strides ks, int heads,
                                   int seq_len, int head_dim, const float* __restrict__ unit,
                                   float* scores) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<int64_t>(heads) * seq_len) return;
  const int h = static_cast<int>(w / seq_len), j = static_cast<int>(w % seq_len);
  float dot = 0.f;
  for (int c = lane; c < head_dim; c += 32) {
    dot = fmaf(E::Load(k, h * ks.head + j * ks.token + c),
               unit[static_cast<size_t>(h) * head_dim + c], dot);
  }
  dot = WarpSum(dot);
  if (lane == 0) {
    const float n = scores[w];
    scores[w] = n > 0.f ? -dot / n : -0.f * dot;
  }
}

// One warp per (query head, token); the key is staged in shared memory (8 warps x 256 floats).
template <typename E>
__global__ void ExpectedLogitsKernel(const typename E::T* __restrict__ k, Strides ks, int group,
                                     int num_q_heads, int seq_len, int head_dim,
                                     const float* __restrict__ mean, const float* __restrict__ cov,
                                     float* __restrict__ logits) {
  __shared__ float sk[kThreads / 32][256];
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31, wib = threadIdx.x / 32;
  const bool live = w < static_cast<int64_t>(num_q_heads) * seq_len;
  const int hq = live ? static_cast<int>(w / seq_len) : 0;
  const int j = live ? static_cast<int>(w % seq_len) : 0;
  const int h = hq / group;
  float* kv = sk[wib];
  for (int c = lane; c < head_dim; c += 32) {
    kv[c] = live ? E::Load(k, h * ks.head + j * ks.token + c) : 0.f;
  }
  __syncwarp();
  if (!live) return;
  const float* mu = mean + static_cast<size_t>(hq) * head_dim;
  const float* sg = cov + static_cast<size_t>(hq) * head_dim * head_dim;
  float lin = 0.f, quad = 0.f;
  for (int a = lane; a < head_dim; a += 32) {
    lin = fmaf(kv[a], mu[a], lin);
    float t = 0.f;
    for (int b = 0; b < head_dim; ++b)
      t = fmaf(sg[static_cast<size_t>(b) * head_dim + a], kv[b], t);
    quad = fmaf(kv[a], t, quad);
  }
  lin = WarpSum(lin);
  quad = WarpSum(quad);
  if (lane == 0) {
    logits[w] =
        lin * rsqrtf(static_cast<float>(head_dim)) + quad / (2.0f * static_cast<float>(head_dim));
  }
}

// One block per head: the means of norms and scores, then the weighting.
__global__ void ValueWeightKernel(int seq_len, int mode, float eps, const float* __restrict__ norms,
                                  float* __restrict__ scores) {
  __shared__ float red[32];
  const int h = blockIdx.x;
  const float* n = norms + static_cast<size_t>(h) * seq_len;
  float* s = scores + static_cast<size_t>(h) * seq_len;
  float ns = 0.f, ss = 0.f;
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    ns += n[j];
    ss += s[j];
  }
  ns = BlockReduce<false>(ns, red);
  ss = BlockReduce<false>(ss, red);
  const float inv = 1.0f / static_cast<float>(seq_len);
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    s[j] = mode == 2 ? s[j] * (n[j] + eps * ns * inv) : (s[j] + eps * ss * inv) * n[j];
  }
}

}  // namespace

cudaError_t LaunchKeyDiffScores(ElemType dtype, const void* k, Strides ks, int num_kv_heads,
                                int seq_len, int head_dim, float* scratch, float* scores,
                                cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(num_kv_heads) * seq_len * 32;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    const auto* kp = static_cast<const typename E::T*>(k);
    RowNormKernel<E><<<BlocksFor(threads, kThreads), kThreads, 0, stream>>>(
        kp, ks, num_kv_heads, seq_len, head_dim, scores);
    KVC_CUDA_CALL(LastLaunchError());
    KeyDiffMeanKernel<E>
        <<<num_kv_heads, 256, 0, stream>>>(kp, ks, seq_len, head_dim, scores, scratch);
    KVC_CUDA_CALL(LastLaunchError());
    KeyDiffScoreKernel<E><<<BlocksFor(threads, kThreads), kThreads, 0, stream>>>(
        kp, ks, num_kv_heads, seq_len, head_dim, scratch, scores);
    return LastLaunchError();
  });
}

cudaError_t LaunchExpectedLogits(ElemType dtype, const void* k, Strides ks, int num_q_heads,
                                 int num_kv_heads, int seq_len, int head_dim, const float* mean,
                                 const float* cov, float* logits, cudaStream_t stream) {
  if (head_dim > 256) return cudaErrorInvalidValue;
  const int64_t threads = static_cast<int64_t>(num_q_heads) * seq_len * 32;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    ExpectedLogitsKernel<E><<<BlocksFor(threads, kThreads), kThreads, 0, stream>>>(
        static_cast<const typename E::T*>(k), ks, num_q_heads / num_kv_heads, num_q_heads, seq_len,
        head_dim, mean, cov, logits);
    return LastLaunchError();
  });
}

cudaError_t LaunchValueWeight(ElemType dtype, const void* v, Strides vs, int num_kv_heads,
                              int seq_len, int head_dim, int mode, float eps, float* norms,
                              float* scores, cudaStream_t stream) {
  if (mode != 2 && mode != 3) return cudaSuccess;
  const int64_t threads = static_cast<int64_t>(num_kv_heads) * seq_len * 32;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    RowNormKernel<E><<<BlocksFor(threads, kThreads), kThreads, 0, stream>>>(
        static_cast<const typename E::T*>(v), vs, num_kv_heads, seq_len, head_dim, norms);
    KVC_CUDA_CALL(LastLaunchError());
    ValueWeightKernel<<<num_kv_heads, 256, 0, stream>>>(seq_len, mode, eps, norms, scores);
    return LastLaunchError();
  });
}

}  // namespace kvc::cuda

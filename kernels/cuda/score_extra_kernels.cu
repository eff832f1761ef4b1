// KeyDiff, expected attention and value weighting on the device. These scores are one pass over
// K (or V) per head with small per-head reductions: warp-per-token kernels for the per-token
// values, and the per-head sums split over slices of tokens (one block each) and then added in a
// fixed order, in double where the CPU sums in double, so that a head's 128K tokens are not one
// thread's serial loop and the result repeats run to run. Expected attention's statistics (a few
// D x D matrices per layer) are computed on the host by the shared CPU code and copied in.
#include <cmath>

#include "cuda/cuda_common.cuh"
#include "cuda/reduce.cuh"
#include "cuda/score_extra_kernels.h"

namespace kvc::cuda {
namespace {

constexpr int kThreads = 256;

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

constexpr int kSliceThreads = 128;

// Grid (slices, Hkv): partial[h, slice, c] = sum over the slice's keys j of k[h, j, c] * inv_j in
// double, inv_j = 1 / ||k_j|| (0 for a zero key; norms in). Threads cover the channels of
// 128 / D keys at once (D <= 128) or one key's channels (D > 128); their sums are added in a
// fixed order.
template <typename E>
__global__ void __launch_bounds__(kSliceThreads)
    KeyDiffSliceKernel(const typename E::T* __restrict__ k, Strides ks, int seq_len, int head_dim,
                       const float* __restrict__ norms, double* __restrict__ partial) {
  __shared__ double sums[kSliceThreads];
  const int slice = blockIdx.x, h = blockIdx.y, d = head_dim;
  const int lanes = d <= kSliceThreads ? kSliceThreads / d : 1;  // keys read at once
  const int r = d <= kSliceThreads ? threadIdx.x / d : 0;
  const int c = d <= kSliceThreads ? threadIdx.x % d : threadIdx.x;
  const bool live = r < lanes;
  const int j0 = slice * kKeyDiffSliceTokens;
  const int j1 = min(j0 + kKeyDiffSliceTokens, seq_len);
  double acc0 = 0.0, acc1 = 0.0;
  if (live) {
    for (int j = j0 + r; j < j1; j += lanes) {
      const float n = norms[static_cast<size_t>(h) * seq_len + j];
      const double inv = n > 0.f ? static_cast<double>(1.0f / n) : 0.0;
      const int64_t row = h * ks.head + j * ks.token;
      acc0 += static_cast<double>(E::Load(k, row + c)) * inv;
      if (c + kSliceThreads < d)
        acc1 += static_cast<double>(E::Load(k, row + c + kSliceThreads)) * inv;
    }
  }
  double* out = partial + (static_cast<size_t>(h) * gridDim.x + slice) * d;
  if (d > kSliceThreads) {
    out[c] = acc0;
    if (c + kSliceThreads < d) out[c + kSliceThreads] = acc1;
    return;
  }
  sums[threadIdx.x] = acc0;
  __syncthreads();
  if (threadIdx.x < d) {
    double t = 0.0;
    for (int i = 0; i < lanes; ++i) t += sums[i * d + threadIdx.x];
    out[threadIdx.x] = t;
  }
}

// One block per head, one thread per channel: the slices' sums in order, divided by S, and
// unit[h] = m / ||m|| as float (zero when m is 0), as the CPU computes it.
__global__ void KeyDiffUnitKernel(const double* __restrict__ partial, int slices, int seq_len,
                                  int head_dim, float* __restrict__ unit) {
  __shared__ double red[32];
  const int h = blockIdx.x, c = threadIdx.x;
  double m = 0.0;
  if (c < head_dim) {
    const double* p = partial + static_cast<size_t>(h) * slices * head_dim + c;
    for (int s = 0; s < slices; ++s) m += p[static_cast<size_t>(s) * head_dim];
    m /= seq_len;
  }
  const double norm = sqrt(BlockSumDouble(c < head_dim ? m * m : 0.0, red));
  if (c < head_dim) {
    unit[static_cast<size_t>(h) * head_dim + c] = norm > 0.0 ? static_cast<float>(m / norm) : 0.f;
  }
}

// One warp per (head, token): scores = -(k . unit) * (1 / ||k||) (norms in, scores out; may
// alias), the CPU's operations.
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
    const float inv = n > 0.f ? 1.0f / n : 0.f;
    scores[w] = -dot * inv;
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
    // The CPU's operations: lin * (1 / sqrt(D)) + quad * (1 / (2D)), each rounded (no rsqrtf, no
    // contraction), so that equal sums give equal logits.
    const float inv_sqrt_d = 1.0f / sqrtf(static_cast<float>(head_dim));
    const float inv_2d = 1.0f / (2.0f * static_cast<float>(head_dim));
    logits[w] = __fadd_rn(__fmul_rn(lin, inv_sqrt_d), __fmul_rn(quad, inv_2d));
  }
}

// One block per head: the sums of norms and scores in double (the CPU's), then the weighting with
// the CPU's floor: eps * float(sum / S).
__global__ void ValueWeightKernel(int seq_len, int mode, float eps, const float* __restrict__ norms,
                                  float* __restrict__ scores) {
  __shared__ double red[32];
  const int h = blockIdx.x;
  const float* n = norms + static_cast<size_t>(h) * seq_len;
  float* s = scores + static_cast<size_t>(h) * seq_len;
  double ns = 0.0, ss = 0.0;
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    ns += n[j];
    ss += s[j];
  }
  ns = BlockSumDouble(ns, red);
  ss = BlockSumDouble(ss, red);
  const float eps_mean = eps * static_cast<float>((mode == 2 ? ns : ss) / seq_len);
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    s[j] = mode == 2 ? s[j] * (n[j] + eps_mean) : (s[j] + eps_mean) * n[j];
  }
}

}  // namespace

cudaError_t LaunchKeyDiffScores(ElemType dtype, const void* k, Strides ks, int num_kv_heads,
                                int seq_len, int head_dim, float* scratch, float* scores,
                                cudaStream_t stream) {
  if (num_kv_heads < 1 || seq_len < 1 || head_dim < 1 || head_dim > 256) {
    return cudaErrorInvalidValue;
  }
  const int64_t threads = static_cast<int64_t>(num_kv_heads) * seq_len * 32;
  const int slices = (seq_len + kKeyDiffSliceTokens - 1) / kKeyDiffSliceTokens;
  auto* partial = reinterpret_cast<double*>(scratch);
  float* unit = scratch + 2 * static_cast<size_t>(num_kv_heads) * slices * head_dim;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    const auto* kp = static_cast<const typename E::T*>(k);
    KVC_CUDA_CALL(Launch(RowNormKernel<E>, Blocks(threads, kThreads), kThreads, 0, stream, kp,
                         ks, num_kv_heads, seq_len, head_dim, scores));
    KVC_CUDA_CALL(Launch(KeyDiffSliceKernel<E>, dim3(slices, num_kv_heads), kSliceThreads, 0,
                         stream, kp, ks, seq_len, head_dim, scores, partial));
    KVC_CUDA_CALL(Launch(KeyDiffUnitKernel, num_kv_heads, 256, 0, stream, partial, slices, seq_len,
                         head_dim, unit));
    return Launch(KeyDiffScoreKernel<E>, Blocks(threads, kThreads), kThreads, 0, stream, kp, ks,
                  num_kv_heads, seq_len, head_dim, unit, scores);
  });
}

cudaError_t LaunchExpectedLogits(ElemType dtype, const void* k, Strides ks, int num_q_heads,
                                 int num_kv_heads, int seq_len, int head_dim, const float* mean,
                                 const float* cov, float* logits, cudaStream_t stream) {
  if (head_dim > 256) return cudaErrorInvalidValue;
  const int64_t threads = static_cast<int64_t>(num_q_heads) * seq_len * 32;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    return Launch(ExpectedLogitsKernel<E>, Blocks(threads, kThreads), kThreads, 0, stream,
                  static_cast<const typename E::T*>(k), ks, num_q_heads / num_kv_heads, num_q_heads,
                  seq_len, head_dim, mean, cov, logits);
  });
}

cudaError_t LaunchValueWeight(ElemType dtype, const void* v, Strides vs, int num_kv_heads,
                              int seq_len, int head_dim, int mode, float eps, float* norms,
                              float* scores, cudaStream_t stream) {
  if (mode != 2 && mode != 3) return cudaSuccess;
  const int64_t threads = static_cast<int64_t>(num_kv_heads) * seq_len * 32;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    KVC_CUDA_CALL(Launch(RowNormKernel<E>, Blocks(threads, kThreads), kThreads, 0, stream,
                         static_cast<const typename E::T*>(v), vs, num_kv_heads, seq_len, head_dim,
                         norms));
    return Launch(ValueWeightKernel, num_kv_heads, 1024, 0, stream, seq_len, mode, eps, norms,
                  scores);
  });
}

}  // namespace kvc::cuda

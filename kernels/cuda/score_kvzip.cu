// KVzip's token scores on the device: the softmax of each reconstruction row over the keys it
// sees (its pass's chunk and the sinks, with the log-mass of the pass's own tokens in the
// denominator when the client sent it), then per KV head and key the largest (or the mean of the
// top K) of those probabilities over the group's query heads and rows. One block per row for the
// softmax (block-wide max and sum, as SoftmaxRowsKernel); one thread per (head, key) for the top
// planes, which it holds in registers while it reads the block's rows (coalesced across keys).
#include <cmath>

#include "cuda/cuda_common.cuh"
#include "cuda/score_kvzip.h"
#include "cuda/reduce.cuh"
#include "kvc/spec.h"

namespace kvc::cuda {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ bool Sees(const int32_t* keys, int t, int j) {
  if (keys == nullptr) return true;
  const int32_t* k = keys + 3 * static_cast<int64_t>(t);
  return j < k[0] || (j >= k[1] && j < k[2]);
}

__global__ void ReconSoftmaxKernel(float* __restrict__ logits, int obs_window, int row0, int rows,
                                   int seq_len, const int32_t* __restrict__ keys,
                                   const float* __restrict__ log_mass) {
  __shared__ float red[32];
  const int r = blockIdx.x;
  const int hq = r / rows, t = row0 + r % rows;  // t: the row in the whole window
  float* row = logits + static_cast<size_t>(r) * seq_len;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    if (Sees(keys, t, j)) mx = fmaxf(mx, row[j]);
  }
  mx = BlockReduce<true>(mx, red);
  const float lse =
      log_mass != nullptr ? log_mass[static_cast<size_t>(hq) * obs_window + t] : -INFINITY;
  mx = fmaxf(mx, lse);
  float sum = 0.f;
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    if (Sees(keys, t, j)) sum += expf(row[j] - mx);
  }
  sum = BlockReduce<false>(sum, red);
  if (log_mass != nullptr) sum += expf(lse - mx);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    row[j] = Sees(keys, t, j) ? expf(row[j] - mx) * inv : 0.f;
  }
}

template <int kTop>
__global__ void GroupColumnTopKernel(const float* __restrict__ probs, int group, int rows,
                                     int seq_len, int num_kv_heads, int top_k,
                                     float* __restrict__ planes) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t plane = static_cast<int64_t>(num_kv_heads) * seq_len;
  if (idx >= plane) return;
  const int h = static_cast<int>(idx / seq_len), j = static_cast<int>(idx % seq_len);
  float t[kTop];
#pragma unroll
  for (int i = 0; i < kTop; ++i) t[i] = i < top_k ? planes[i * plane + idx] : 0.f;
  // The smallest kept value, t[top_k - 1], selected without a dynamic index (t stays in
  // registers).
  const auto kth = [&] {
    float x = t[0];
#pragma unroll
    for (int i = 1; i < kTop; ++i) x = i == top_k - 1 ? t[i] : x;
    return x;
  };
  float low = kth();
  for (int g = 0; g < group; ++g) {
    const float* p = probs + static_cast<size_t>(h * group + g) * rows * seq_len + j;
    for (int r = 0; r < rows; ++r) {
      const float v = p[static_cast<size_t>(r) * seq_len];
      if (!(v > low)) continue;
      // Insertion from the bottom, unrolled so that t stays in registers.
      bool placed = false;
#pragma unroll
      for (int i = kTop - 1; i > 0; --i) {
        if (i >= top_k || placed) continue;
        if (t[i - 1] < v) {
          t[i] = t[i - 1];
        } else {
          t[i] = v;
          placed = true;
        }
      }
      if (!placed) t[0] = v;
      low = kth();
    }
  }
#pragma unroll
  for (int i = 0; i < kTop; ++i) {
    if (i < top_k) planes[i * plane + idx] = t[i];
  }
}

__global__ void PlaneMeanKernel(const float* __restrict__ planes, int top_k, int64_t plane,
                                float* __restrict__ scores) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= plane) return;
  float sum = 0.f;
  for (int i = 0; i < top_k; ++i) sum += planes[i * plane + idx];
  scores[idx] = sum * (1.0f / static_cast<float>(top_k));
}

}  // namespace

cudaError_t LaunchReconSoftmaxRows(float* logits, int num_q_heads, int obs_window, QueryRows qr,
                                   int seq_len, ReconRows rr, cudaStream_t stream) {
  const int rows = num_q_heads * qr.rows;
  if (rows <= 0) return cudaSuccess;
  if (qr.row0 < 0 || qr.row0 + qr.rows > obs_window) return cudaErrorInvalidValue;
  return Launch(ReconSoftmaxKernel, rows, kThreads, 0, stream, logits, obs_window, qr.row0,
                qr.rows, seq_len, rr.keys, rr.log_mass);
}

cudaError_t LaunchGroupColumnTop(const float* probs, int num_q_heads, int num_kv_heads, int rows,
                                 int seq_len, int top_k, float* planes, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (top_k < 1 || top_k > kMaxTopRows || num_kv_heads < 1 || num_q_heads % num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t n = static_cast<int64_t>(num_kv_heads) * seq_len;
  const int group = num_q_heads / num_kv_heads;
  // The planes in registers: the smallest instantiation that holds top_k.
  const auto launch = [&](auto kernel) {
    return Launch(kernel, Blocks(n, kThreads), kThreads, 0, stream, probs, group, rows,
                  seq_len, num_kv_heads, top_k, planes);
  };
  if (top_k == 1) return launch(GroupColumnTopKernel<1>);
  if (top_k <= 4) return launch(GroupColumnTopKernel<4>);
  if (top_k <= 16) return launch(GroupColumnTopKernel<16>);
  static_assert(kMaxTopRows <= 64, "GroupColumnTopKernel's largest instantiation holds 64");
  return launch(GroupColumnTopKernel<64>);
}

cudaError_t LaunchPlaneMean(const float* planes, int top_k, int num_kv_heads, int seq_len,
                            float* scores, cudaStream_t stream) {
  if (top_k < 1) return cudaErrorInvalidValue;
  const int64_t n = static_cast<int64_t>(num_kv_heads) * seq_len;
  return Launch(PlaneMeanKernel, Blocks(n, kThreads), kThreads, 0, stream, planes, top_k, n,
                scores);
}

}  // namespace kvc::cuda

// Host launchers of the scores beyond observed attention (score_extra_kernels.cu): KeyDiff,
// expected attention and value-aware weighting, with the formulas of ScoreTokens in
// kvc/selection.h. Same conventions as cuda/kernels.h (device pointers, no synchronization).
#ifndef KVC_KERNELS_CUDA_SCORE_EXTRA_KERNELS_H_
#define KVC_KERNELS_CUDA_SCORE_EXTRA_KERNELS_H_

#include "cuda/kernels.h"

namespace kvc::cuda {

// Floats of scratch LaunchKeyDiffScores needs (8-byte aligned): per head, one double partial sum
// per channel for every slice of kKeyDiffSliceTokens keys, and the unit mean key.
inline constexpr int kKeyDiffSliceTokens = 512;
inline size_t KeyDiffScratchFloats(int num_kv_heads, int seq_len, int head_dim) {
  const size_t slices =
      (static_cast<size_t>(seq_len) + kKeyDiffSliceTokens - 1) / kKeyDiffSliceTokens;
  return static_cast<size_t>(num_kv_heads) * head_dim * (2 * slices + 1);
}
// scores[h, j] = -cos(k[h, j], mean over j of k[h, j] / ||k[h, j]||) (0 when the mean is 0), as
// the CPU computes it (kernels/cpu/score_extra.cc): the mean summed in double (per slice, then the
// slices in order: deterministic), the score -(k . unit) * (1 / ||k||).
cudaError_t LaunchKeyDiffScores(ElemType dtype, const void* k, Strides ks, int num_kv_heads,
                                int seq_len, int head_dim, float* scratch, float* scores,
                                cudaStream_t stream);

// logits[hq, j] = k[hq / g, j] . mean[hq] / sqrt(D) + k^T cov[hq] k / (2D), for all S keys;
// mean [Hq, D], cov [Hq, D, D] (the rotated statistics, float), logits [Hq, S].
cudaError_t LaunchExpectedLogits(ElemType dtype, const void* k, Strides ks, int num_q_heads,
                                 int num_kv_heads, int seq_len, int head_dim, const float* mean,
                                 const float* cov, float* logits, cudaStream_t stream);

// Value weighting of scores [Hkv, S] in place (mode 2 = mul, 3 = add, as kvc::ValueWeight):
// mul: s * (||v|| + eps * mean ||v||), add: (s + eps * mean s) * ||v||, means over the head summed
// in double as the CPU does. `norms` is Hkv * S floats of scratch.
cudaError_t LaunchValueWeight(ElemType dtype, const void* v, Strides vs, int num_kv_heads,
                              int seq_len, int head_dim, int mode, float eps, float* norms,
                              float* scores, cudaStream_t stream);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_SCORE_EXTRA_KERNELS_H_

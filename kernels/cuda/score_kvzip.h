// Host launchers of KVzip's scores on the device (score_kvzip.cu), with the formulas of the CPU
// engine's AttentionScoreHead (kernels/cpu/scoring.cc). Same conventions as cuda/kernels.h
// (device pointers, no synchronization). The logits come from LaunchQKLogits with causal = false:
// reconstruction queries come after the context and see all of it.
#ifndef KVC_KERNELS_CUDA_SCORE_KVZIP_H_
#define KVC_KERNELS_CUDA_SCORE_KVZIP_H_

#include <cstdint>

#include "cuda/kernels.h"

namespace kvc::cuda {

// What a reconstruction row sees. `keys` (null: every row sees keys [0, S)) is [W][3] int32 per
// window row: sink_end, lo, hi; the row sees keys [0, sink_end) and [lo, hi) (its pass's chunk
// and the sinks, kvc::PassKeyRange). `log_mass` (null: none) is [Hq, W]: each row's log-sum-exp
// over keys that were not uploaded (the pass's own tokens, EvictionSpec::query_stats), which
// joins the softmax's denominator.
struct ReconRows {
  const int32_t* keys = nullptr;
  const float* log_mass = nullptr;
};

// Logits [Hq, qr.rows, S] (of window rows [row0, row0 + rows)) into probabilities in place:
// p = exp(a - m) / (sum over the seen keys of exp(a - m) [+ exp(log_mass - m)]), m the largest
// of those values; 0 for keys the row does not see.
cudaError_t LaunchReconSoftmaxRows(float* logits, int num_q_heads, int obs_window, QueryRows qr,
                                   int seq_len, ReconRows rr, cudaStream_t stream);

// Per KV head and key, the top_k largest probabilities over the group's query heads and the
// block's rows, merged into `planes` [top_k, Hkv, S] (plane 0 the largest; clear them to 0 before
// the first block): a probability above plane top_k - 1 moves the smaller ones down a plane, as
// the CPU does. With top_k = 1 the one plane is the maximum (KVzip's score).
cudaError_t LaunchGroupColumnTop(const float* probs, int num_q_heads, int num_kv_heads, int rows,
                                 int seq_len, int top_k, float* planes, cudaStream_t stream);

// scores[h, j] = (sum over the planes from 0 down of planes[i, h, j]) * (1 / top_k).
cudaError_t LaunchPlaneMean(const float* planes, int top_k, int num_kv_heads, int seq_len,
                            float* scores, cudaStream_t stream);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_SCORE_KVZIP_H_

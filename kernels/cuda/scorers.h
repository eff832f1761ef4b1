// The CUDA backend's token scorers: one row per eviction policy, in kvc/policy.h's order (checked
// at compile time), so that the policy row (protected windows, inputs, value weighting) and this
// row are all the CUDA backend knows about a policy. Compress sizes the scratch from the row,
// stages its host inputs, calls its scorer, then weights, selects and packs the same way for
// every policy. Internal to kernels/cuda.
#ifndef KVC_KERNELS_CUDA_SCORERS_H_
#define KVC_KERNELS_CUDA_SCORERS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <vector>

#include "absl/status/statusor.h"
#include "cuda/kernels.h"
#include "cuda/score_kvzip.h"
#include "kvc/layer.h"
#include "kvc/policy.h"
#include "kvc/spec.h"

namespace kvc::cuda {

// What a scorer reads and writes: device pointers except `in` and `spec` (host).
struct ScoreArgs {
  const LayerInput* in = nullptr;  // shapes, layer_index (its tensors are host memory: unused)
  const EvictionSpec* spec = nullptr;
  ElemType dtype = ElemType::kF16;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* q = nullptr;  // Q_obs; null when W == 0
  Strides kvs, qs;
  int hq = 0, hkv = 0, s = 0, d = 0, w = 0;
  // Observation rows (CudaScorer::attention_logits): fp16/bf16 score on tensor cores; rows are
  // scored `block_rows` at a time into `logits`.
  bool tensor_cores = false;
  int block_rows = 0;
  float* logits = nullptr;
  float* extra = nullptr;             // CudaScorer::extra_floats floats
  ReconRows recon;                    // kvzip: the rows' key ranges and log-masses (staged)
  const float* stats_mean = nullptr;  // CudaScorer::host_statistics: [Hq, D] and [Hq, D, D]
  const float* stats_cov = nullptr;
  float* scores = nullptr;  // [Hkv, S]
  float* pooled = nullptr;  // [Hkv, S], free for a scorer's second pass (snapkv's pooling)
  cudaStream_t stream = nullptr;
};

// Queues the policy's scores on a.stream; returns the buffer that holds them (a.scores or
// a.pooled).
using DeviceScorer = absl::StatusOr<float*> (*)(const ScoreArgs& a);

struct CudaScorer {
  EvictionPolicy policy;
  // Null for a policy without scores (PolicyInfo::scores false): the scores are cleared. Null for
  // a scoring policy: it has no device path yet, and the backend hands the whole layer to the
  // host engine (core/host_fallback.h), which compresses it exactly as the CPU backend does.
  DeviceScorer score;
  // Reserves ScoreArgs::logits: [Hq, block_rows, S] floats, or for fp16/bf16 the tensor-core
  // column path's smaller scratch unless `full_logits` (kvzip reads every row's probabilities).
  bool attention_logits;
  bool full_logits;
  // ScoreArgs::extra; null: none.
  size_t (*extra_floats)(const LayerShape& shape, const EvictionSpec& spec);
  bool host_statistics;  // the query statistics come from the host fallback (expected)
};

// kvzip with reconstruction passes (spec.pass_rows not empty): the key range of each of the
// obs_window rows of a query head, [W][3] (sink_end, lo, hi: ReconRows::keys), from
// kvc::PassKeyRange as the CPU engine takes it; empty without passes (every row sees all keys).
std::vector<int32_t> ReconRowKeys(const EvictionSpec& spec, int seq_len, int obs_window);

// The row of a known policy.
const CudaScorer& CudaScorerFor(EvictionPolicy policy);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_SCORERS_H_

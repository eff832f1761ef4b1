// The CUDA scorer of every eviction policy (cuda/scorers.h). The kernels are in score_kernels.cu,
// select_kernels.cu and score_extra_kernels.cu; this file only sequences their launchers.
#include "cuda/scorers.h"

#include <algorithm>
#include <cmath>

#include "cuda/resources.h"
#include "cuda/score_extra_kernels.h"
#include "kvc/status_macros.h"

namespace kvc::cuda {
namespace {

// Attention of the W observation rows, summed over each KV head's query group (h2o, snapkv,
// keyformer), `block_rows` rows per pass; `gumbel` adds keyformer's noise at temperature tau.
absl::Status ObservedAttention(const ScoreArgs& a, bool gumbel) {
  const EvictionSpec& e = *a.spec;
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  const uint32_t layer = static_cast<uint32_t>(a.in->layer_index);
  const float inv_tau = static_cast<float>(1.0 / e.tau);
  for (int row0 = 0; row0 < a.w; row0 += a.block_rows) {
    const QueryRows qr{row0, std::min(a.block_rows, a.w - row0)};
    if (a.tensor_cores) {
      KVC_CUDA_RETURN_IF_ERROR(
          LaunchTensorCoreColumnScores(a.dtype, a.q, a.qs, a.k, a.kvs, a.hq, a.hkv, a.w, qr, a.s,
                                       a.d, scale, gumbel, e.seed, layer, inv_tau, row0 > 0,
                                       a.logits, a.scores, a.stream),
          "attention scores (tensor cores)");
      continue;
    }
    KVC_CUDA_RETURN_IF_ERROR(LaunchQKLogits(a.dtype, a.q, a.qs, a.k, a.kvs, a.hq, a.hkv, a.w, qr,
                                            a.s, a.d, scale, a.logits, a.stream),
                             "QK^T scores");
    KVC_CUDA_RETURN_IF_ERROR(
        LaunchSoftmaxRows(a.logits, a.hq, a.w, qr, a.s, gumbel, e.seed, layer, inv_tau, a.stream),
        "softmax");
    KVC_CUDA_RETURN_IF_ERROR(LaunchGroupColumnSum(a.logits, a.hq, a.hkv, qr.rows, a.s,
                                                  /*accumulate=*/row0 > 0, a.scores, a.stream),
                             "group average");
  }
  return absl::OkStatus();
}

absl::StatusOr<float*> H2OScores(const ScoreArgs& a) {
  RETURN_IF_ERROR(ObservedAttention(a, /*gumbel=*/false));
  return a.scores;
}

absl::StatusOr<float*> SnapKVScores(const ScoreArgs& a) {
  RETURN_IF_ERROR(ObservedAttention(a, /*gumbel=*/false));
  const EvictionSpec& e = *a.spec;
  if (e.pool_kernel <= 1) return a.scores;
  // SnapKV pools the prefix only; the observation window is protected anyway.
  KVC_CUDA_RETURN_IF_ERROR(LaunchPool1d(a.scores, a.hkv, a.s, a.s - a.w, e.pool_kernel,
                                        e.pool == PoolKind::kAvg, a.pooled, a.stream),
                           "snapkv pooling");
  return a.pooled;
}

absl::StatusOr<float*> KeyformerScores(const ScoreArgs& a) {
  RETURN_IF_ERROR(ObservedAttention(a, /*gumbel=*/true));
  return a.scores;
}

absl::StatusOr<float*> KNormScores(const ScoreArgs& a) {
  KVC_CUDA_RETURN_IF_ERROR(
      LaunchKeyNormScores(a.dtype, a.k, a.kvs, a.hkv, a.s, a.d, a.scores, a.stream), "key norms");
  return a.scores;
}

absl::StatusOr<float*> RandomScores(const ScoreArgs& a) {
  KVC_CUDA_RETURN_IF_ERROR(
      LaunchRandomScores(a.hkv, a.s, a.spec->seed, static_cast<uint32_t>(a.in->layer_index),
                         a.scores, a.stream),
      "random scores");
  return a.scores;
}

size_t KeyDiffFloats(const LayerShape& s, const EvictionSpec&) {
  return KeyDiffScratchFloats(s.num_kv_heads, s.seq_len, s.head_dim);
}

absl::StatusOr<float*> KeyDiffScores(const ScoreArgs& a) {
  KVC_CUDA_RETURN_IF_ERROR(
      LaunchKeyDiffScores(a.dtype, a.k, a.kvs, a.hkv, a.s, a.d, a.extra, a.scores, a.stream),
      "keydiff scores");
  return a.scores;
}

// Expected logits [Hq, S].
size_t ExpectedFloats(const LayerShape& s, const EvictionSpec&) {
  return static_cast<size_t>(s.num_q_heads) * s.seq_len;
}

absl::StatusOr<float*> ExpectedScores(const ScoreArgs& a) {
  float* logits = a.extra;
  KVC_CUDA_RETURN_IF_ERROR(LaunchExpectedLogits(a.dtype, a.k, a.kvs, a.hq, a.hkv, a.s, a.d,
                                                a.stats_mean, a.stats_cov, logits, a.stream),
                           "expected logits");
  KVC_CUDA_RETURN_IF_ERROR(
      LaunchSoftmaxRows(logits, a.hq, 1, QueryRows{0, 1}, a.s, false, 0, 0, 1.0f, a.stream),
      "expected softmax");
  KVC_CUDA_RETURN_IF_ERROR(
      LaunchGroupColumnSum(logits, a.hq, a.hkv, 1, a.s, /*accumulate=*/false, a.scores, a.stream),
      "expected group average");
  return a.scores;
}

// kvzip's top planes [top_rows, Hkv, S] when top_rows > 1 (with one, the scores are the plane).
size_t KVzipFloats(const LayerShape& s, const EvictionSpec& e) {
  return e.top_rows > 1 ? static_cast<size_t>(e.top_rows) * s.num_kv_heads * s.seq_len : 0;
}

// The reconstruction rows' probabilities over the keys each sees (LaunchReconSoftmaxRows), then
// per KV head and key the largest, or the mean of the top_rows largest, over the group's query
// heads and every row (cpu/scoring.cc: AttentionScoreHead). CUDA cores only: the rows' full
// probabilities are needed, which the tensor-core column path never writes.
absl::StatusOr<float*> KVzipScores(const ScoreArgs& a) {
  const EvictionSpec& e = *a.spec;
  const int top = e.top_rows;
  float* planes = top > 1 ? a.extra : a.scores;
  KVC_CUDA_RETURN_IF_ERROR(
      cudaMemsetAsync(planes, 0, sizeof(float) * top * static_cast<size_t>(a.hkv) * a.s, a.stream),
      "clear kvzip planes");
  const float scale = 1.0f / std::sqrt(static_cast<float>(a.d));
  for (int row0 = 0; row0 < a.w; row0 += a.block_rows) {
    const QueryRows qr{row0, std::min(a.block_rows, a.w - row0)};
    KVC_CUDA_RETURN_IF_ERROR(LaunchQKLogits(a.dtype, a.q, a.qs, a.k, a.kvs, a.hq, a.hkv, a.w, qr,
                                            a.s, a.d, scale, a.logits, a.stream,
                                            /*causal=*/false),
                             "kvzip QK^T");
    KVC_CUDA_RETURN_IF_ERROR(
        LaunchReconSoftmaxRows(a.logits, a.hq, a.w, qr, a.s, a.recon, a.stream), "kvzip softmax");
    KVC_CUDA_RETURN_IF_ERROR(
        LaunchGroupColumnTop(a.logits, a.hq, a.hkv, qr.rows, a.s, top, planes, a.stream),
        "kvzip top rows");
  }
  if (top > 1) {
    KVC_CUDA_RETURN_IF_ERROR(LaunchPlaneMean(planes, top, a.hkv, a.s, a.scores, a.stream),
                             "kvzip top-rows mean");
  }
  return a.scores;
}

constexpr CudaScorer kCudaScorers[] = {
    {EvictionPolicy::kNone, nullptr, false, false, nullptr, false},
    {EvictionPolicy::kStreaming, nullptr, false, false, nullptr, false},
    {EvictionPolicy::kH2O, H2OScores, true, false, nullptr, false},
    {EvictionPolicy::kSnapKV, SnapKVScores, true, false, nullptr, false},
    {EvictionPolicy::kKeyformer, KeyformerScores, true, false, nullptr, false},
    {EvictionPolicy::kKNorm, KNormScores, false, false, nullptr, false},
    {EvictionPolicy::kRandom, RandomScores, false, false, nullptr, false},
    {EvictionPolicy::kKeyDiff, KeyDiffScores, false, false, KeyDiffFloats, false},
    {EvictionPolicy::kExpectedAttention, ExpectedScores, false, false, ExpectedFloats, true},
    {EvictionPolicy::kKVzip, KVzipScores, true, true, KVzipFloats, false},
};
static_assert(CoversEveryPolicyInOrder(kCudaScorers),
              "every policy of kvc/policy.h needs a CUDA row, in order (a null scorer falls back "
              "to the host engine)");

}  // namespace

std::vector<int32_t> ReconRowKeys(const EvictionSpec& spec, int seq_len, int obs_window) {
  std::vector<int32_t> keys;
  if (spec.pass_rows.empty()) return keys;
  keys.reserve(3 * static_cast<size_t>(obs_window));
  for (size_t p = 0; p < spec.pass_rows.size(); ++p) {
    const PassKeys k = PassKeyRange(spec, seq_len, p);
    for (int r = 0; r < spec.pass_rows[p]; ++r) keys.insert(keys.end(), {k.sink_end, k.lo, k.hi});
  }
  return keys;  // ValidateSpec: the passes' rows sum to obs_window
}

const CudaScorer& CudaScorerFor(EvictionPolicy policy) {
  return kCudaScorers[static_cast<size_t>(policy)];
}

}  // namespace kvc::cuda

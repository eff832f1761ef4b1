// Scores beyond the observed attention rows: KeyDiff, expected attention and value-aware
// weighting (formulas: ScoreTokens in kvc/selection.h). The CUDA backend reaches the query
// statistics through the host fallback (core/host_fallback.h, cpu/host_fallback.cc), so that both
// backends compute them the same way.
#ifndef KVC_KERNELS_CPU_SCORE_EXTRA_H_
#define KVC_KERNELS_CPU_SCORE_EXTRA_H_

#include <vector>

#include "core/host_fallback.h"  // ExpectedStats
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc::cpu {

// The average of the rotations of positions [first, first + count): per rotary pair p, the mean
// cosine c[p] and sine s[p] of its angles. Computed in closed form (a geometric series), so its
// cost does not grow with `count`; summed directly for count <= 16.
struct MeanRotation {
  int rotary_dims = 0;
  std::vector<double> c, s;
};
MeanRotation MeanRotationOf(const RopeParams& rope, int head_dim, int first, int count);
// Applies it to x[head_dim] in place: pair p becomes (a c - b s, a s + b c).
void ApplyMeanRotation(const RopeParams& rope, const MeanRotation& rotation, float* x);

// The statistics of query head qh, rotated by `rotation` (the next `horizon` positions): mean
// [D] and covariance [D, D] (row-major), float. From in.q_stats when spec.query_stats, else from
// the un-rotated Q_obs rows of the head (population covariance over its W rows, accumulated in
// double; rows are converted in blocks of at most kScoreQueryFloats). Uses the calling thread's
// Scratch (q, stats). Preconditions: input and spec valid, in.rope set.
void QueryHeadStats(const LayerInput& in, const EvictionSpec& spec, const MeanRotation& rotation,
                    int qh, float* mean, float* cov);

// The statistics of every query head of the layer: mean [Hq, D] and covariance [Hq, D, D]. The
// CUDA backend copies them to the device; the CPU engine computes one head at a time instead.
ExpectedStats ComputeExpectedStats(const LayerInput& in, const EvictionSpec& spec);

// Per-head scorers, out[S]. They use the calling thread's Scratch and stop early (leaving `out`
// meaningless) when in.cancel reads as cancelled.
void KeyDiffScoreHead(const LayerInput& in, int h, float* out);
// Expected attention of KV head h: for each of its g query heads in turn, the head's statistics,
// its logits over all S keys (in key chunks) and their softmax, averaged into out.
void ExpectedScoreHead(const LayerInput& in, const EvictionSpec& spec, const MeanRotation& rotation,
                       int h, float* out);
// Weights head h's scores out[S] by value norms per EffectiveValueWeight(spec) (no-op for kOff).
void ValueWeightHead(const LayerInput& in, const EvictionSpec& spec, int h, float* out);

}  // namespace kvc::cpu

#endif  // KVC_KERNELS_CPU_SCORE_EXTRA_H_

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

// From in.q_stats when spec.query_stats, else from the un-rotated Q_obs rows (population
// covariance over the W rows). Preconditions: input and spec valid, in.rope set.
ExpectedStats ComputeExpectedStats(const LayerInput& in, const EvictionSpec& spec);

// Average of the rotations of positions [first, first + count) applied to x[D] (in place): pair p
// becomes (a c - b s, a s + b c) with c, s the mean cosine and sine of its angles.
void ApplyMeanRotation(const RopeParams& rope, int head_dim, int first, int count, float* x);

// Per-head scorers, out[S].
void KeyDiffScoreHead(const LayerInput& in, int h, float* out);
void ExpectedScoreHead(const LayerInput& in, const ExpectedStats& stats, int h, float* out);
// Weights head h's scores out[S] by value norms per EffectiveValueWeight(spec) (no-op for kOff).
void ValueWeightHead(const LayerInput& in, const EvictionSpec& spec, int h, float* out);

}  // namespace kvc::cpu

#endif  // KVC_KERNELS_CPU_SCORE_EXTRA_H_

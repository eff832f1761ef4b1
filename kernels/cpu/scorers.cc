// The CPU scorer of every eviction policy, one row each in kvc/policy.h's order (checked at
// compile time), and the dispatch that runs them (ScoreTokensImpl). A policy's protected windows,
// inputs and value weighting come from its row in kvc/policy.h; here is only how its scores are
// computed. Small scorers live here; those that share machinery are in scoring.cc (attention of
// the observation queries) and score_extra.cc (KeyDiff, expected attention).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu/engine.h"
#include "cpu/score_extra.h"
#include "cpu/simd.h"
#include "kvc/cost.h"
#include "kvc/noise.h"
#include "kvc/policy.h"

namespace kvc::cpu {
namespace {

// Writes the scores [Hkv, S] of one layer into out (zeroed); input and spec are valid.
using CpuScoreFn = void (*)(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                            float* out);

struct CpuScorer {
  EvictionPolicy policy;
  CpuScoreFn score;  // null for a policy without scores (PolicyInfo::scores false)
};

// knorm: -||k_j||_2, kScoreTokenChunk keys converted at a time.
void KNormScores(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool, float* out) {
  const int S = in.shape.seq_len, D = in.shape.head_dim;
  pool->ParallelFor(in.shape.num_kv_heads, [&](int h) {
    ScratchTask task;
    Scratch& s = Scratch::ForThisThread();
    float* k = s.k.Get<float>(static_cast<size_t>(std::min(S, kScoreTokenChunk)) * D);
    float* head = out + static_cast<size_t>(h) * S;
    for (int c0 = 0; c0 < S; c0 += kScoreTokenChunk) {
      if (Cancelled(in)) return;
      const int n = std::min(kScoreTokenChunk, S - c0);
      LoadHeadRows(in, /*values=*/false, h, c0, n, k);
      for (int j = 0; j < n; ++j) {
        head[c0 + j] = -std::sqrt(simd::SumSquares(k + static_cast<size_t>(j) * D, D));
      }
    }
  });
}

// random: CounterUniform(seed, layer, kv head, 0, j), the same draws as the CUDA backend's.
void RandomScores(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool, float* out) {
  const int S = in.shape.seq_len, H = in.shape.num_kv_heads;
  for (int h = 0; h < H; ++h) {
    if (Cancelled(in)) return;
    for (int j = 0; j < S; ++j) {
      out[static_cast<size_t>(h) * S + j] =
          CounterUniform(spec.seed, static_cast<uint32_t>(in.layer_index), static_cast<uint32_t>(h),
                         0, static_cast<uint32_t>(j));
    }
  }
}

void KeyDiffScores(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool, float* out) {
  const int S = in.shape.seq_len;
  pool->ParallelFor(in.shape.num_kv_heads, [&](int h) {
    ScratchTask task;
    KeyDiffScoreHead(in, h, out + static_cast<size_t>(h) * S);
  });
}

void ExpectedScores(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool, float* out) {
  PrepareBlas(pool);
  const int S = in.shape.seq_len;
  // The rotation to the horizon is the same for every head; each task computes its query heads'
  // statistics itself, one head at a time (never the whole layer's Hq * D^2).
  const MeanRotation rotation = MeanRotationOf(*in.rope, in.shape.head_dim, S, spec.horizon);
  pool->ParallelFor(in.shape.num_kv_heads, [&](int h) {
    ScratchTask task;
    ExpectedScoreHead(in, spec, rotation, h, out + static_cast<size_t>(h) * S);
  });
}

constexpr CpuScorer kCpuScorers[] = {
    {EvictionPolicy::kNone, nullptr},
    {EvictionPolicy::kStreaming, nullptr},
    {EvictionPolicy::kH2O, ObservedAttentionScores},
    {EvictionPolicy::kSnapKV, ObservedAttentionScores},     // pools inside (spec.pool_kernel)
    {EvictionPolicy::kKeyformer, ObservedAttentionScores},  // Gumbel noise inside (spec.tau)
    {EvictionPolicy::kKNorm, KNormScores},
    {EvictionPolicy::kRandom, RandomScores},
    {EvictionPolicy::kKeyDiff, KeyDiffScores},
    {EvictionPolicy::kExpectedAttention, ExpectedScores},
    {EvictionPolicy::kKVzip, ObservedAttentionScores},  // rows see every key, max over them
};
static_assert(CoversEveryPolicyInOrder(kCpuScorers),
              "every policy of kvc/policy.h needs a CPU scorer row, in order");

}  // namespace

void RawScoresImpl(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                   std::vector<float>* scores) {
  const int S = in.shape.seq_len, H = in.shape.num_kv_heads;
  scores->assign(static_cast<size_t>(H) * S, 0.0f);
  const CpuScorer& scorer = kCpuScorers[static_cast<size_t>(spec.policy)];
  if (scorer.score == nullptr) return;
  scorer.score(in, spec, pool, scores->data());
}

void ApplyValueWeights(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                       std::vector<float>* scores) {
  // Value-aware weighting composes with the policies whose row says so (a no-op when it is off).
  if (!Policy(spec.policy).value_weight || kCpuScorers[static_cast<size_t>(spec.policy)].score ==
                                               nullptr) {
    return;
  }
  const int S = in.shape.seq_len;
  float* out = scores->data();
  pool->ParallelFor(in.shape.num_kv_heads, [&](int h) {
    ScratchTask task;
    ValueWeightHead(in, spec, h, out + static_cast<size_t>(h) * S);
  });
}

void ScoreTokensImpl(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                     std::vector<float>* scores) {
  RawScoresImpl(in, spec, pool, scores);
  ApplyValueWeights(in, spec, pool, scores);
}

}  // namespace kvc::cpu

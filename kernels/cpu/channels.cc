// Channel selection on the kept tokens that will be pruned (the first n_kept - r of them; the
// most recent r stay with all channels, so they do not vote).
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "cpu/engine.h"
#include "cpu/simd.h"
#include "kvc/cost.h"
#include "kvc/selection.h"
#include "kvc/status_macros.h"

namespace kvc::cpu {
namespace {

// The `keep` highest-scoring channels (ties to the lower index, NaN last), ascending.
void TopChannels(const float* score, int D, int keep, int32_t* out) {
  int32_t idx[kMaxHeadDim];
  std::iota(idx, idx + D, 0);
  auto better = [score](int32_t a, int32_t b) {
    const bool na = std::isnan(score[a]), nb = std::isnan(score[b]);
    if (na != nb) return nb;
    if (!na && score[a] != score[b]) return score[a] > score[b];
    return a < b;
  };
  std::partial_sort(idx, idx + keep, idx + D, better);
  std::sort(idx, idx + keep);
  std::copy_n(idx, keep, out);
}

// Gathers rows `pos[0..n)` of K or V head h as float [n, D].
void GatherRows(const LayerInput& in, bool values, int h, const int32_t* pos, int n, float* dst) {
  const int D = in.shape.head_dim;
  for (int i = 0; i < n; ++i)
    LoadHeadRows(in, values, h, pos[i], 1, dst + static_cast<size_t>(i) * D);
}

void KeyChannelScores(const LayerInput& in, const CompressionSpec& spec, int h, const int32_t* pos,
                      int m, float* score) {
  const int D = in.shape.head_dim;
  Scratch& s = Scratch::ForThisThread();
  // The pruned tokens' keys, a chunk at a time.
  const int chunk = std::min(std::max(m, 1), kScoreTokenChunk);
  float* k = s.k.Get<float>(static_cast<size_t>(chunk) * D);
  std::fill(score, score + D, 0.0f);
  const ChannelPolicy policy = spec.channels.key_policy;
  for (int c0 = 0; c0 < m; c0 += chunk) {
    if (Cancelled(in)) return;
    const int n = std::min(chunk, m - c0);
    GatherRows(in, /*values=*/false, h, pos + c0, n, k);
    for (int i = 0; i < n; ++i) {
      const float* row = k + static_cast<size_t>(i) * D;
      if (policy == ChannelPolicy::kL1) {
        simd::AccumulateAbs(row, score, D);
      } else {
        simd::AccumulateSquares(row, score, D);
      }
    }
  }
  if (policy == ChannelPolicy::kL2) {
    for (int c = 0; c < D; ++c) score[c] = std::sqrt(score[c]);
  } else if (policy == ChannelPolicy::kThink) {
    // mean_t Q[.., c]^2 over the group's W rows, times mean_s K[s, c]^2 over the old tokens.
    const int rows = in.shape.group_size() * in.shape.obs_window;
    const int block = ScoreRowBlock(in.shape.seq_len, rows, D);
    float* q = s.q.Get<float>(static_cast<size_t>(block) * D);
    float qsq[kMaxHeadDim] = {};
    for (int r0 = 0; r0 < rows; r0 += block) {
      const int n = std::min(block, rows - r0);
      LoadQueryRows(in, h, r0, n, q);
      for (int r = 0; r < n; ++r) simd::AccumulateSquares(q + static_cast<size_t>(r) * D, qsq, D);
    }
    const float inv = m > 0 ? 1.0f / (static_cast<float>(rows) * static_cast<float>(m)) : 0.0f;
    for (int c = 0; c < D; ++c) score[c] *= qsq[c] * inv;
  }
}

// score_v[c] = sum over the group's query rows of (P[:, old] V_old[:, c])^2, P the causal
// softmax of Q_obs K_kept^T / sqrt(D) over all kept tokens (the decode-time attention; kvzip's
// reconstruction rows come after the context and see every kept token). Query rows go in blocks,
// so the logits stay within kScoreLogitFloats.
void ValueChannelScores(const LayerInput& in, bool rows_after_context, int h, const int32_t* pos,
                        int budget, int m, float* score) {
  const LayerShape& sh = in.shape;
  const int S = sh.seq_len, D = sh.head_dim, W = sh.obs_window, rows = sh.group_size() * W;
  std::fill(score, score + D, 0.0f);
  if (m == 0) return;
  Scratch& s = Scratch::ForThisThread();
  const int block = ScoreRowBlock(budget, rows, D);
  float* q = s.q.Get<float>(static_cast<size_t>(block) * D);
  float* k = s.k.Get<float>(static_cast<size_t>(budget) * D);
  float* v = s.v.Get<float>(static_cast<size_t>(m) * D);
  float* p = s.logits.Get<float>(static_cast<size_t>(block) * budget);
  float* o = s.acc.Get<float>(static_cast<size_t>(block) * D);
  GatherRows(in, /*values=*/false, h, pos, budget, k);
  GatherRows(in, /*values=*/true, h, pos, m, v);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  for (int r0 = 0; r0 < rows; r0 += block) {
    if (Cancelled(in)) return;
    const int nr = std::min(block, rows - r0);
    LoadQueryRows(in, h, r0, nr, q);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, budget, D, scale, q, D, k, D, 0.0f, p,
                budget);
    for (int i = 0; i < nr; ++i) {
      float* row = p + static_cast<size_t>(i) * budget;
      // causal: kept positions <= the query's position
      const int limit = rows_after_context ? S - 1 : S - W + (r0 + i) % W;
      const int valid = static_cast<int>(std::upper_bound(pos, pos + budget, limit) - pos);
      if (valid == 0) {
        std::fill(row, row + budget, 0.0f);
        continue;
      }
      const float mx = simd::Max(row, valid);
      const float sum = simd::ExpShiftSum(row, valid, mx);
      const float inv = 1.0f / sum;
      for (int j = 0; j < valid; ++j) row[j] *= inv;
      std::fill(row + valid, row + budget, 0.0f);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, nr, D, m, 1.0f, p, budget, v, D, 0.0f, o,
                D);
    for (int r = 0; r < nr; ++r) {
      simd::AccumulateSquares(o + static_cast<size_t>(r) * D, score, D);
    }
  }
}

}  // namespace

ChannelSelection SelectChannelsImpl(const LayerInput& in, const TokenSelection& tokens,
                                    const CompressionSpec& spec, ThreadPool* pool) {
  const int H = in.shape.num_kv_heads, D = in.shape.head_dim;
  const ChannelSpec& cs = spec.channels;
  ChannelSelection sel;
  sel.key_channels = cs.key_policy == ChannelPolicy::kNone ? D : KeptChannels(cs.key_lambda, D);
  sel.value_channels = cs.prune_values ? KeptChannels(cs.value_lambda, D) : D;
  sel.key_idx.resize(static_cast<size_t>(H) * sel.key_channels);
  sel.value_idx.resize(static_cast<size_t>(H) * sel.value_channels);
  if (cs.prune_values) PrepareBlas(pool);
  pool->ParallelFor(H, [&](int h) {
    ScratchTask task;
    // Ragged selections: each head prunes on its own kept count.
    const int32_t* pos = tokens.head(h);
    const int B = tokens.count(h);
    const int m = B - RecentCount(spec, B);
    int32_t* kidx = sel.key_idx.data() + static_cast<size_t>(h) * sel.key_channels;
    int32_t* vidx = sel.value_idx.data() + static_cast<size_t>(h) * sel.value_channels;
    float score[kMaxHeadDim];
    if (cs.key_policy == ChannelPolicy::kNone) {
      std::iota(kidx, kidx + D, 0);
    } else {
      KeyChannelScores(in, spec, h, pos, m, score);
      TopChannels(score, D, sel.key_channels, kidx);
    }
    if (!cs.prune_values) {
      std::iota(vidx, vidx + D, 0);
    } else {
      ValueChannelScores(in, Policy(spec.eviction.policy).rows_after_context, h, pos, B, m, score);
      TopChannels(score, D, sel.value_channels, vidx);
    }
  });
  return sel;
}

}  // namespace kvc::cpu

namespace kvc {

absl::StatusOr<ChannelSelection> SelectChannels(const LayerInput& in, const TokenSelection& tokens,
                                                const CompressionSpec& spec) {
  RETURN_IF_ERROR(ValidateInput(in));
  RETURN_IF_ERROR(ValidateSpec(spec, in.shape, in.layer_index));
  RETURN_IF_ERROR(cpu::ValidateTokenSelection(in, tokens));
  return CallNoThrow([&]() -> absl::StatusOr<ChannelSelection> {
    ChannelSelection sel = cpu::SelectChannelsImpl(in, tokens, spec, ThreadPool::Default());
    RETURN_IF_ERROR(cpu::CancelStatus(in));
    return sel;
  });
}

}  // namespace kvc

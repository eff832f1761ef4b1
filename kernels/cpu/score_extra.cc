// KeyDiff, expected attention and value weighting on the CPU. Sums run in double where a long
// reduction (means over S keys, covariances over W rows) would otherwise lose digits; the
// per-key work is float, like the attention scores.
#include "cpu/score_extra.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "cpu/engine.h"
#include "cpu/simd.h"

namespace kvc::cpu {
namespace {

constexpr int kChunk = 1024;

template <typename T>
T* Grow(std::vector<T>& v, size_t n) {
  if (v.size() < n) v.resize(n);
  return v.data();
}

// Mean cosine and sine of every rotary pair's angles over positions [first, first + count).
struct PairRotation {
  std::vector<double> c, s;
};

PairRotation MeanPairRotation(const RopeParams& rope, int head_dim, int first, int count) {
  const int rd = rope.rotary_dims == 0 ? head_dim : rope.rotary_dims;
  PairRotation r;
  r.c.resize(rd / 2);
  r.s.resize(rd / 2);
  for (int p = 0; p < rd / 2; ++p) {
    const double freq = std::pow(rope.theta, -2.0 * p / rd) / rope.linear_factor;
    double c = 0, s = 0;
    for (int i = 0; i < count; ++i) {
      const double angle = static_cast<double>(first + i) * freq;
      c += std::cos(angle);
      s += std::sin(angle);
    }
    r.c[p] = c / count;
    r.s[p] = s / count;
  }
  return r;
}

void RotatePairs(const RopeParams& rope, int head_dim, const PairRotation& r, float* x) {
  const int rd = rope.rotary_dims == 0 ? head_dim : rope.rotary_dims;
  for (int p = 0; p < rd / 2; ++p) {
    float& a = x[RopePairFirst(rope, rd, p)];
    float& b = x[RopePairSecond(rope, rd, p)];
    const double x0 = a, x1 = b;
    a = static_cast<float>(x0 * r.c[p] - x1 * r.s[p]);
    b = static_cast<float>(x0 * r.s[p] + x1 * r.c[p]);
  }
}

}  // namespace

void ApplyMeanRotation(const RopeParams& rope, int head_dim, int first, int count, float* x) {
  RotatePairs(rope, head_dim, MeanPairRotation(rope, head_dim, first, count), x);
}

ExpectedStats ComputeExpectedStats(const LayerInput& in, const EvictionSpec& spec) {
  const LayerShape& sh = in.shape;
  const int Hq = sh.num_q_heads, D = sh.head_dim, W = sh.obs_window, S = sh.seq_len;
  const int g = sh.group_size();
  ExpectedStats st;
  st.mean.assign(static_cast<size_t>(Hq) * D, 0.0f);
  st.cov.assign(static_cast<size_t>(Hq) * D * D, 0.0f);
  if (spec.query_stats) {
    const size_t per = D + static_cast<size_t>(D) * D;
    for (int qh = 0; qh < Hq; ++qh) {
      const float* src = in.q_stats + qh * per;
      std::copy_n(src, D, st.mean.data() + static_cast<size_t>(qh) * D);
      std::copy_n(src + D, static_cast<size_t>(D) * D,
                  st.cov.data() + static_cast<size_t>(qh) * D * D);
    }
  } else {
    std::vector<float> q(static_cast<size_t>(g) * W * D);
    std::vector<double> mean(D), cov(static_cast<size_t>(D) * D);
    for (int h = 0; h < sh.num_kv_heads; ++h) {
      LoadQueryGroup(in, h, q.data());
      for (int i = 0; i < g; ++i) {
        float* rows = q.data() + static_cast<size_t>(i) * W * D;
        for (int t = 0; t < W; ++t) RotateVector(*in.rope, D, -(S - W + t), rows + t * D);
        std::fill(mean.begin(), mean.end(), 0.0);
        std::fill(cov.begin(), cov.end(), 0.0);
        for (int t = 0; t < W; ++t) {
          for (int c = 0; c < D; ++c) mean[c] += rows[t * D + c];
        }
        for (double& m : mean) m /= W;
        for (int t = 0; t < W; ++t) {
          for (int a = 0; a < D; ++a) {
            const double da = rows[t * D + a] - mean[a];
            for (int b = 0; b < D; ++b) cov[a * D + b] += da * (rows[t * D + b] - mean[b]);
          }
        }
        const int qh = h * g + i;
        for (int c = 0; c < D; ++c) st.mean[static_cast<size_t>(qh) * D + c] = mean[c];
        for (size_t c = 0; c < cov.size(); ++c) {
          st.cov[static_cast<size_t>(qh) * D * D + c] = static_cast<float>(cov[c] / W);
        }
      }
    }
  }
  // Rotate to the next `horizon` positions: mean' = R mean, cov' = R cov R^T with R the mean
  // rotation (applied to the columns of each row, then to the rows of each column).
  // The mean cosines and sines are computed once per layer (horizon x D/2 of each), not once
  // per rotated vector.
  const PairRotation rot = MeanPairRotation(*in.rope, D, S, spec.horizon);
  std::vector<float> col(D);
  for (int qh = 0; qh < Hq; ++qh) {
    RotatePairs(*in.rope, D, rot, st.mean.data() + static_cast<size_t>(qh) * D);
    float* c = st.cov.data() + static_cast<size_t>(qh) * D * D;
    for (int r = 0; r < D; ++r) RotatePairs(*in.rope, D, rot, c + r * D);
    for (int j = 0; j < D; ++j) {
      for (int r = 0; r < D; ++r) col[r] = c[r * D + j];
      RotatePairs(*in.rope, D, rot, col.data());
      for (int r = 0; r < D; ++r) c[r * D + j] = col[r];
    }
  }
  return st;
}

void KeyDiffScoreHead(const LayerInput& in, int h, float* out) {
  const int S = in.shape.seq_len, D = in.shape.head_dim;
  Scratch& s = Scratch::ForThisThread();
  float* k = Grow(s.k, static_cast<size_t>(std::min(S, kChunk)) * D);
  std::vector<double> mean(D, 0.0);
  // Pass 1: mean of the normalised keys (zero keys contribute nothing); out keeps 1/||k||.
  for (int c0 = 0; c0 < S; c0 += kChunk) {
    const int n = std::min(kChunk, S - c0);
    LoadHeadRows(in, /*values=*/false, h, c0, n, k);
    for (int j = 0; j < n; ++j) {
      const float* kj = k + static_cast<size_t>(j) * D;
      const float norm = std::sqrt(simd::SumSquares(kj, D));
      const float inv = norm > 0.0f ? 1.0f / norm : 0.0f;
      out[c0 + j] = inv;
      for (int c = 0; c < D; ++c) mean[c] += static_cast<double>(kj[c]) * inv;
    }
  }
  double mnorm = 0;
  for (double& m : mean) {
    m /= S;
    mnorm += m * m;
  }
  mnorm = std::sqrt(mnorm);
  std::vector<float> unit(D, 0.0f);
  if (mnorm > 0) {
    for (int c = 0; c < D; ++c) unit[c] = static_cast<float>(mean[c] / mnorm);
  }
  // Pass 2: -cos(k_j, mean).
  for (int c0 = 0; c0 < S; c0 += kChunk) {
    const int n = std::min(kChunk, S - c0);
    LoadHeadRows(in, /*values=*/false, h, c0, n, k);
    for (int j = 0; j < n; ++j) {
      const float* kj = k + static_cast<size_t>(j) * D;
      float dot = 0.0f;
      for (int c = 0; c < D; ++c) dot += kj[c] * unit[c];
      out[c0 + j] = -dot * out[c0 + j];
    }
  }
}

void ExpectedScoreHead(const LayerInput& in, const ExpectedStats& stats, int h, float* out) {
  const LayerShape& sh = in.shape;
  const int S = sh.seq_len, D = sh.head_dim, g = sh.group_size();
  Scratch& s = Scratch::ForThisThread();
  float* k = Grow(s.k, static_cast<size_t>(std::min(S, kChunk)) * D);
  float* kc = Grow(s.tile, static_cast<size_t>(std::min(S, kChunk)) * D);
  float* z = Grow(s.logits, static_cast<size_t>(g) * S);
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  const float inv_2d = 1.0f / (2.0f * static_cast<float>(D));
  for (int c0 = 0; c0 < S; c0 += kChunk) {
    const int n = std::min(kChunk, S - c0);
    LoadHeadRows(in, /*values=*/false, h, c0, n, k);
    for (int i = 0; i < g; ++i) {
      const int qh = h * g + i;
      const float* mu = stats.mean.data() + static_cast<size_t>(qh) * D;
      const float* cov = stats.cov.data() + static_cast<size_t>(qh) * D * D;
      // kc = K cov (cov is symmetric up to rounding; K cov^T is what k^T cov k needs either way).
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, D, D, 1.0f, k, D, cov, D, 0.0f, kc,
                  D);
      float* zi = z + static_cast<size_t>(i) * S + c0;
      for (int j = 0; j < n; ++j) {
        const float* kj = k + static_cast<size_t>(j) * D;
        const float* kcj = kc + static_cast<size_t>(j) * D;
        float lin = 0.0f, quad = 0.0f;
        for (int c = 0; c < D; ++c) {
          lin += kj[c] * mu[c];
          quad += kj[c] * kcj[c];
        }
        zi[j] = lin * inv_sqrt_d + quad * inv_2d;
      }
    }
  }
  std::fill(out, out + S, 0.0f);
  const float inv_g = 1.0f / static_cast<float>(g);
  for (int i = 0; i < g; ++i) {
    float* zi = z + static_cast<size_t>(i) * S;
    const float m = simd::Max(zi, S);
    const float sum = simd::ExpShiftSum(zi, S, m);  // zi becomes exp(z - m)
    simd::Axpy(inv_g / sum, zi, out, S);
  }
}

void ValueWeightHead(const LayerInput& in, const EvictionSpec& spec, int h, float* out) {
  const ValueWeight w = EffectiveValueWeight(spec);
  if (w != ValueWeight::kMul && w != ValueWeight::kAdd) return;
  const int S = in.shape.seq_len, D = in.shape.head_dim;
  Scratch& s = Scratch::ForThisThread();
  float* v = Grow(s.v, static_cast<size_t>(std::min(S, kChunk)) * D);
  float* norms = Grow(s.acc, static_cast<size_t>(S));
  double norm_sum = 0, score_sum = 0;
  for (int c0 = 0; c0 < S; c0 += kChunk) {
    const int n = std::min(kChunk, S - c0);
    LoadHeadRows(in, /*values=*/true, h, c0, n, v);
    for (int j = 0; j < n; ++j) {
      norms[c0 + j] = std::sqrt(simd::SumSquares(v + static_cast<size_t>(j) * D, D));
      norm_sum += norms[c0 + j];
      score_sum += out[c0 + j];
    }
  }
  const auto eps = static_cast<float>(spec.value_eps);
  if (w == ValueWeight::kMul) {
    const float floor = eps * static_cast<float>(norm_sum / S);
    for (int j = 0; j < S; ++j) out[j] *= norms[j] + floor;
  } else {
    const float floor = eps * static_cast<float>(score_sum / S);
    for (int j = 0; j < S; ++j) out[j] = (out[j] + floor) * norms[j];
  }
}

}  // namespace kvc::cpu

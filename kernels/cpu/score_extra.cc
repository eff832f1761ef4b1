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
#include "kvc/cost.h"

namespace kvc::cpu {
namespace {

constexpr int kChunk = kScoreTokenChunk;

// Mean cosine and sine of a + i * f for i in [0, n).
void MeanAngle(double a, double f, int n, double* c, double* s) {
  if (n <= 16) {
    double cs = 0, sn = 0;
    for (int i = 0; i < n; ++i) {
      const double angle = a + static_cast<double>(i) * f;
      cs += std::cos(angle);
      sn += std::sin(angle);
    }
    *c = cs / n;
    *s = sn / n;
    return;
  }
  // sum_i e^{j(a + i f)} = e^{j(a + (n-1) f / 2)} sin(n f / 2) / sin(f / 2), with f reduced
  // modulo 2 pi (the terms only see f modulo 2 pi).
  const double half = std::remainder(f, 2 * M_PI) / 2;
  const double den = std::sin(half);
  const double mid = a + (n - 1) * half;
  if (std::abs(den) < 1e-300) {  // every angle is a (mod 2 pi)
    *c = std::cos(a);
    *s = std::sin(a);
    return;
  }
  const double ratio = std::sin(n * half) / (n * den);
  *c = ratio * std::cos(mid);
  *s = ratio * std::sin(mid);
}

}  // namespace

MeanRotation MeanRotationOf(const RopeParams& rope, int head_dim, int first, int count) {
  MeanRotation r;
  r.rotary_dims = rope.rotary_dims == 0 ? head_dim : rope.rotary_dims;
  const int pairs = r.rotary_dims / 2;
  r.c.resize(pairs);
  r.s.resize(pairs);
  for (int p = 0; p < pairs; ++p) {
    const double freq = std::pow(rope.theta, -2.0 * p / r.rotary_dims) / rope.linear_factor;
    MeanAngle(static_cast<double>(first) * freq, freq, count, &r.c[p], &r.s[p]);
  }
  return r;
}

void ApplyMeanRotation(const RopeParams& rope, const MeanRotation& rotation, float* x) {
  const int rd = rotation.rotary_dims;
  for (int p = 0; p < rd / 2; ++p) {
    float& a = x[RopePairFirst(rope, rd, p)];
    float& b = x[RopePairSecond(rope, rd, p)];
    const double x0 = a, x1 = b;
    a = static_cast<float>(x0 * rotation.c[p] - x1 * rotation.s[p]);
    b = static_cast<float>(x0 * rotation.s[p] + x1 * rotation.c[p]);
  }
}

void QueryHeadStats(const LayerInput& in, const EvictionSpec& spec, const MeanRotation& rotation,
                    int qh, float* mean, float* cov) {
  const LayerShape& sh = in.shape;
  const int D = sh.head_dim, W = sh.obs_window, S = sh.seq_len, g = sh.group_size();
  const size_t dd = static_cast<size_t>(D) * D;
  if (spec.query_stats) {
    const float* src = in.q_stats + static_cast<size_t>(qh) * (D + dd);
    std::copy_n(src, D, mean);
    std::copy_n(src + D, dd, cov);
  } else {
    Scratch& s = Scratch::ForThisThread();
    double* m = s.stats.Get<double>(D + dd);
    double* c = m + D;
    std::fill(m, m + D + dd, 0.0);
    // Rows in blocks; with W within one block (the usual case) they are converted once.
    const int block = std::clamp<int>(static_cast<int>(kScoreQueryFloats / D), 1, std::max(W, 1));
    float* rows = s.q.Get<float>(static_cast<size_t>(block) * D);
    const int h = qh / g, first_row = (qh % g) * W;
    int loaded = -1;  // first row of the block in `rows`, -1 for none
    auto load = [&](int t0, int n) {
      if (loaded == t0) return;
      LoadQueryRows(in, h, first_row + t0, n, rows);
      for (int t = 0; t < n; ++t) RotateVector(*in.rope, D, -(S - W + t0 + t), rows + t * D);
      loaded = t0;
    };
    for (int t0 = 0; t0 < W; t0 += block) {
      const int n = std::min(block, W - t0);
      load(t0, n);
      for (int t = 0; t < n; ++t) {
        for (int a = 0; a < D; ++a) m[a] += rows[t * D + a];
      }
    }
    for (int a = 0; a < D; ++a) m[a] /= W;
    for (int t0 = 0; t0 < W; t0 += block) {
      if (Cancelled(in)) return;
      const int n = std::min(block, W - t0);
      load(t0, n);
      for (int t = 0; t < n; ++t) {
        for (int a = 0; a < D; ++a) {
          const double da = rows[t * D + a] - m[a];
          for (int b = 0; b < D; ++b) c[a * D + b] += da * (rows[t * D + b] - m[b]);
        }
      }
    }
    for (int a = 0; a < D; ++a) mean[a] = static_cast<float>(m[a]);
    for (size_t i = 0; i < dd; ++i) cov[i] = static_cast<float>(c[i] / W);
  }
  // mean' = R mean, cov' = R cov R^T with R the mean rotation (applied to the columns of each
  // row, then to the rows of each column).
  ApplyMeanRotation(*in.rope, rotation, mean);
  for (int r = 0; r < D; ++r) ApplyMeanRotation(*in.rope, rotation, cov + r * D);
  float col[kMaxHeadDim];
  for (int j = 0; j < D; ++j) {
    for (int r = 0; r < D; ++r) col[r] = cov[r * D + j];
    ApplyMeanRotation(*in.rope, rotation, col);
    for (int r = 0; r < D; ++r) cov[r * D + j] = col[r];
  }
}

ExpectedStats ComputeExpectedStats(const LayerInput& in, const EvictionSpec& spec) {
  const LayerShape& sh = in.shape;
  const int Hq = sh.num_q_heads, D = sh.head_dim;
  const MeanRotation rotation = MeanRotationOf(*in.rope, D, sh.seq_len, spec.horizon);
  ExpectedStats st;
  st.mean.assign(static_cast<size_t>(Hq) * D, 0.0f);
  st.cov.assign(static_cast<size_t>(Hq) * D * D, 0.0f);
  ScratchTask task;
  for (int qh = 0; qh < Hq; ++qh) {
    if (Cancelled(in)) break;
    QueryHeadStats(in, spec, rotation, qh, st.mean.data() + static_cast<size_t>(qh) * D,
                   st.cov.data() + static_cast<size_t>(qh) * D * D);
  }
  return st;
}

void KeyDiffScoreHead(const LayerInput& in, int h, float* out) {
  const int S = in.shape.seq_len, D = in.shape.head_dim;
  Scratch& s = Scratch::ForThisThread();
  float* k = s.k.Get<float>(static_cast<size_t>(std::min(S, kChunk)) * D);
  std::vector<double> mean(D, 0.0);
  // Pass 1: mean of the normalised keys (zero keys contribute nothing); out keeps 1/||k||.
  for (int c0 = 0; c0 < S; c0 += kChunk) {
    if (Cancelled(in)) return;
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
    if (Cancelled(in)) return;
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

void ExpectedScoreHead(const LayerInput& in, const EvictionSpec& spec, const MeanRotation& rotation,
                       int h, float* out) {
  const LayerShape& sh = in.shape;
  const int S = sh.seq_len, D = sh.head_dim, g = sh.group_size();
  Scratch& s = Scratch::ForThisThread();
  float* k = s.k.Get<float>(static_cast<size_t>(std::min(S, kChunk)) * D);
  float* kc = s.tile.Get<float>(static_cast<size_t>(std::min(S, kChunk)) * D);
  float* z = s.logits.Get<float>(static_cast<size_t>(S));
  float* mu = s.row_max.Get<float>(static_cast<size_t>(D) + static_cast<size_t>(D) * D);
  float* cov = mu + D;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(D));
  const float inv_2d = 1.0f / (2.0f * static_cast<float>(D));
  const float inv_g = 1.0f / static_cast<float>(g);
  std::fill(out, out + S, 0.0f);
  // One query head at a time: its statistics, its logits over every key, their softmax.
  for (int i = 0; i < g; ++i) {
    if (Cancelled(in)) return;
    QueryHeadStats(in, spec, rotation, h * g + i, mu, cov);
    for (int c0 = 0; c0 < S; c0 += kChunk) {
      if (Cancelled(in)) return;
      const int n = std::min(kChunk, S - c0);
      LoadHeadRows(in, /*values=*/false, h, c0, n, k);
      // kc = K cov (cov is symmetric up to rounding; K cov^T is what k^T cov k needs either way).
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, D, D, 1.0f, k, D, cov, D, 0.0f, kc,
                  D);
      for (int j = 0; j < n; ++j) {
        const float* kj = k + static_cast<size_t>(j) * D;
        const float* kcj = kc + static_cast<size_t>(j) * D;
        float lin = 0.0f, quad = 0.0f;
        for (int c = 0; c < D; ++c) {
          lin += kj[c] * mu[c];
          quad += kj[c] * kcj[c];
        }
        z[c0 + j] = lin * inv_sqrt_d + quad * inv_2d;
      }
    }
    const float m = simd::Max(z, S);
    const float sum = simd::ExpShiftSum(z, S, m);  // z becomes exp(z - m)
    simd::Axpy(inv_g / sum, z, out, S);
  }
}

void ValueWeightHead(const LayerInput& in, const EvictionSpec& spec, int h, float* out) {
  const ValueWeight w = EffectiveValueWeight(spec);
  if (w != ValueWeight::kMul && w != ValueWeight::kAdd) return;
  const int S = in.shape.seq_len, D = in.shape.head_dim;
  Scratch& s = Scratch::ForThisThread();
  float* v = s.v.Get<float>(static_cast<size_t>(std::min(S, kChunk)) * D);
  float* norms = s.acc.Get<float>(static_cast<size_t>(S));
  double norm_sum = 0, score_sum = 0;
  for (int c0 = 0; c0 < S; c0 += kChunk) {
    if (Cancelled(in)) return;
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

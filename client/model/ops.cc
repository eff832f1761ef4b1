#include "ops.h"

#include <cblas.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvc::model::internal {
namespace {

// Query rows per attention block: the score block is kBlock x s floats (2 MiB at s = 4096).
constexpr int kBlock = 128;

// Several instruction sets, picked at load time: the exp loop is the only non-BLAS hot spot of a
// long prefill (s^2 / 2 exponentials per head and layer).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define KVC_MODEL_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define KVC_MODEL_CLONES
#endif

// Cephes-style expf: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial; x is
// clamped to -87 (e^-87 ~ 1.6e-38). Written on GCC/clang vector types so that it compiles to
// SIMD on every target (two SSE registers by default, one AVX/AVX-512 register in the clones).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // vectors never cross a call boundary
typedef float V8f __attribute__((vector_size(32)));
typedef int32_t V8i __attribute__((vector_size(32)));

inline V8f ExpV(V8f x) {
  const V8f lo = V8f{} - 87.0f;
  x = x < lo ? lo : x;
  const V8f magic = V8f{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const V8f n = (x * 1.44269504088896341f + magic) - magic;
  V8f r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  V8f p = V8f{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const V8i bits = (__builtin_convertvector(n, V8i) + 127) << 23;
  V8f scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

inline float ExpInline(float x) {
  V8f v = V8f{} + x;
  return ExpV(v)[0];
}

// x[i] = e^(x[i] - max) for i < n; returns the sum.
KVC_MODEL_CLONES float ExpShiftedSum(float* x, int n, float max) {
  V8f acc = V8f{};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    V8f v;
    std::memcpy(&v, x + i, sizeof(v));
    v = ExpV(v - max);
    std::memcpy(x + i, &v, sizeof(v));
    acc += v;
  }
  float sum = 0;
  for (int k = 0; k < 8; ++k) sum += acc[k];
  if (i < n) {
    float tail[8];
    std::fill(tail, tail + 8, max);
    std::memcpy(tail, x + i, (n - i) * sizeof(float));
    V8f v;
    std::memcpy(&v, tail, sizeof(v));
    v = ExpV(v - max);
    for (int k = 0; k < n - i; ++k) {
      x[i + k] = v[k];
      sum += v[k];
    }
  }
  return sum;
}

KVC_MODEL_CLONES float RowMax(const float* x, int n) {
  V8f acc = V8f{} - INFINITY;
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    V8f v;
    std::memcpy(&v, x + i, sizeof(v));
    acc = v > acc ? v : acc;
  }
  float m = -INFINITY;
  for (int k = 0; k < 8; ++k) m = std::max(m, acc[k]);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

KVC_MODEL_CLONES void SwiGluRows(float* x, const float* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    V8f a, b;
    std::memcpy(&a, x + i, sizeof(a));
    std::memcpy(&b, y + i, sizeof(b));
    // silu(a) = a * sigmoid(a), with e^-|a| to stay in ExpV's domain.
    const V8f neg_abs = a < 0 ? a : -a;
    const V8f e = ExpV(neg_abs);
    const V8f sig = a >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
    const V8f out = a * sig * b;
    std::memcpy(x + i, &out, sizeof(out));
  }
  for (; i < n; ++i) {
    const float a = x[i];
    const float e = ExpInline(-std::fabs(a));
    const float sig = a >= 0 ? 1.0f / (1.0f + e) : e / (1.0f + e);
    x[i] = a * sig * y[i];
  }
}
#pragma GCC diagnostic pop

}  // namespace

float ExpNonPositive(float x) { return ExpInline(x); }

void SoftmaxInPlace(float* x, int n) {
  const float sum = ExpShiftedSum(x, n, RowMax(x, n));
  const float inv = 1.0f / sum;
  for (int i = 0; i < n; ++i) x[i] *= inv;
}

void RmsNormRows(const float* x, const float* weight, int rows, int n, float eps, float* out) {
  for (int r = 0; r < rows; ++r) {
    const float* xr = x + static_cast<size_t>(r) * n;
    float* o = out + static_cast<size_t>(r) * n;
    double ss = 0;  // fp32 squares, summed in double: rows are short, accuracy is free
    for (int i = 0; i < n; ++i) ss += static_cast<double>(xr[i] * xr[i]);
    const float inv = 1.0f / std::sqrt(static_cast<float>(ss / n) + eps);
    for (int i = 0; i < n; ++i) o[i] = weight[i] * (xr[i] * inv);
  }
}

void MatMulT(const float* x, const float* w, int rows, int out, int in, float* y) {
  if (rows == 1) {
    cblas_sgemv(CblasRowMajor, CblasNoTrans, out, in, 1.0f, w, in, x, 1, 0.0f, y, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, out, in, 1.0f, x, in, w, in, 0.0f, y,
              out);
}

void SwiGlu(float* x, const float* y, size_t n) { SwiGluRows(x, y, n); }

RopeTable::RopeTable(const RopeConfig& rope, int head_dim, int first, int count)
    : pairs_(rope.pairs), head_dim_(head_dim), first_(first) {
  const std::vector<double> inv = RopeInverseFrequencies(rope, head_dim);
  const size_t half = inv.size();
  cos_.resize(static_cast<size_t>(count) * half);
  sin_.resize(cos_.size());
  for (int p = 0; p < count; ++p) {
    for (size_t i = 0; i < half; ++i) {
      // Angles in double: positions of a few thousand times frequencies near 1 lose digits in
      // float.
      const double angle = static_cast<double>(first + p) * inv[i];
      cos_[p * half + i] = static_cast<float>(std::cos(angle));
      sin_[p * half + i] = static_cast<float>(std::sin(angle));
    }
  }
}

void RopeTable::Apply(float* x, int heads, int stride, int pos) const {
  const int half = head_dim_ / 2;
  const float* cs = &cos_[static_cast<size_t>(pos - first_) * half];
  const float* sn = &sin_[static_cast<size_t>(pos - first_) * half];
  const bool split = pairs_ == RopePairs::kHalfSplit;
  for (int h = 0; h < heads; ++h) {
    float* p = x + static_cast<size_t>(h) * stride;
    for (int i = 0; i < half; ++i) {
      float& a = p[split ? i : 2 * i];
      float& b = p[split ? i + half : 2 * i + 1];
      const float a0 = a, b0 = b;
      a = a0 * cs[i] - b0 * sn[i];
      b = a0 * sn[i] + b0 * cs[i];
    }
  }
}

void CausalAttention(const float* q, const float* k, const float* v, int s, int n_heads,
                     int n_kv_heads, int head_dim, float* out) {
  const int q_dim = n_heads * head_dim, kv_dim = n_kv_heads * head_dim;
  const int group = n_heads / n_kv_heads;
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim));
  std::vector<float> scores(static_cast<size_t>(std::min(kBlock, s)) * s);
  std::vector<float> inv_sum(kBlock);
  for (int h = 0; h < n_heads; ++h) {
    const float* kh = k + static_cast<size_t>(h / group) * head_dim;
    const float* vh = v + static_cast<size_t>(h / group) * head_dim;
    for (int b0 = 0; b0 < s; b0 += kBlock) {
      const int rows = std::min(kBlock, s - b0);
      const int n = b0 + rows;  // keys the block's last query sees
      const float* qb = q + static_cast<size_t>(b0) * q_dim + static_cast<size_t>(h) * head_dim;
      float* ob = out + static_cast<size_t>(b0) * q_dim + static_cast<size_t>(h) * head_dim;
      // scores [rows, n] = scale * Q_b K^T (rows of q and k are q_dim / kv_dim apart).
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, n, head_dim, scale, qb, q_dim, kh,
                  kv_dim, 0.0f, scores.data(), n);
      for (int r = 0; r < rows; ++r) {
        float* row = &scores[static_cast<size_t>(r) * n];
        const int valid = b0 + r + 1;
        inv_sum[r] = 1.0f / ExpShiftedSum(row, valid, RowMax(row, valid));
        std::fill(row + valid, row + n, 0.0f);  // causal mask
      }
      // out_b = P V, then each row divided by its softmax sum.
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, head_dim, n, 1.0f, scores.data(),
                  n, vh, kv_dim, 0.0f, ob, q_dim);
      for (int r = 0; r < rows; ++r) {
        float* o = ob + static_cast<size_t>(r) * q_dim;
        for (int d = 0; d < head_dim; ++d) o[d] *= inv_sum[r];
      }
    }
  }
}

}  // namespace kvc::model::internal

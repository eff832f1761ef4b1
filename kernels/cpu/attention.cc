// Decode attention straight on the packed bytes. Per KV head, the g * n_q queries of its group are
// processed together while streaming over the cached rows once: each row is decoded (dtype
// conversion or dequantization) into a small scratch buffer that stays in L1 and is reused by
// every query of the group, so the cache is never expanded to a dense copy.
#include "kvc/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cpu/quantize.h"
#include "kvc/convert.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVC_ATTN_HAVE_AVX2_PATH 1
#endif

namespace kvc {
namespace {

float DotScalar(const float* a, const float* b, int n) {
  float acc[4] = {0, 0, 0, 0};
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) acc[k] += a[i + k] * b[i + k];
  }
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

void AxpyScalar(float alpha, const float* x, float* y, int n) {
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

#ifdef KVC_ATTN_HAVE_AVX2_PATH
__attribute__((target("avx2,fma"))) float DotAvx2(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  acc0 = _mm256_add_ps(acc0, acc1);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc0), _mm256_extractf128_ps(acc0, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float total = _mm_cvtss_f32(s);
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}

__attribute__((target("avx2,fma"))) void AxpyAvx2(float alpha, const float* x, float* y, int n) {
  const __m256 va = _mm256_set1_ps(alpha);
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}
#endif

struct Kernels {
  float (*dot)(const float*, const float*, int);
  void (*axpy)(float, const float*, float*, int);
};

const Kernels& GetKernels() {
  static const Kernels k = [] {
#ifdef KVC_ATTN_HAVE_AVX2_PATH
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
      return Kernels{DotAvx2, AxpyAvx2};
    }
#endif
    return Kernels{DotScalar, AxpyScalar};
  }();
  return k;
}

absl::Status CheckQuery(const CompactLayerView& cache, const DecodeQuery& q, const float* out) {
  const int hkv = cache.num_kv_heads();
  if (q.num_q_heads < 1 || q.num_q_heads % hkv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("query.num_q_heads: ", q.num_q_heads,
                                                   " is not a positive multiple of the cache's ",
                                                   "num_kv_heads ", hkv));
  }
  if (q.n_q < 0) {
    return absl::InvalidArgumentError(absl::StrCat("query.n_q: ", q.n_q, " is negative"));
  }
  if (q.n_new < q.n_q) {
    return absl::InvalidArgumentError(
        absl::StrCat("query.n_new: ", q.n_new, " is less than n_q ", q.n_q,
                     " (each query is one of the new tokens, so n_new >= n_q)"));
  }
  if (q.n_q > 0 && q.q == nullptr) return absl::InvalidArgumentError("query.q: null");
  if (q.n_new > 0 && q.k_new == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("query.k_new: null with n_new ", q.n_new));
  }
  if (q.n_new > 0 && q.v_new == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("query.v_new: null with n_new ", q.n_new));
  }
  if (q.n_q > 0 && out == nullptr) return absl::InvalidArgumentError("out: null");
  return absl::OkStatus();
}

// Scratch reused across heads of one call.
struct Scratch {
  std::vector<float> qsel;    // [nq, T_k] queries restricted to the kept key channels
  std::vector<float> qscale;  // [nq, T_k] query * key scale of the current group
  std::vector<float> qzero;   // [nq] sum_c query_c * key zero_c of the current group
  std::vector<float> row;     // [D] one decoded row
  std::vector<float> scores;  // [nq, tokens]
  std::vector<float> acc;     // [nq, T_v] value accumulator over the kept value channels
};

void AttendHead(const CompactLayerView& cache, int h, const DecodeQuery& query, float* out,
                Scratch* s) {
  const Kernels& kern = GetKernels();
  const CompactHead hd = cache.head(h);
  const int d = cache.head_dim();
  const DType dt = cache.dtype();
  const int bits = cache.header().quant_bits;
  const int g = cache.header().quant_group;
  const int group = query.num_q_heads / cache.num_kv_heads();
  const int nq = group * query.n_q;  // the queries of this KV head, contiguous in q and out
  const int n_new = query.n_new;
  const int m = hd.n_kept - hd.n_recent;
  const int tk = hd.key_channels, tv = hd.value_channels;
  const int tokens = hd.n_kept + n_new;
  const float* q = query.q + static_cast<size_t>(h) * nq * d;
  float* o = out + static_cast<size_t>(h) * nq * d;
  const float* k_new = query.k_new + static_cast<size_t>(h) * n_new * d;
  const float* v_new = query.v_new + static_cast<size_t>(h) * n_new * d;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));

  s->row.resize(d);
  s->scores.assign(static_cast<size_t>(nq) * tokens, 0.0f);
  float* row = s->row.data();
  auto score = [&](int a, int j) -> float& {
    return s->scores[static_cast<size_t>(a) * tokens + j];
  };

  // Old keys: only the kept channels take part in the dot product.
  s->qsel.resize(static_cast<size_t>(nq) * tk);
  for (int a = 0; a < nq; ++a) {
    for (int c = 0; c < tk; ++c)
      s->qsel[static_cast<size_t>(a) * tk + c] = q[a * d + hd.key_idx[c]];
  }
  if (bits == 0) {
    const size_t elem = DTypeSize(dt);
    for (int j = 0; j < m; ++j) {
      ToFloat(static_cast<const uint8_t*>(hd.key_old) + static_cast<size_t>(j) * tk * elem, dt, tk,
              row);
      for (int a = 0; a < nq; ++a)
        score(a, j) = kern.dot(&s->qsel[static_cast<size_t>(a) * tk], row, tk);
    }
  } else {
    // Per-channel groups: q . (code * scale + zero) = (q * scale) . code + q . zero.
    s->qscale.resize(static_cast<size_t>(nq) * tk);
    s->qzero.resize(nq);
    for (int64_t j0 = 0, gi = 0; j0 < m; j0 += g, ++gi) {  // 64-bit: g may be near INT_MAX
      const float* sc = hd.key_scale + static_cast<size_t>(gi) * tk;
      const float* ze = hd.key_zero + static_cast<size_t>(gi) * tk;
      for (int a = 0; a < nq; ++a) {
        const float* qa = &s->qsel[static_cast<size_t>(a) * tk];
        float* qs = &s->qscale[static_cast<size_t>(a) * tk];
        for (int c = 0; c < tk; ++c) qs[c] = qa[c] * sc[c];
        s->qzero[a] = kern.dot(qa, ze, tk);
      }
      const int j1 = static_cast<int>(std::min<int64_t>(m, j0 + g));
      const size_t row_bytes = quant::CodeRowBytes(tk, bits);
      for (int j = static_cast<int>(j0); j < j1; ++j) {
        quant::UnpackCodes(hd.key_codes + static_cast<size_t>(j) * row_bytes, tk, bits, row);
        for (int a = 0; a < nq; ++a) {
          score(a, j) = kern.dot(&s->qscale[static_cast<size_t>(a) * tk], row, tk) + s->qzero[a];
        }
      }
    }
  }
  // Recent keys, full precision and all channels.
  for (int j = 0; j < hd.n_recent; ++j) {
    ToFloat(static_cast<const uint8_t*>(hd.key_recent) + static_cast<size_t>(j) * d * DTypeSize(dt),
            dt, d, row);
    for (int a = 0; a < nq; ++a) score(a, m + j) = kern.dot(q + a * d, row, d);
  }
  // New tokens: query i of n_q sees new tokens [0, n_new - n_q + i].
  for (int a = 0; a < nq; ++a) {
    const int last = n_new - query.n_q + a % query.n_q;
    for (int j = 0; j < n_new; ++j) {
      score(a, hd.n_kept + j) = j <= last
                                    ? kern.dot(q + a * d, k_new + static_cast<size_t>(j) * d, d)
                                    : -std::numeric_limits<float>::infinity();
    }
  }
  // Stable softmax per query (the scale is applied here, before the max).
  for (int a = 0; a < nq; ++a) {
    float* sa = &score(a, 0);
    float mx = -std::numeric_limits<float>::infinity();
    for (int j = 0; j < tokens; ++j) {
      sa[j] *= inv_sqrt_d;
      mx = std::max(mx, sa[j]);
    }
    float sum = 0.0f;
    for (int j = 0; j < tokens; ++j) {
      sa[j] = std::exp(sa[j] - mx);
      sum += sa[j];
    }
    const float inv = 1.0f / sum;
    for (int j = 0; j < tokens; ++j) sa[j] *= inv;
  }
  // Values. Old rows accumulate over the kept value channels and are scattered once at the end.
  s->acc.assign(static_cast<size_t>(nq) * tv, 0.0f);
  std::fill(o, o + static_cast<size_t>(nq) * d, 0.0f);
  for (int j = 0; j < m; ++j) {
    if (bits == 0) {
      ToFloat(
          static_cast<const uint8_t*>(hd.value_old) + static_cast<size_t>(j) * tv * DTypeSize(dt),
          dt, tv, row);
    } else {
      quant::DequantizeValueRow(hd.value_scale, hd.value_zero, hd.value_codes, j, tv, bits, g, row);
    }
    for (int a = 0; a < nq; ++a)
      kern.axpy(score(a, j), row, &s->acc[static_cast<size_t>(a) * tv], tv);
  }
  for (int j = 0; j < hd.n_recent; ++j) {
    ToFloat(
        static_cast<const uint8_t*>(hd.value_recent) + static_cast<size_t>(j) * d * DTypeSize(dt),
        dt, d, row);
    for (int a = 0; a < nq; ++a) kern.axpy(score(a, m + j), row, o + a * d, d);
  }
  for (int a = 0; a < nq; ++a) {
    for (int j = 0; j < n_new; ++j) {
      const float p = score(a, hd.n_kept + j);
      if (p != 0.0f) kern.axpy(p, v_new + static_cast<size_t>(j) * d, o + a * d, d);
    }
    const float* acc = &s->acc[static_cast<size_t>(a) * tv];
    for (int c = 0; c < tv; ++c) o[a * d + hd.value_idx[c]] += acc[c];
  }
}

}  // namespace

absl::Status PackedAttentionCpu(const CompactLayerView& cache, const DecodeQuery& query,
                                float* out) {
  if (cache.blob().empty()) {
    return absl::InvalidArgumentError(
        "cache: empty view (not produced by CompactLayerView::Parse)");
  }
  absl::Status st = CheckQuery(cache, query, out);
  if (!st.ok()) return st;
  if (query.n_q == 0) return absl::OkStatus();
  Scratch scratch;
  for (int h = 0; h < cache.num_kv_heads(); ++h) AttendHead(cache, h, query, out, &scratch);
  return absl::OkStatus();
}

}  // namespace kvc

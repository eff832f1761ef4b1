// Decode attention straight on the packed bytes, bound by the bytes it reads.
//
// Work is cut into tasks: per KV head, chunks of kChunk old rows, plus one task for the recent
// rows and new tokens. A task streams its key rows once (two rows at a time against all the
// queries of the head's group, converting fp16 with F16C or unpacking codes in registers), takes
// a partial softmax (its own max and sum), then streams its value rows once in L1-sized blocks,
// keeping the accumulators of a 16-channel slice in registers. Partial results are merged exactly
// per head at the end (flash-decoding), which keeps ragged heads balanced across threads.
// Quantized keys fold the per-channel scale into the query ((q * s) . code + q . zero); quantized
// values are dequantized in registers (code * s + z, one FMA shared by every query).
#include "kvc/attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cpu/attention_internal.h"
#include "cpu/quantize.h"
#include "cpu/simd.h"
#include "cpu/simd_inl.h"
#include "kvc/convert.h"

namespace kvc {
namespace cpu {
namespace {

constexpr int kChunk = 1024;  // old rows per task: scores [nq, kChunk] stay in L1/L2
constexpr int kVBlock = 64;   // value rows per register pass (fp16 D = 128: 16 KiB, in L1)
// Below this many cached bytes in a call the pool's hand-off costs more than it saves.
constexpr size_t kMinParallelBytes = size_t{256} << 10;

std::atomic<bool> g_simd_allowed{true};

bool SimdAvailable() {
#ifdef KVC_X86
  return simd::detail::HaveAvx2() && ConvertUsesSimd();
#else
  return false;
#endif
}

bool UseSimd() { return g_simd_allowed.load(std::memory_order_relaxed) && SimdAvailable(); }

// A block of rows in one storage format. Dequantized element (row j, kept channel c):
//   kDtype:      the dtype value at base + j * row_bytes
//   kKeyCodes:   code * scale[j / group][c] + zero[j / group][c]   (per-channel token groups)
//   kValueCodes: code * scale[j][c / group] + zero[j][c / group]   (per-token channel groups)
struct Rows {
  enum Kind { kDtype, kKeyCodes, kValueCodes } kind = kDtype;
  DType dtype = DType::kF32;
  const uint8_t* base = nullptr;
  size_t row_bytes = 0;
  int n = 0;                     // elements per row
  const int32_t* idx = nullptr;  // kept channel -> head channel; null = identity (n == D)
  int bits = 0, group = 0;
  const float* scale = nullptr;
  const float* zero = nullptr;
};

// One KV head's work: m old rows, r recent rows (dtype, all D channels).
struct HeadWork {
  int m = 0, r = 0;
  Rows k_old, v_old, k_recent, v_recent;
};

// One attention problem (a sequence): heads, the query and where the output goes.
struct Problem {
  int d = 0, nq = 0;  // nq = queries per KV head (group * n_q)
  const DecodeQuery* query = nullptr;
  float* out = nullptr;
  std::vector<HeadWork> heads;
};

struct Task {
  int problem = 0, head = 0;
  int j0 = 0, j1 = 0;  // old rows [j0, j1), or j0 = j1 = -1 for the recent + new tail
  size_t partial = 0;  // offset of [mx nq | l nq | acc nq*D] in the partial buffer
};

// ---- Row kernels --------------------------------------------------------------------------------
// Scores: s[a * ss + (j - j0)] = sum_c qm[a * n + c] * row_j[c] (+ qz[a]).
// Values: acc[a * n + c] += p[a * ps + (j - j0)] * row_j[c].

// Decodes row j into out[R.n] (portable path).
void DecodeRowScalar(const Rows& R, int j, float* out) {
  const uint8_t* row = R.base + static_cast<size_t>(j) * R.row_bytes;
  switch (R.kind) {
    case Rows::kDtype:
      ToFloat(row, R.dtype, R.n, out);
      return;
    case Rows::kKeyCodes:
      quant::UnpackCodes(row, R.n, R.bits, out);
      return;
    case Rows::kValueCodes:
      quant::DequantizeValueRow(R.scale, R.zero, R.base, j, R.n, R.bits, R.group, out);
      return;
  }
}

// Row j as floats: fp32 rows are read in place, others decoded into `row`.
const float* RowScalar(const Rows& R, int j, std::vector<float>* row) {
  if (R.kind == Rows::kDtype && R.dtype == DType::kF32) {
    return reinterpret_cast<const float*>(R.base + static_cast<size_t>(j) * R.row_bytes);
  }
  DecodeRowScalar(R, j, row->data());
  return row->data();
}

void ScoreRowsScalar(const Rows& R, int j0, int j1, const float* qm, const float* qz, int nq,
                     float* s, int ss, std::vector<float>* row) {
  row->resize(R.n);
  for (int j = j0; j < j1; ++j) {
    const float* x = RowScalar(R, j, row);
    for (int a = 0; a < nq; ++a) {
      const float* qa = qm + static_cast<size_t>(a) * R.n;
      float acc = 0.0f;
      for (int c = 0; c < R.n; ++c) acc += qa[c] * x[c];
      s[static_cast<size_t>(a) * ss + (j - j0)] = acc + (qz != nullptr ? qz[a] : 0.0f);
    }
  }
}

void AccumulateRowsScalar(const Rows& R, int j0, int j1, const float* p, int ps, int nq, float* acc,
                          std::vector<float>* row) {
  row->resize(R.n);
  for (int j = j0; j < j1; ++j) {
    const float* x = RowScalar(R, j, row);
    for (int a = 0; a < nq; ++a) {
      const float w = p[static_cast<size_t>(a) * ps + (j - j0)];
      if (w == 0.0f) continue;
      float* y = acc + static_cast<size_t>(a) * R.n;
      for (int c = 0; c < R.n; ++c) y[c] += w * x[c];
    }
  }
}

#ifdef KVC_X86
#define KVC_AVX2 __attribute__((target("avx2,fma,f16c")))

// Loaders: eight elements of row j starting at kept channel c (c % 8 == 0) as floats. `gi` is the
// value group of channel c (hoisted by the caller; unused by the other formats).
struct LoadF16 {
  const uint8_t* base;
  size_t rb;
  KVC_AVX2 __m256 operator()(int j, int c, int) const {
    return _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(base + static_cast<size_t>(j) * rb + 2 * c)));
  }
};
struct LoadBF16 {
  const uint8_t* base;
  size_t rb;
  KVC_AVX2 __m256 operator()(int j, int c, int) const {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(base + static_cast<size_t>(j) * rb + 2 * c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};
struct LoadF32 {
  const uint8_t* base;
  size_t rb;
  KVC_AVX2 __m256 operator()(int j, int c, int) const {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(base + static_cast<size_t>(j) * rb) + c);
  }
};
// Eight codes of `Bits` bits as floats (no scale): the codes of channels c..c+7 occupy 8 * Bits
// bits starting on a byte boundary; they are broadcast and shifted into lanes.
template <int Bits>
KVC_AVX2 inline __m256 Codes8(const uint8_t* p) {
  if constexpr (Bits == 8) {
    return _mm256_cvtepi32_ps(
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  } else if constexpr (Bits == 4) {
    uint32_t w;
    std::memcpy(&w, p, 4);
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    return _mm256_cvtepi32_ps(_mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w)), sh), _mm256_set1_epi32(0xf)));
  } else {
    uint16_t w;
    std::memcpy(&w, p, 2);
    const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    return _mm256_cvtepi32_ps(
        _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(w), sh), _mm256_set1_epi32(3)));
  }
}
template <int Bits>
struct LoadKeyCodes {
  const uint8_t* base;
  size_t rb;
  KVC_AVX2 __m256 operator()(int j, int c, int) const {
    return Codes8<Bits>(base + static_cast<size_t>(j) * rb + c * Bits / 8);
  }
};
template <int Bits>
struct LoadValueCodes {
  const uint8_t* base;
  size_t rb;
  const float* scale;
  const float* zero;
  int groups;
  KVC_AVX2 __m256 operator()(int j, int c, int gi) const {
    const size_t g = static_cast<size_t>(j) * groups + gi;
    return _mm256_fmadd_ps(Codes8<Bits>(base + static_cast<size_t>(j) * rb + c * Bits / 8),
                           _mm256_broadcast_ss(scale + g), _mm256_broadcast_ss(zero + g));
  }
};

// Up to four queries against two rows at a time: 2 * NQ accumulators, one conversion per row
// chunk shared by every query. n % 8 == 0.
template <int NQ, class L>
KVC_AVX2 void ScoreRowsAvx2(const L& load, int n, int j0, int j1, const float* qm, const float* qz,
                            float* s, int ss) {
  int j = j0;
  for (; j + 2 <= j1; j += 2) {
    __m256 acc[2][NQ];
    for (int a = 0; a < NQ; ++a) acc[0][a] = acc[1][a] = _mm256_setzero_ps();
    for (int c = 0; c < n; c += 8) {
      const __m256 r0 = load(j, c, 0), r1 = load(j + 1, c, 0);
      for (int a = 0; a < NQ; ++a) {
        const __m256 q = _mm256_loadu_ps(qm + a * n + c);
        acc[0][a] = _mm256_fmadd_ps(q, r0, acc[0][a]);
        acc[1][a] = _mm256_fmadd_ps(q, r1, acc[1][a]);
      }
    }
    if constexpr (NQ == 4) {
      // Reduce the eight accumulators into one vector [r0q0..r0q3, r1q0..r1q3].
      const __m256 h01 = _mm256_hadd_ps(acc[0][0], acc[0][1]);
      const __m256 h23 = _mm256_hadd_ps(acc[0][2], acc[0][3]);
      const __m256 h45 = _mm256_hadd_ps(acc[1][0], acc[1][1]);
      const __m256 h67 = _mm256_hadd_ps(acc[1][2], acc[1][3]);
      const __m256 a = _mm256_hadd_ps(h01, h23), b = _mm256_hadd_ps(h45, h67);
      const __m256 sum =
          _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
      alignas(32) float t[8];
      _mm256_store_ps(t, sum);
      for (int q = 0; q < 4; ++q) {
        const float z = qz != nullptr ? qz[q] : 0.0f;
        s[q * ss + (j - j0)] = t[q] + z;
        s[q * ss + (j + 1 - j0)] = t[4 + q] + z;
      }
    } else {
      for (int a = 0; a < NQ; ++a) {
        const float z = qz != nullptr ? qz[a] : 0.0f;
        s[a * ss + (j - j0)] = simd::detail::HorizontalSum(acc[0][a]) + z;
        s[a * ss + (j + 1 - j0)] = simd::detail::HorizontalSum(acc[1][a]) + z;
      }
    }
  }
  if (j < j1) {
    __m256 acc[NQ];
    for (int a = 0; a < NQ; ++a) acc[a] = _mm256_setzero_ps();
    for (int c = 0; c < n; c += 8) {
      const __m256 r0 = load(j, c, 0);
      for (int a = 0; a < NQ; ++a)
        acc[a] = _mm256_fmadd_ps(_mm256_loadu_ps(qm + a * n + c), r0, acc[a]);
    }
    for (int a = 0; a < NQ; ++a) {
      s[a * ss + (j - j0)] = simd::detail::HorizontalSum(acc[a]) + (qz != nullptr ? qz[a] : 0.0f);
    }
  }
}

// Up to four queries, a slice of W = 8 * V channels at a time over kVBlock rows: the NQ * V
// accumulators stay in registers while the rows stream by. n % 8 == 0.
template <int NQ, class L>
KVC_AVX2 void AccumulateRowsAvx2(const L& load, int n, int group, int j0, int j1, const float* p,
                                 int ps, float* acc) {
  for (int b0 = j0; b0 < j1; b0 += kVBlock) {
    const int b1 = std::min(j1, b0 + kVBlock);
    int c = 0;
    for (; c + 16 <= n; c += 16) {
      const int g0 = group > 0 ? c / group : 0, g1 = group > 0 ? (c + 8) / group : 0;
      __m256 x[NQ][2];
      for (int a = 0; a < NQ; ++a) {
        x[a][0] = _mm256_loadu_ps(acc + a * n + c);
        x[a][1] = _mm256_loadu_ps(acc + a * n + c + 8);
      }
      for (int j = b0; j < b1; ++j) {
        const __m256 v0 = load(j, c, g0), v1 = load(j, c + 8, g1);
        for (int a = 0; a < NQ; ++a) {
          const __m256 w = _mm256_broadcast_ss(p + a * ps + (j - j0));
          x[a][0] = _mm256_fmadd_ps(w, v0, x[a][0]);
          x[a][1] = _mm256_fmadd_ps(w, v1, x[a][1]);
        }
      }
      for (int a = 0; a < NQ; ++a) {
        _mm256_storeu_ps(acc + a * n + c, x[a][0]);
        _mm256_storeu_ps(acc + a * n + c + 8, x[a][1]);
      }
    }
    for (; c < n; c += 8) {
      const int g0 = group > 0 ? c / group : 0;
      __m256 x[NQ];
      for (int a = 0; a < NQ; ++a) x[a] = _mm256_loadu_ps(acc + a * n + c);
      for (int j = b0; j < b1; ++j) {
        const __m256 v0 = load(j, c, g0);
        for (int a = 0; a < NQ; ++a) {
          x[a] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + a * ps + (j - j0)), v0, x[a]);
        }
      }
      for (int a = 0; a < NQ; ++a) _mm256_storeu_ps(acc + a * n + c, x[a]);
    }
  }
}

// Runs F<NQ>(queries a0..a0+NQ) over all nq queries in blocks of four.
template <class F>
void ForQueryBlocks(int nq, const F& f) {
  int a = 0;
  for (; a + 4 <= nq; a += 4) f(std::integral_constant<int, 4>(), a);
  switch (nq - a) {
    case 3:
      f(std::integral_constant<int, 3>(), a);
      break;
    case 2:
      f(std::integral_constant<int, 2>(), a);
      break;
    case 1:
      f(std::integral_constant<int, 1>(), a);
      break;
    default:
      break;
  }
}

template <class L>
void ScoreWith(const L& load, int n, int j0, int j1, const float* qm, const float* qz, int nq,
               float* s, int ss) {
  ForQueryBlocks(nq, [&](auto k, int a) {
    ScoreRowsAvx2<decltype(k)::value>(load, n, j0, j1, qm + static_cast<size_t>(a) * n,
                                      qz != nullptr ? qz + a : nullptr,
                                      s + static_cast<size_t>(a) * ss, ss);
  });
}

template <class L>
void AccumulateWith(const L& load, int n, int group, int j0, int j1, const float* p, int ps, int nq,
                    float* acc) {
  ForQueryBlocks(nq, [&](auto k, int a) {
    AccumulateRowsAvx2<decltype(k)::value>(load, n, group, j0, j1, p + static_cast<size_t>(a) * ps,
                                           ps, acc + static_cast<size_t>(a) * n);
  });
}
#endif  // KVC_X86

// Whether the vector kernels handle R: whole 8-element slices, value groups of whole slices.
bool Vectorizable(const Rows& R) {
  if (!UseSimd() || R.n % 8 != 0) return false;
  if (R.kind != Rows::kDtype && R.bits != 2 && R.bits != 4 && R.bits != 8) return false;
  if (R.kind == Rows::kValueCodes && R.group % 8 != 0) return false;
  return true;
}

void ScoreRows(const Rows& R, int j0, int j1, const float* qm, const float* qz, int nq, float* s,
               int ss, std::vector<float>* row) {
#ifdef KVC_X86
  if (Vectorizable(R)) {
    const auto run = [&](const auto& load) { ScoreWith(load, R.n, j0, j1, qm, qz, nq, s, ss); };
    if (R.kind == Rows::kDtype) {
      if (R.dtype == DType::kF16) return run(LoadF16{R.base, R.row_bytes});
      if (R.dtype == DType::kBF16) return run(LoadBF16{R.base, R.row_bytes});
      return run(LoadF32{R.base, R.row_bytes});
    }
    if (R.bits == 4) return run(LoadKeyCodes<4>{R.base, R.row_bytes});
    if (R.bits == 2) return run(LoadKeyCodes<2>{R.base, R.row_bytes});
    return run(LoadKeyCodes<8>{R.base, R.row_bytes});
  }
#endif
  ScoreRowsScalar(R, j0, j1, qm, qz, nq, s, ss, row);
}

void AccumulateRows(const Rows& R, int j0, int j1, const float* p, int ps, int nq, float* acc,
                    std::vector<float>* row) {
#ifdef KVC_X86
  if (Vectorizable(R)) {
    const int group = R.kind == Rows::kValueCodes ? R.group : 0;
    const auto run = [&](const auto& load) {
      AccumulateWith(load, R.n, group, j0, j1, p, ps, nq, acc);
    };
    if (R.kind == Rows::kDtype) {
      if (R.dtype == DType::kF16) return run(LoadF16{R.base, R.row_bytes});
      if (R.dtype == DType::kBF16) return run(LoadBF16{R.base, R.row_bytes});
      return run(LoadF32{R.base, R.row_bytes});
    }
    const int groups = quant::NumGroups(R.n, R.group);
    if (R.bits == 4) return run(LoadValueCodes<4>{R.base, R.row_bytes, R.scale, R.zero, groups});
    if (R.bits == 2) return run(LoadValueCodes<2>{R.base, R.row_bytes, R.scale, R.zero, groups});
    return run(LoadValueCodes<8>{R.base, R.row_bytes, R.scale, R.zero, groups});
  }
#endif
  AccumulateRowsScalar(R, j0, j1, p, ps, nq, acc, row);
}

// ---- Tasks --------------------------------------------------------------------------------------

struct Scratch {
  std::vector<float> qm, qs, qz, s, acc, row;
};

// s[a * len + j] -> exp(s - max_a) in place; writes max and sum per query.
void PartialSoftmax(float* s, int len, int nq, float* mx, float* l) {
  for (int a = 0; a < nq; ++a) {
    float* sa = s + static_cast<size_t>(a) * len;
    const float m = simd::Max(sa, static_cast<size_t>(len));
    mx[a] = m;
    if (m == -std::numeric_limits<float>::infinity()) {  // every token masked
      std::fill(sa, sa + len, 0.0f);
      l[a] = 0.0f;
      continue;
    }
    l[a] = simd::ExpShiftSum(sa, static_cast<size_t>(len), m);
  }
}

#ifdef KVC_X86
KVC_AVX2 float DotAvx2(const float* a, const float* b, int n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
  }
  float total = simd::detail::HorizontalSum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) total += a[i] * b[i];
  return total;
}
#endif

// Four independent sums: a serial fp32 reduction would cost a full add latency per element.
float Dot(const float* a, const float* b, int n) {
#ifdef KVC_X86
  if (UseSimd()) return DotAvx2(a, b, n);
#endif
  float acc[4] = {0, 0, 0, 0};
  int i = 0;
  for (; i + 4 <= n; i += 4) {
    for (int k = 0; k < 4; ++k) acc[k] += a[i + k] * b[i + k];
  }
  for (; i < n; ++i) acc[0] += a[i] * b[i];
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

// Old rows [t.j0, t.j1) of one head.
void RunOldChunk(const Problem& P, const Task& t, Scratch* sc, float* part) {
  const HeadWork& hw = P.heads[t.head];
  const int nq = P.nq, d = P.d, len = t.j1 - t.j0;
  float* mx = part;
  float* l = part + nq;
  float* out = part + 2 * nq;
  const float* qh = P.query->q + static_cast<size_t>(t.head) * nq * d;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  const Rows& K = hw.k_old;
  const int tk = K.n;
  // Only the kept key channels take part; the 1/sqrt(D) scale is folded into the query.
  sc->qm.resize(static_cast<size_t>(nq) * tk);
  for (int a = 0; a < nq; ++a) {
    for (int c = 0; c < tk; ++c) {
      sc->qm[static_cast<size_t>(a) * tk + c] =
          qh[static_cast<size_t>(a) * d + (K.idx != nullptr ? K.idx[c] : c)] * inv_sqrt_d;
    }
  }
  sc->s.resize(static_cast<size_t>(nq) * len);
  float* s = sc->s.data();
  if (K.kind == Rows::kKeyCodes) {
    // Per-channel groups of G tokens: q . (code * scale + zero) = (q * scale) . code + q . zero.
    const int64_t g = K.group;  // 64-bit: g may be near INT_MAX
    sc->qs.resize(static_cast<size_t>(nq) * tk);
    sc->qz.resize(nq);
    for (int64_t g0 = (t.j0 / g) * g; g0 < t.j1; g0 += g) {
      const int64_t gi = g0 / g;
      const int a0 = static_cast<int>(std::max<int64_t>(t.j0, g0));
      const int a1 = static_cast<int>(std::min<int64_t>(t.j1, g0 + g));
      const float* scale = K.scale + static_cast<size_t>(gi) * tk;
      const float* zero = K.zero + static_cast<size_t>(gi) * tk;
      for (int a = 0; a < nq; ++a) {
        const float* qa = &sc->qm[static_cast<size_t>(a) * tk];
        float* qs = &sc->qs[static_cast<size_t>(a) * tk];
        for (int c = 0; c < tk; ++c) qs[c] = qa[c] * scale[c];
        sc->qz[a] = Dot(qa, zero, tk);
      }
      ScoreRows(K, a0, a1, sc->qs.data(), sc->qz.data(), nq, s + (a0 - t.j0), len, &sc->row);
    }
  } else {
    ScoreRows(K, t.j0, t.j1, sc->qm.data(), nullptr, nq, s, len, &sc->row);
  }
  PartialSoftmax(s, len, nq, mx, l);
  // Values accumulate over the kept value channels and are scattered to D once.
  const Rows& V = hw.v_old;
  sc->acc.assign(static_cast<size_t>(nq) * V.n, 0.0f);
  AccumulateRows(V, t.j0, t.j1, s, len, nq, sc->acc.data(), &sc->row);
  std::fill(out, out + static_cast<size_t>(nq) * d, 0.0f);
  for (int a = 0; a < nq; ++a) {
    const float* acc = &sc->acc[static_cast<size_t>(a) * V.n];
    float* o = out + static_cast<size_t>(a) * d;
    for (int c = 0; c < V.n; ++c) o[V.idx != nullptr ? V.idx[c] : c] = acc[c];
  }
}

// The recent rows (all channels) and the new tokens (causal) of one head.
void RunTail(const Problem& P, const Task& t, Scratch* sc, float* part) {
  const HeadWork& hw = P.heads[t.head];
  const DecodeQuery& q = *P.query;
  const int nq = P.nq, d = P.d, r = hw.r, n_new = q.n_new;
  const int len = r + n_new;
  float* mx = part;
  float* l = part + nq;
  float* out = part + 2 * nq;
  const float* qh = q.q + static_cast<size_t>(t.head) * nq * d;
  const float* k_new = q.k_new + static_cast<size_t>(t.head) * n_new * d;
  const float* v_new = q.v_new + static_cast<size_t>(t.head) * n_new * d;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  sc->qm.resize(static_cast<size_t>(nq) * d);
  for (size_t i = 0; i < sc->qm.size(); ++i) sc->qm[i] = qh[i] * inv_sqrt_d;
  sc->s.resize(static_cast<size_t>(nq) * len);
  float* s = sc->s.data();
  if (r > 0) ScoreRows(hw.k_recent, 0, r, sc->qm.data(), nullptr, nq, s, len, &sc->row);
  // Query i of n_q sees new tokens [0, n_new - n_q + i].
  for (int a = 0; a < nq; ++a) {
    const int last = n_new - q.n_q + a % q.n_q;
    for (int j = 0; j < n_new; ++j) {
      s[static_cast<size_t>(a) * len + r + j] =
          j <= last
              ? Dot(&sc->qm[static_cast<size_t>(a) * d], k_new + static_cast<size_t>(j) * d, d)
              : -std::numeric_limits<float>::infinity();
    }
  }
  PartialSoftmax(s, len, nq, mx, l);
  std::fill(out, out + static_cast<size_t>(nq) * d, 0.0f);
  if (r > 0) AccumulateRows(hw.v_recent, 0, r, s, len, nq, out, &sc->row);
  for (int a = 0; a < nq; ++a) {
    for (int j = 0; j < n_new; ++j) {
      const float p = s[static_cast<size_t>(a) * len + r + j];
      if (p != 0.0f) {
        simd::Axpy(p, v_new + static_cast<size_t>(j) * d, out + static_cast<size_t>(a) * d, d);
      }
    }
  }
}

size_t PartialFloats(const Problem& P) {
  return static_cast<size_t>(P.nq) * (2 + static_cast<size_t>(P.d));
}

// Plans the tasks, runs them and merges the partial results into each problem's output.
void Run(const std::vector<Problem>& problems, ThreadPool* pool) {
  std::vector<Task> tasks;
  size_t floats = 0, bytes = 0;
  for (int pi = 0; pi < static_cast<int>(problems.size()); ++pi) {
    const Problem& P = problems[pi];
    for (int h = 0; h < static_cast<int>(P.heads.size()); ++h) {
      const HeadWork& hw = P.heads[h];
      for (int j0 = 0; j0 < hw.m; j0 += kChunk) {
        tasks.push_back({pi, h, j0, std::min(hw.m, j0 + kChunk), floats});
        floats += PartialFloats(P);
      }
      if (hw.r > 0 || P.query->n_new > 0) {
        tasks.push_back({pi, h, -1, -1, floats});
        floats += PartialFloats(P);
      }
      bytes += static_cast<size_t>(hw.m) * (hw.k_old.row_bytes + hw.v_old.row_bytes) +
               static_cast<size_t>(hw.r) * (hw.k_recent.row_bytes + hw.v_recent.row_bytes);
    }
  }
  std::vector<float> partials(floats);
  const auto body = [&](int i) {
    thread_local Scratch scratch;
    const Task& t = tasks[i];
    float* part = partials.data() + t.partial;
    if (t.j0 < 0) {
      RunTail(problems[t.problem], t, &scratch, part);
    } else {
      RunOldChunk(problems[t.problem], t, &scratch, part);
    }
  };
  const int n = static_cast<int>(tasks.size());
  if (pool != nullptr && pool->num_threads() > 1 && n > 1 && bytes >= kMinParallelBytes) {
    pool->ParallelFor(n, body);
  } else {
    for (int i = 0; i < n; ++i) body(i);
  }
  // Merge: tasks of one head are adjacent. out = sum_i e^(mx_i - M) acc_i / sum_i e^(mx_i - M) l_i.
  for (size_t i = 0; i < tasks.size();) {
    size_t e = i + 1;
    while (e < tasks.size() && tasks[e].problem == tasks[i].problem &&
           tasks[e].head == tasks[i].head) {
      ++e;
    }
    const Problem& P = problems[tasks[i].problem];
    const int nq = P.nq, d = P.d;
    float* out = P.out + static_cast<size_t>(tasks[i].head) * nq * d;
    for (int a = 0; a < nq; ++a) {
      float M = -std::numeric_limits<float>::infinity();
      for (size_t k = i; k < e; ++k) M = std::max(M, partials[tasks[k].partial + a]);
      float* o = out + static_cast<size_t>(a) * d;
      std::fill(o, o + d, 0.0f);
      if (M == -std::numeric_limits<float>::infinity()) continue;
      float L = 0.0f;
      for (size_t k = i; k < e; ++k) {
        const float* part = partials.data() + tasks[k].partial;
        const float w = std::exp(part[a] - M);
        L += w * part[nq + a];
        if (w != 0.0f) simd::Axpy(w, part + 2 * nq + static_cast<size_t>(a) * d, o, d);
      }
      const float inv = 1.0f / L;
      for (int c = 0; c < d; ++c) o[c] *= inv;
    }
    i = e;
  }
}

Rows DtypeRows(DType dt, const void* base, int n, const int32_t* idx) {
  Rows R;
  R.kind = Rows::kDtype;
  R.dtype = dt;
  R.base = static_cast<const uint8_t*>(base);
  R.row_bytes = static_cast<size_t>(n) * DTypeSize(dt);
  R.n = n;
  R.idx = idx;
  return R;
}

Rows CodeRows(Rows::Kind kind, const uint8_t* codes, const float* scale, const float* zero, int n,
              const int32_t* idx, int bits, int group) {
  Rows R;
  R.kind = kind;
  R.base = codes;
  R.row_bytes = quant::CodeRowBytes(n, bits);
  R.n = n;
  R.idx = idx;
  R.bits = bits;
  R.group = group;
  R.scale = scale;
  R.zero = zero;
  return R;
}

Problem FromCompact(const CompactLayerView& v, const DecodeQuery& q, float* out) {
  Problem P;
  P.d = v.head_dim();
  P.nq = q.num_q_heads / v.num_kv_heads() * q.n_q;
  P.query = &q;
  P.out = out;
  const DType dt = v.dtype();
  const int bits = v.header().quant_bits, g = v.header().quant_group;
  P.heads.resize(v.num_kv_heads());
  for (int h = 0; h < v.num_kv_heads(); ++h) {
    const CompactHead hd = v.head(h);
    HeadWork& w = P.heads[h];
    w.m = hd.n_kept - hd.n_recent;
    w.r = hd.n_recent;
    if (bits == 0) {
      w.k_old = DtypeRows(dt, hd.key_old, hd.key_channels, hd.key_idx);
      w.v_old = DtypeRows(dt, hd.value_old, hd.value_channels, hd.value_idx);
    } else {
      w.k_old = CodeRows(Rows::kKeyCodes, hd.key_codes, hd.key_scale, hd.key_zero, hd.key_channels,
                         hd.key_idx, bits, g);
      w.v_old = CodeRows(Rows::kValueCodes, hd.value_codes, hd.value_scale, hd.value_zero,
                         hd.value_channels, hd.value_idx, bits, g);
    }
    w.k_recent = DtypeRows(dt, hd.key_recent, P.d, nullptr);
    w.v_recent = DtypeRows(dt, hd.value_recent, P.d, nullptr);
  }
  return P;
}

absl::Status CheckQuery(int hkv, const DecodeQuery& q, const float* out) {
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

}  // namespace

absl::Status DenseAttentionBatch(absl::Span<const DenseKv> caches,
                                 absl::Span<const DecodeQuery> queries,
                                 absl::Span<float* const> outs, ThreadPool* pool) {
  if (caches.size() != queries.size() || caches.size() != outs.size()) {
    return absl::InvalidArgumentError("dense attention: caches, queries and outs differ in size");
  }
  std::vector<Problem> problems;
  for (size_t i = 0; i < caches.size(); ++i) {
    const DenseKv& c = caches[i];
    absl::Status st = CheckQuery(c.num_kv_heads, queries[i], outs[i]);
    if (!st.ok()) return st;
    if (queries[i].n_q == 0) continue;
    Problem P;
    P.d = c.head_dim;
    P.nq = queries[i].num_q_heads / c.num_kv_heads * queries[i].n_q;
    P.query = &queries[i];
    P.out = outs[i];
    const size_t head_bytes = static_cast<size_t>(c.seq_len) * c.head_dim * DTypeSize(c.dtype);
    for (int h = 0; h < c.num_kv_heads; ++h) {
      HeadWork w;
      w.m = c.seq_len;
      w.k_old = DtypeRows(c.dtype, static_cast<const uint8_t*>(c.k) + h * head_bytes, c.head_dim,
                          nullptr);
      w.v_old = DtypeRows(c.dtype, static_cast<const uint8_t*>(c.v) + h * head_bytes, c.head_dim,
                          nullptr);
      P.heads.push_back(w);
    }
    problems.push_back(std::move(P));
  }
  return CallNoThrow([&] {
    Run(problems, pool);
    return absl::OkStatus();
  });
}

void SetAttentionSimdForTesting(bool enabled) { g_simd_allowed.store(enabled); }

bool AttentionUsesSimd() { return UseSimd(); }

}  // namespace cpu

absl::Status PackedAttentionBatchCpu(absl::Span<const PackedAttentionItem> items,
                                     ThreadPool* pool) {
  std::vector<cpu::Problem> problems;
  problems.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const PackedAttentionItem& it = items[i];
    const std::string where = items.size() > 1 ? absl::StrCat("item ", i, ": ") : "";
    if (it.cache == nullptr || it.cache->blob().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "cache: empty view (not produced by CompactLayerView::Parse)"));
    }
    absl::Status st = cpu::CheckQuery(it.cache->num_kv_heads(), it.query, it.out);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(where, st.message()));
    if (it.query.n_q == 0) continue;
    problems.push_back(cpu::FromCompact(*it.cache, it.query, it.out));
  }
  return CallNoThrow([&] {
    cpu::Run(problems, pool);
    return absl::OkStatus();
  });
}

absl::Status PackedAttentionCpu(const CompactLayerView& cache, const DecodeQuery& query, float* out,
                                ThreadPool* pool) {
  const PackedAttentionItem item{&cache, query, out};
  return PackedAttentionBatchCpu(absl::MakeConstSpan(&item, 1), pool);
}

}  // namespace kvc

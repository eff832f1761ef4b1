// Row kernels of the CPU decode attention. Keys stream two rows at a time against up to four
// queries (2 * 4 accumulators, one conversion per row chunk shared by every query); values stream
// in blocks of kVBlock rows with the accumulators of a 16-channel slice held in registers. fp16
// converts with F16C, bf16 by shifting, 2/4/8-bit codes are unpacked in registers, value codes
// dequantized with one FMA shared by every query.
#include "cpu/attention_rows.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "core/quantize.h"
#include "cpu/simd_inl.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"

namespace kvc::cpu::attn {
namespace {

constexpr int kVBlock = 64;  // value rows per register pass (fp16 D = 128: 16 KiB, in L1)

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

}  // namespace

bool UseSimd() {
#ifdef KVC_X86
  return CpuIsaAtLeast(CpuIsa::kAvx2);
#else
  return false;
#endif
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

}  // namespace kvc::cpu::attn

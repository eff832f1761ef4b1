#include "core/quantize.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"

// The inner loops are written so that the compiler vectorizes them (no branches on data, clamps
// as selects). On x86-64 with GCC or Clang each hot loop is also compiled for AVX2+FMA and
// kvc/cpu_isa.h picks the build at run time (both give identical codes: no contraction applies).
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#include "core/convert_x86_inl.h"
#define KVC_QUANT_AVX2 1
#define KVC_INLINE_BODY inline __attribute__((always_inline))
#else
#define KVC_INLINE_BODY inline
#endif

// Defines Name (the dispatcher), with the body compiled once for the baseline and once for
// `Target` (an AVX2 target string). KVC_DISPATCH takes AVX2+FMA, for loops no contraction
// applies to.
#ifdef KVC_QUANT_AVX2
#define KVC_DISPATCH_TARGET(Name, Target, Params, Args)                       \
  void Name##Portable Params { Name##Body Args; }                             \
  __attribute__((target(Target))) void Name##Avx2 Params { Name##Body Args; } \
  void Name Params {                                                          \
    if (CpuIsaAtLeast(CpuIsa::kAvx2)) return Name##Avx2 Args;                 \
    Name##Portable Args;                                                      \
  }
#else
#define KVC_DISPATCH_TARGET(Name, Target, Params, Args) \
  void Name Params { Name##Body Args; }
#endif
#define KVC_DISPATCH(Name, Params, Args) KVC_DISPATCH_TARGET(Name, "avx2,fma", Params, Args)

namespace kvc::quant {
namespace {

// lo[c] = min, hi[c] = max over rows [0, rows) of x (row stride t).
KVC_INLINE_BODY void ColumnMinMaxBody(const float* x, int rows, int t, float* lo, float* hi) {
  std::memcpy(lo, x, sizeof(float) * t);
  std::memcpy(hi, x, sizeof(float) * t);
  for (int r = 1; r < rows; ++r) {
    const float* row = x + static_cast<size_t>(r) * t;
    for (int c = 0; c < t; ++c) {
      lo[c] = row[c] < lo[c] ? row[c] : lo[c];
      hi[c] = row[c] > hi[c] ? row[c] : hi[c];
    }
  }
}

// codes[c] = clamp(round((x[c] - zero[c]) * inv[c]), 0, qmax). NaN maps to 0 (the selects below
// are false for NaN), so hostile input never produces an out-of-range code.
KVC_INLINE_BODY void EncodeRowBody(const float* x, const float* zero, const float* inv, int n,
                                   float qmax, uint8_t* codes) {
  for (int c = 0; c < n; ++c) {
    float v = (x[c] - zero[c]) * inv[c];
    v = v > 0.0f ? v : 0.0f;
    v = v < qmax ? v : qmax;
    codes[c] = static_cast<uint8_t>(static_cast<int>(v + 0.5f));
  }
}

// Same with one zero/inv for the whole span.
KVC_INLINE_BODY void EncodeSpanBody(const float* x, float zero, float inv, int n, float qmax,
                                    uint8_t* codes) {
  for (int c = 0; c < n; ++c) {
    float v = (x[c] - zero) * inv;
    v = v > 0.0f ? v : 0.0f;
    v = v < qmax ? v : qmax;
    codes[c] = static_cast<uint8_t>(static_cast<int>(v + 0.5f));
  }
}

KVC_DISPATCH(ColumnMinMax, (const float* x, int rows, int t, float* lo, float* hi),
             (x, rows, t, lo, hi))
KVC_DISPATCH(EncodeRow,
             (const float* x, const float* zero, const float* inv, int n, float qmax,
              uint8_t* codes),
             (x, zero, inv, n, qmax, codes))
KVC_DISPATCH(EncodeSpan, (const float* x, float zero, float inv, int n, float qmax, uint8_t* codes),
             (x, zero, inv, n, qmax, codes))

// Packs n byte codes into a row of CodeRowBytes(n, bits) bytes, element 0 in the lowest bits.
void PackRow(const uint8_t* codes, int n, int bits, uint8_t* out) {
  if (bits == 8) {
    std::memcpy(out, codes, n);
    return;
  }
  const int per_byte = 8 / bits;
  const int full = n / per_byte;
  if (bits == 4) {
    for (int k = 0; k < full; ++k) {
      out[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
    }
  } else {  // bits == 2
    for (int k = 0; k < full; ++k) {
      const uint8_t* c = codes + 4 * k;
      out[k] = static_cast<uint8_t>(c[0] | (c[1] << 2) | (c[2] << 4) | (c[3] << 6));
    }
  }
  const int rest = n - full * per_byte;
  if (rest > 0) {
    uint8_t b = 0;
    for (int i = 0; i < rest; ++i)
      b |= static_cast<uint8_t>(codes[full * per_byte + i] << (i * bits));
    out[full] = b;
  }
}

inline float QMax(int bits) { return static_cast<float>((1 << bits) - 1); }

}  // namespace

void QuantizeKeys(const float* x, int m, int t, int bits, int g, float* scale, float* zero,
                  uint8_t* codes) {
  const float qmax = QMax(bits);
  const size_t row_bytes = CodeRowBytes(t, bits);
  std::vector<float> hi(t), inv(t);
  std::vector<uint8_t> tmp(t);
  for (int64_t g0 = 0, gi = 0; g0 < m; g0 += g, ++gi) {  // 64-bit: g may be near INT_MAX
    const int rows = static_cast<int>(std::min<int64_t>(g, m - g0));
    const float* xg = x + static_cast<size_t>(g0) * t;
    float* sc = scale + static_cast<size_t>(gi) * t;
    float* ze = zero + static_cast<size_t>(gi) * t;
    ColumnMinMax(xg, rows, t, ze, hi.data());
    for (int c = 0; c < t; ++c) {
      sc[c] = (hi[c] - ze[c]) / qmax;
      inv[c] = sc[c] > 0.0f ? 1.0f / sc[c] : 0.0f;
    }
    for (int r = 0; r < rows; ++r) {
      EncodeRow(xg + static_cast<size_t>(r) * t, ze, inv.data(), t, qmax, tmp.data());
      PackRow(tmp.data(), t, bits, codes + static_cast<size_t>(g0 + r) * row_bytes);
    }
  }
}

void QuantizeValues(const float* x, int m, int t, int bits, int g, float* scale, float* zero,
                    uint8_t* codes) {
  const float qmax = QMax(bits);
  const size_t row_bytes = CodeRowBytes(t, bits);
  const int groups = NumGroups(t, g);
  std::vector<uint8_t> tmp(t);
  for (int r = 0; r < m; ++r) {
    const float* row = x + static_cast<size_t>(r) * t;
    float* sc = scale + static_cast<size_t>(r) * groups;
    float* ze = zero + static_cast<size_t>(r) * groups;
    for (int gi = 0; gi < groups; ++gi) {
      const int c0 = gi * g;
      const int n = std::min(g, t - c0);
      float lo = row[c0], hi = row[c0];
      for (int c = c0 + 1; c < c0 + n; ++c) {
        lo = row[c] < lo ? row[c] : lo;
        hi = row[c] > hi ? row[c] : hi;
      }
      sc[gi] = (hi - lo) / qmax;
      ze[gi] = lo;
      EncodeSpan(row + c0, lo, sc[gi] > 0.0f ? 1.0f / sc[gi] : 0.0f, n, qmax, tmp.data() + c0);
    }
    PackRow(tmp.data(), t, bits, codes + static_cast<size_t>(r) * row_bytes);
  }
}

namespace {

#ifdef KVC_QUANT_AVX2
// The low 8 bytes of `codes` as 8 floats at o; all 16 as 16.
__attribute__((target("avx2"))) inline void Put8(__m128i codes, float* o) {
  _mm256_storeu_ps(o, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes)));
}
__attribute__((target("avx2"))) inline void Put16(__m128i codes, float* o) {
  Put8(codes, o);
  Put8(_mm_srli_si128(codes, 8), o + 8);
}

// Codes i .. i + 31 of a packed row of 4- or 2-bit codes as bytes, in order: [i, i + 16) in *a,
// [i + 16, i + 32) in *b. 4-bit: 16 bytes split into their nibbles and interleaved; 2-bit: 8
// bytes, four planes interleaved.
__attribute__((target("avx2"), always_inline)) inline void Codes32(const uint8_t* row, int i,
                                                                  int bits, __m128i* a,
                                                                  __m128i* b) {
  if (bits == 4) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i / 2));
    const __m128i lo = _mm_and_si128(x, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(x, 4), mask);
    *a = _mm_unpacklo_epi8(lo, hi);
    *b = _mm_unpackhi_epi8(lo, hi);
  } else {  // bits == 2
    const __m128i mask = _mm_set1_epi8(0x03);
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i / 4));
    const __m128i c0 = _mm_and_si128(x, mask);
    const __m128i c1 = _mm_and_si128(_mm_srli_epi16(x, 2), mask);
    const __m128i c2 = _mm_and_si128(_mm_srli_epi16(x, 4), mask);
    const __m128i c3 = _mm_and_si128(_mm_srli_epi16(x, 6), mask);
    const __m128i c01 = _mm_unpacklo_epi8(c0, c1);  // byte j: codes 4j, 4j + 1
    const __m128i c23 = _mm_unpacklo_epi8(c2, c3);  // byte j: codes 4j + 2, 4j + 3
    *a = _mm_unpacklo_epi16(c01, c23);
    *b = _mm_unpackhi_epi16(c01, c23);
  }
}

// UnpackCodes with AVX2: 8-bit codes 8 at a time, 4- and 2-bit 32 (Codes32), widened to int32 and
// converted (exact, as the scalar loop). Returns how many leading codes it wrote; the caller does
// the rest.
__attribute__((target("avx2"))) int UnpackCodesAvx2(const uint8_t* row, int n, int bits,
                                                    float* out) {
  int i = 0;
  if (bits == 8) {
    for (; i + 8 <= n; i += 8) {
      Put8(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)), out + i);
    }
  } else {
    for (; i + 32 <= n; i += 32) {
      __m128i a, b;
      Codes32(row, i, bits, &a, &b);
      Put16(a, out + i);
      Put16(b, out + i + 16);
    }
  }
  return i;
}
#endif

}  // namespace

void UnpackCodes(const uint8_t* row, int n, int bits, float* out) {
  // One specialized loop per width (constant shifts), so the compiler unrolls and vectorizes.
  int i = 0;
#ifdef KVC_QUANT_AVX2
  if (CpuIsaAtLeast(CpuIsa::kAvx2)) {
    i = UnpackCodesAvx2(row, n, bits, out);
    if (i == n) return;
  }
#endif
  if (bits == 8) {
    for (; i < n; ++i) out[i] = static_cast<float>(row[i]);
    return;
  }
  if (bits == 4) {
    for (; i + 2 <= n; i += 2) {
      const uint32_t b = row[i >> 1];
      out[i] = static_cast<float>(b & 0xfu);
      out[i + 1] = static_cast<float>(b >> 4);
    }
  } else {  // bits == 2
    for (; i + 4 <= n; i += 4) {
      const uint32_t b = row[i >> 2];
      out[i] = static_cast<float>(b & 3u);
      out[i + 1] = static_cast<float>((b >> 2) & 3u);
      out[i + 2] = static_cast<float>((b >> 4) & 3u);
      out[i + 3] = static_cast<float>(b >> 6);
    }
  }
  for (; i < n; ++i) out[i] = static_cast<float>(CodeAt(row, i, bits));
}

namespace {

// x[c] = x[c] * s[c] + z[c] (keys: a scale and zero per channel), and the same with one scale and
// zero (a value group): a multiply, then an add, each rounded. The AVX2 builds take no FMA (its
// target has none to contract into), so every build gives the same bits.
KVC_INLINE_BODY void AffineBody(float* x, const float* s, const float* z, int n) {
  for (int c = 0; c < n; ++c) x[c] = x[c] * s[c] + z[c];
}
KVC_INLINE_BODY void AffineOneBody(float* x, float s, float z, int n) {
  for (int c = 0; c < n; ++c) x[c] = x[c] * s + z;
}
KVC_DISPATCH_TARGET(Affine, "avx2", (float* x, const float* s, const float* z, int n),
                    (x, s, z, n))
KVC_DISPATCH_TARGET(AffineOne, "avx2", (float* x, float s, float z, int n), (x, s, z, n))

}  // namespace

void DequantizeKeyRow(const float* scale, const float* zero, const uint8_t* codes, int j, int t,
                      int bits, int g, float* out) {
  UnpackCodes(codes + static_cast<size_t>(j) * CodeRowBytes(t, bits), t, bits, out);
  const float* sc = scale + static_cast<size_t>(j / g) * t;
  const float* ze = zero + static_cast<size_t>(j / g) * t;
  Affine(out, sc, ze, t);
}

void DequantizeValueRow(const float* scale, const float* zero, const uint8_t* codes, int j, int t,
                        int bits, int g, float* out) {
  UnpackCodes(codes + static_cast<size_t>(j) * CodeRowBytes(t, bits), t, bits, out);
  const int groups = NumGroups(t, g);
  const float* sc = scale + static_cast<size_t>(j) * groups;
  const float* ze = zero + static_cast<size_t>(j) * groups;
  for (int gi = 0, c0 = 0; gi < groups; ++gi, c0 += g) {
    AffineOne(out + c0, sc[gi], ze[gi], std::min(t, c0 + g) - c0);
  }
}

namespace {

#ifdef KVC_QUANT_AVX2
// DequantizeKeysTo / DequantizeValuesTo in registers: 32 codes unpacked at a time, each eight
// widened, multiplied by their scale, added to their zero (no FMA: the target has none, so the
// same two roundings as Affine) and rounded into T. Needs t % 32 == 0 and, for values, g % 8 == 0
// (eight channels never straddle two groups).
template <DType T, bool kKeys>
__attribute__((target("avx2,f16c"))) void DequantRowsAvx2(const float* scale, const float* zero,
                                                         const uint8_t* codes, int m, int t,
                                                         int bits, int g, void* dst) {
  const size_t code_row = CodeRowBytes(t, bits);
  const int groups = NumGroups(t, g);
  for (int j = 0; j < m; ++j) {
    const uint8_t* row = codes + static_cast<size_t>(j) * code_row;
    const size_t at = static_cast<size_t>(kKeys ? j / g : j) * (kKeys ? t : groups);
    const float* sc = scale + at;
    const float* ze = zero + at;
    const size_t out = static_cast<size_t>(j) * t;
    for (int i = 0; i < t; i += 32) {
      __m128i a, b;
      if (bits == 8) {
        a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
        b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16));
      } else {
        Codes32(row, i, bits, &a, &b);
      }
      const __m128i eights[4] = {a, _mm_srli_si128(a, 8), b, _mm_srli_si128(b, 8)};
      for (int k = 0; k < 4; ++k) {
        const int c = i + 8 * k;
        const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eights[k]));
        const __m256 s = kKeys ? _mm256_loadu_ps(sc + c) : _mm256_set1_ps(sc[c / g]);
        const __m256 z = kKeys ? _mm256_loadu_ps(ze + c) : _mm256_set1_ps(ze[c / g]);
        convert_x86::StoreFloat8<T>(dst, out + c, _mm256_add_ps(_mm256_mul_ps(x, s), z));
      }
    }
  }
}

// The same with AVX-512, sixteen channels to a multiply: the same products, sums and roundings
// (this file is built without contraction, so no FMA either). Needs t % 32 == 0 and, for values,
// g % 16 == 0.
template <DType T, bool kKeys>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"))) void DequantRowsAvx512(
    const float* scale, const float* zero, const uint8_t* codes, int m, int t, int bits, int g,
    void* dst) {
  const size_t code_row = CodeRowBytes(t, bits);
  const int groups = NumGroups(t, g);
  for (int j = 0; j < m; ++j) {
    const uint8_t* row = codes + static_cast<size_t>(j) * code_row;
    const size_t at = static_cast<size_t>(kKeys ? j / g : j) * (kKeys ? t : groups);
    const float* sc = scale + at;
    const float* ze = zero + at;
    const size_t out = static_cast<size_t>(j) * t;
    for (int i = 0; i < t; i += 32) {
      __m128i sixteens[2];
      if (bits == 8) {
        sixteens[0] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
        sixteens[1] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i + 16));
      } else {
        Codes32(row, i, bits, &sixteens[0], &sixteens[1]);
      }
      for (int k = 0; k < 2; ++k) {
        const int c = i + 16 * k;
        const __m512 x = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sixteens[k]));
        const __m512 s = kKeys ? _mm512_loadu_ps(sc + c) : _mm512_set1_ps(sc[c / g]);
        const __m512 z = kKeys ? _mm512_loadu_ps(ze + c) : _mm512_set1_ps(ze[c / g]);
        convert_x86::StoreFloat16<T>(dst, out + c, _mm512_add_ps(_mm512_mul_ps(x, s), z));
      }
    }
  }
}

// The AVX-512 kernel where the CPU has it and the value groups allow it, else the AVX2 one.
template <DType T, bool kKeys>
void DequantRowsX86(bool wide, const float* scale, const float* zero, const uint8_t* codes, int m,
                    int t, int bits, int g, void* dst) {
  if (wide) return DequantRowsAvx512<T, kKeys>(scale, zero, codes, m, t, bits, g, dst);
  DequantRowsAvx2<T, kKeys>(scale, zero, codes, m, t, bits, g, dst);
}

template <bool kKeys>
bool DequantRowsFused(const float* scale, const float* zero, const uint8_t* codes, int m, int t,
                      int bits, int g, DType dt, void* dst) {
  if (!CpuIsaAtLeast(CpuIsa::kAvx2) || t % 32 != 0 || (!kKeys && g % 8 != 0)) return false;
  const bool wide = CpuIsaAtLeast(CpuIsa::kAvx512) && (kKeys || g % 16 == 0);
  switch (dt) {
    case DType::kF32:
      DequantRowsX86<DType::kF32, kKeys>(wide, scale, zero, codes, m, t, bits, g, dst);
      return true;
    case DType::kF16:
      DequantRowsX86<DType::kF16, kKeys>(wide, scale, zero, codes, m, t, bits, g, dst);
      return true;
    case DType::kBF16:
      DequantRowsX86<DType::kBF16, kKeys>(wide, scale, zero, codes, m, t, bits, g, dst);
      return true;
  }
  return false;
}
#else
template <bool kKeys>
bool DequantRowsFused(const float*, const float*, const uint8_t*, int, int, int, int, DType,
                      void*) {
  return false;
}
#endif

// The fused kernels where they fit; otherwise each row dequantized into floats, then rounded.
template <bool kKeys>
void DequantRowsTo(const float* scale, const float* zero, const uint8_t* codes, int m, int t,
                   int bits, int g, DType dt, void* dst) {
  if (DequantRowsFused<kKeys>(scale, zero, codes, m, t, bits, g, dt, dst)) return;
  std::vector<float> row(t);
  const size_t row_bytes = static_cast<size_t>(t) * DTypeSize(dt);
  for (int j = 0; j < m; ++j) {
    if constexpr (kKeys) {
      DequantizeKeyRow(scale, zero, codes, j, t, bits, g, row.data());
    } else {
      DequantizeValueRow(scale, zero, codes, j, t, bits, g, row.data());
    }
    FromFloat(row.data(), dt, t, static_cast<uint8_t*>(dst) + j * row_bytes);
  }
}

}  // namespace

void DequantizeKeysTo(const float* scale, const float* zero, const uint8_t* codes, int m, int t,
                      int bits, int g, DType dt, void* dst) {
  DequantRowsTo<true>(scale, zero, codes, m, t, bits, g, dt, dst);
}

void DequantizeValuesTo(const float* scale, const float* zero, const uint8_t* codes, int m, int t,
                        int bits, int g, DType dt, void* dst) {
  DequantRowsTo<false>(scale, zero, codes, m, t, bits, g, dt, dst);
}

}  // namespace kvc::quant

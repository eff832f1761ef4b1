// Small AVX-512 helpers shared by the scoring kernels that pack keys and compute logits from
// them (amx_logits.cc, int8_logits.cc). Include only from files compiled with AVX-512F and BW,
// and call only after checking the CPU (kvc/cpu_isa.h). The functions have internal linkage, so
// that each file keeps the copy compiled with its own flags.
#ifndef KVC_KERNELS_CPU_AVX512_ROWS_H_
#define KVC_KERNELS_CPU_AVX512_ROWS_H_

#include <immintrin.h>

#include <cstdint>

#include "kvc/dtype.h"

namespace kvc::cpu::avx512 {
namespace {

// 16 elements of type t at p as floats (exact).
inline __m512 Load16(const uint8_t* p, DType t) {
  switch (t) {
    case DType::kF32:
      return _mm512_loadu_ps(p);
    case DType::kF16:
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    case DType::kBF16:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  return _mm512_setzero_ps();
}

// In-register transpose of a 16 x 16 matrix of dwords: r[i][j] -> r[j][i].
inline void Transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4m + c], lane L: rows 4m..4m+3 of column 4L + c
  for (int m = 0; m < 4; ++m) {
    u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
    u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
    u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
    u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44);
    const __m512i y = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44);
    const __m512i y2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x, x2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x, x2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(y, y2, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(y, y2, 0xDD);
  }
}

// The lanes of a pair of 16-key tiles that hold keys when `left` keys remain (the rest are the
// packing's padding): m0 for the first tile, m1 for the second.
inline void TilePairMasks(int left, __mmask16* m0, __mmask16* m1) {
  *m0 = static_cast<__mmask16>(left >= 16 ? 0xffff : (1u << left) - 1);
  *m1 = static_cast<__mmask16>(left >= 32 ? 0xffff : left > 16 ? (1u << (left - 16)) - 1 : 0);
}

}  // namespace
}  // namespace kvc::cpu::avx512

#endif  // KVC_KERNELS_CPU_AVX512_ROWS_H_

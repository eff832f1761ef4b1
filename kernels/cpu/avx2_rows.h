// Small AVX2 helpers shared by the scoring kernels that pack keys and compute logits from them
// (f32_logits_avx2.cc, int8_logits_avx2.cc). Include only from files compiled with AVX2 and F16C,
// and call only after checking the CPU (kvc/cpu_isa.h). The functions have internal linkage, so
// that each file keeps the copy compiled with its own flags.
#ifndef KVC_KERNELS_CPU_AVX2_ROWS_H_
#define KVC_KERNELS_CPU_AVX2_ROWS_H_

#include <immintrin.h>

#include <cstdint>

#include "kvc/dtype.h"

namespace kvc::cpu::avx2 {
namespace {

// 8 elements of type t at p as floats (exact).
inline __m256 Load8(const uint8_t* p, DType t) {
  switch (t) {
    case DType::kF32:
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    case DType::kF16:
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    case DType::kBF16:
      return _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
  }
  return _mm256_setzero_ps();
}

// In-register transpose of an 8 x 8 matrix of 32-bit elements: r[i][j] -> r[j][i].
inline void Transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

}  // namespace
}  // namespace kvc::cpu::avx2

#endif  // KVC_KERNELS_CPU_AVX2_ROWS_H_

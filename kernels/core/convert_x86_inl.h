// Eight elements at a time between fp16/bf16 and float on AVX2 + F16C, sixteen on AVX-512, for
// kernels that convert in registers instead of through a float buffer (kvc/convert.h's bulk
// conversions are built on the former). The same results as kvc/dtype.h's scalar conversions for
// every non-NaN input; NaN stays NaN (bf16: a quiet one). Internal header: x86-64 only, callers
// carry the same target.
#ifndef KVC_KERNELS_CORE_CONVERT_X86_INL_H_
#define KVC_KERNELS_CORE_CONVERT_X86_INL_H_

#if defined(__x86_64__)
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "kvc/dtype.h"

#define KVC_CONVERT_AVX2_INL __attribute__((target("avx2,f16c"), always_inline)) inline

namespace kvc::convert_x86 {

KVC_CONVERT_AVX2_INL __m256 HalfToFloat8(const uint16_t* s) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
}

KVC_CONVERT_AVX2_INL __m256 BFloat16ToFloat8(const uint16_t* s) {
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16));
}

// Round to nearest even.
KVC_CONVERT_AVX2_INL void FloatToHalf8(__m256 x, uint16_t* d) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

// Round to nearest even on the integer bits, as FloatToBFloat16 does; NaN becomes a quiet NaN.
KVC_CONVERT_AVX2_INL void FloatToBFloat16x8(__m256 v, uint16_t* d) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nan_bits = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(
      _mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, nan_bits, is_nan);
  // packus works per 128-bit lane; permute restores element order.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(d), _mm256_castsi256_si128(packed));
}

// Elements [i, i + 8) of an array of T as floats, and floats rounded into them.
template <DType T>
KVC_CONVERT_AVX2_INL __m256 LoadFloat8(const void* base, size_t i) {
  if constexpr (T == DType::kF32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
  const auto* h = static_cast<const uint16_t*>(base) + i;
  if constexpr (T == DType::kF16) return HalfToFloat8(h);
  return BFloat16ToFloat8(h);
}

template <DType T>
KVC_CONVERT_AVX2_INL void StoreFloat8(void* base, size_t i, __m256 v) {
  if constexpr (T == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(base) + i, v);
  } else if constexpr (T == DType::kF16) {
    FloatToHalf8(v, static_cast<uint16_t*>(base) + i);
  } else {
    FloatToBFloat16x8(v, static_cast<uint16_t*>(base) + i);
  }
}

// The same sixteen elements at a time with AVX-512 (F, BW, VL), for kernels built for that
// target: the same results as LoadFloat8 / StoreFloat8.
#define KVC_CONVERT_AVX512_INL \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"), always_inline)) inline

// Elements [i, i + 16) of an array of T as floats.
template <DType T>
KVC_CONVERT_AVX512_INL __m512 LoadFloat16(const void* base, size_t i) {
  if constexpr (T == DType::kF32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
  const __m256i h =
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
  if constexpr (T == DType::kF16) return _mm512_cvtph_ps(h);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Rounded as StoreFloat8 rounds (bf16: to nearest even on the integer bits, NaN made quiet).
template <DType T>
KVC_CONVERT_AVX512_INL void StoreFloat16(void* base, size_t i, __m512 v) {
  if constexpr (T == DType::kF32) {
    _mm512_storeu_ps(static_cast<float*>(base) + i, v);
    return;
  }
  auto* d = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i);
  if constexpr (T == DType::kF16) {
    _mm256_storeu_si256(d, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  } else {
    const __m512i x = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    const __m512i nan_bits = _mm512_or_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(0x40));
    const __mmask16 is_nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(x, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
    _mm256_storeu_si256(d, _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded,
                                                                          nan_bits)));
  }
}

}  // namespace kvc::convert_x86

#endif  // __x86_64__

#endif  // KVC_KERNELS_CORE_CONVERT_X86_INL_H_

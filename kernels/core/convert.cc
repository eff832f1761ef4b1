// Vector paths use function-level target attributes so the library stays portable to any x86-64;
// kvc/cpu_isa.h chooses at run time (and caps).
#include "kvc/convert.h"

#include <cstdint>
#include <cstring>

#include "kvc/cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KVC_X86 1
#endif

namespace kvc {
namespace internal {

void ToFloatScalar(const void* src, DType t, size_t n, float* dst) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = HalfToFloat(s[i]);
      return;
    }
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(s[i]);
      return;
    }
  }
}

void FromFloatScalar(const float* src, DType t, size_t n, void* dst) {
  switch (t) {
    case DType::kF32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::kF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToHalf(src[i]);
      return;
    }
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < n; ++i) d[i] = FloatToBFloat16(src[i]);
      return;
    }
  }
}

}  // namespace internal

namespace {

#ifdef KVC_X86
__attribute__((target("avx2,f16c"))) void HalfToFloatAvx2(const uint16_t* s, size_t n, float* d) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 8));
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(a));
    _mm256_storeu_ps(d + i + 8, _mm256_cvtph_ps(b));
  }
  for (; i < n; ++i) d[i] = HalfToFloat(s[i]);
}

__attribute__((target("avx2"))) void BFloat16ToFloatAvx2(const uint16_t* s, size_t n, float* d) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m256i w = _mm256_slli_epi32(_mm256_cvtepu16_epi32(a), 16);
    _mm256_storeu_ps(d + i, _mm256_castsi256_ps(w));
  }
  for (; i < n; ++i) d[i] = BFloat16ToFloat(s[i]);
}

__attribute__((target("avx2,f16c"))) void FloatToHalfAvx2(const float* s, size_t n, uint16_t* d) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), h);
  }
  for (; i < n; ++i) d[i] = FloatToHalf(s[i]);
}

// Round to nearest even on the integer bits, as FloatToBFloat16 does; NaN becomes a quiet NaN.
__attribute__((target("avx2"))) void FloatToBFloat16Avx2(const float* s, size_t n, uint16_t* d) {
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i bias = _mm256_set1_epi32(0x7fff);
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
  const __m256i inf = _mm256_set1_epi32(0x7f800000);
  const __m256i quiet = _mm256_set1_epi32(0x40);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i x = _mm256_castps_si256(_mm256_loadu_ps(s + i));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), one);
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(bias, lsb)), 16);
    const __m256i nan_bits = _mm256_or_si256(_mm256_srli_epi32(x, 16), quiet);
    const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
    const __m256i r = _mm256_blendv_epi8(rounded, nan_bits, is_nan);
    // packus works per 128-bit lane; permute restores element order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_castsi256_si128(packed));
  }
  for (; i < n; ++i) d[i] = FloatToBFloat16(s[i]);
}

#endif

bool HaveSimd() { return CpuIsaAtLeast(CpuIsa::kAvx2); }

}  // namespace

bool ConvertUsesSimd() { return HaveSimd(); }

void ToFloat(const void* src, DType t, size_t n, float* dst) {
#ifdef KVC_X86
  if (HaveSimd()) {
    if (t == DType::kF16) return HalfToFloatAvx2(static_cast<const uint16_t*>(src), n, dst);
    if (t == DType::kBF16) return BFloat16ToFloatAvx2(static_cast<const uint16_t*>(src), n, dst);
  }
#endif
  internal::ToFloatScalar(src, t, n, dst);
}

void FromFloat(const float* src, DType t, size_t n, void* dst) {
#ifdef KVC_X86
  if (HaveSimd()) {
    if (t == DType::kF16) return FloatToHalfAvx2(src, n, static_cast<uint16_t*>(dst));
    if (t == DType::kBF16) return FloatToBFloat16Avx2(src, n, static_cast<uint16_t*>(dst));
  }
#endif
  internal::FromFloatScalar(src, t, n, dst);
}

void RowsToFloat(const void* src, DType t, size_t src_row_stride, size_t rows, size_t cols,
                 float* dst) {
  if (src_row_stride == cols) return ToFloat(src, t, rows * cols, dst);
  const size_t esize = DTypeSize(t);
  const auto* base = static_cast<const uint8_t*>(src);
  for (size_t r = 0; r < rows; ++r) {
    ToFloat(base + r * src_row_stride * esize, t, cols, dst + r * cols);
  }
}

}  // namespace kvc

// Vector paths use function-level target attributes so the library stays portable to any x86-64;
// kvc/cpu_isa.h chooses at run time (and caps).
#include "kvc/convert.h"

#include <cstdint>
#include <cstring>

#include "kvc/cpu_isa.h"

#if defined(__x86_64__)
#include <immintrin.h>

#include "core/convert_x86_inl.h"
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
using convert_x86::BFloat16ToFloat8;
using convert_x86::FloatToBFloat16x8;
using convert_x86::FloatToHalf8;
using convert_x86::HalfToFloat8;

__attribute__((target("avx2,f16c"))) void HalfToFloatAvx2(const uint16_t* s, size_t n, float* d) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_ps(d + i, HalfToFloat8(s + i));
    _mm256_storeu_ps(d + i + 8, HalfToFloat8(s + i + 8));
  }
  for (; i < n; ++i) d[i] = HalfToFloat(s[i]);
}

__attribute__((target("avx2,f16c"))) void BFloat16ToFloatAvx2(const uint16_t* s, size_t n,
                                                              float* d) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, BFloat16ToFloat8(s + i));
  for (; i < n; ++i) d[i] = BFloat16ToFloat(s[i]);
}

__attribute__((target("avx2,f16c"))) void FloatToHalfAvx2(const float* s, size_t n, uint16_t* d) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) FloatToHalf8(_mm256_loadu_ps(s + i), d + i);
  for (; i < n; ++i) d[i] = FloatToHalf(s[i]);
}

__attribute__((target("avx2,f16c"))) void FloatToBFloat16Avx2(const float* s, size_t n,
                                                              uint16_t* d) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) FloatToBFloat16x8(_mm256_loadu_ps(s + i), d + i);
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

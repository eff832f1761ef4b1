// Generic vector kernels: max, exp-and-sum, axpy (one row or many), squares, streaming copy.
#include "cpu/simd.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu/simd_inl.h"
#include "kvc/cpu_isa.h"

namespace kvc::simd {
namespace detail {

bool HaveAvx2() { return CpuIsaAtLeast(CpuIsa::kAvx2); }

bool HaveAvx512() { return CpuIsaAtLeast(CpuIsa::kAvx512); }

}  // namespace detail

namespace {
using detail::HaveAvx2;
using detail::HaveAvx512;

#ifdef KVC_X86
using detail::Exp16;
using detail::Exp8;
using detail::HorizontalSum;
using detail::TailMask;

__attribute__((target("avx2,fma"))) float MaxAvx2(const float* x, size_t n) {
  __m256 m = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  size_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
  float r = _mm_cvtss_f32(s);
  for (; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

__attribute__((target("avx2,fma"))) float ExpShiftSumAvx2(float* x, size_t n, float m) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), vm));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  float sum = HorizontalSum(acc);
  if (i < n) {  // tail through the same polynomial, so both paths see one exp definition
    alignas(32) float tail[8];
    const size_t rest = n - i;
    for (size_t k = 0; k < 8; ++k) tail[k] = k < rest ? x[i + k] - m : -100.0f;
    const __m256 e = Exp8(_mm256_load_ps(tail));
    _mm256_store_ps(tail, e);
    for (size_t k = 0; k < rest; ++k) {
      x[i + k] = tail[k];
      sum += tail[k];
    }
  }
  return sum;
}

__attribute__((target("avx2,fma"))) void AxpyAvx2(float a, const float* x, float* y, size_t n) {
  const __m256 va = _mm256_set1_ps(a);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

__attribute__((target("avx2,fma"))) void AxpyRowsAvx2(const float* const* rows, const float* a,
                                                      int m, float* y, size_t n) {
  for (int i0 = 0; i0 < m; i0 += 8) {
    const int i1 = i0 + 8 < m ? i0 + 8 : m;
    size_t j = 0;
    for (; j + 32 <= n; j += 32) {
      __m256 acc[4];
      for (int q = 0; q < 4; ++q) acc[q] = _mm256_loadu_ps(y + j + 8 * q);
      for (int i = i0; i < i1; ++i) {
        const __m256 ai = _mm256_set1_ps(a[i]);
        for (int q = 0; q < 4; ++q) {
          acc[q] = _mm256_fmadd_ps(ai, _mm256_loadu_ps(rows[i] + j + 8 * q), acc[q]);
        }
      }
      for (int q = 0; q < 4; ++q) _mm256_storeu_ps(y + j + 8 * q, acc[q]);
    }
    for (; j < n; ++j) {
      float acc = y[j];
      for (int i = i0; i < i1; ++i) acc += a[i] * rows[i][j];
      y[j] = acc;
    }
  }
}

__attribute__((target("avx2,fma"))) void AccumulateSquaresAvx2(const float* x, float* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(v, v, _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += x[i] * x[i];
}

__attribute__((target("avx2,fma"))) float SumSquaresAvx2(const float* x, size_t n) {
  __m256 acc = _mm256_setzero_ps();
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float s = HorizontalSum(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// GCC 12 reports the self-initialized placeholder operand inside its AVX-512 intrinsics
// (_mm512_undefined_*) as uninitialized once they are inlined into these loops (a false positive,
// GCC bug 105593); the operand is never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

__attribute__((target("avx512f,avx512dq"))) float ExpShiftSumAvx512(float* x, size_t n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  size_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), vm));
    _mm512_storeu_ps(x + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (j < n) {
    const __mmask16 k = TailMask(n - j);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm));
    _mm512_mask_storeu_ps(x + j, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f,avx512dq"))) float MaxAvx512(const float* x, size_t n) {
  __m512 m0 = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), m1 = m0;
  size_t j = 0;
  for (; j + 32 <= n; j += 32) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(x + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(x + j + 16));
  }
  for (; j < n; j += 16) {
    const __mmask16 k = n - j >= 16 ? __mmask16{0xffff} : TailMask(n - j);
    m0 = _mm512_mask_max_ps(m0, k, m0, _mm512_maskz_loadu_ps(k, x + j));
  }
  return _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
}

// Eight rows at a time, 64 columns of y held in registers: y is loaded and stored once per eight
// rows, and the rows stream by (eight sequential streams).
__attribute__((target("avx512f,avx512dq"))) void AxpyRowsAvx512(const float* const* rows,
                                                                const float* a, int m, float* y,
                                                                size_t n) {
  for (int i0 = 0; i0 < m; i0 += 8) {
    const int i1 = i0 + 8 < m ? i0 + 8 : m;
    size_t j = 0;
    for (; j + 64 <= n; j += 64) {
      __m512 acc[4];
      for (int q = 0; q < 4; ++q) acc[q] = _mm512_loadu_ps(y + j + 16 * q);
      for (int i = i0; i < i1; ++i) {
        const __m512 ai = _mm512_set1_ps(a[i]);
        for (int q = 0; q < 4; ++q) {
          acc[q] = _mm512_fmadd_ps(ai, _mm512_loadu_ps(rows[i] + j + 16 * q), acc[q]);
        }
      }
      for (int q = 0; q < 4; ++q) _mm512_storeu_ps(y + j + 16 * q, acc[q]);
    }
    for (; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? __mmask16{0xffff} : TailMask(n - j);
      __m512 acc = _mm512_maskz_loadu_ps(k, y + j);
      for (int i = i0; i < i1; ++i) {
        acc = _mm512_fmadd_ps(_mm512_set1_ps(a[i]), _mm512_maskz_loadu_ps(k, rows[i] + j), acc);
      }
      _mm512_mask_storeu_ps(y + j, k, acc);
    }
  }
}

__attribute__((target("avx512f"))) void StreamCopyAvx512(const float* x, float* dst, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(x + i));
  if (i < n) std::memcpy(dst + i, x + i, (n - i) * sizeof(float));
  _mm_sfence();  // order the non-temporal stores before anything this thread publishes later
}

#pragma GCC diagnostic pop
#endif  // KVC_X86

}  // namespace

float Max(const float* x, size_t n) {
#ifdef KVC_X86
  if (HaveAvx512()) return MaxAvx512(x, n);
  if (HaveAvx2()) return MaxAvx2(x, n);
#endif
  float r = -std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < n; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

float ExpShiftSum(float* x, size_t n, float m) {
#ifdef KVC_X86
  if (HaveAvx512()) return ExpShiftSumAvx512(x, n, m);
  if (HaveAvx2()) return ExpShiftSumAvx2(x, n, m);
#endif
  float sum = 0.0f;
  for (size_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  return sum;
}

void StreamCopy(const float* x, float* dst, size_t n) {
#ifdef KVC_X86
  if (HaveAvx512() && reinterpret_cast<uintptr_t>(dst) % 64 == 0) {
    return StreamCopyAvx512(x, dst, n);
  }
#endif
  std::memcpy(dst, x, n * sizeof(float));
}

void Axpy(float a, const float* x, float* y, size_t n) {
#ifdef KVC_X86
  if (HaveAvx2()) return AxpyAvx2(a, x, y, n);
#endif
  for (size_t i = 0; i < n; ++i) y[i] += a * x[i];
}

void AxpyRows(const float* const* rows, const float* a, int m, float* y, size_t n) {
#ifdef KVC_X86
  if (HaveAvx512()) return AxpyRowsAvx512(rows, a, m, y, n);
  if (HaveAvx2()) return AxpyRowsAvx2(rows, a, m, y, n);
#endif
  for (int i0 = 0; i0 < m; i0 += 8) {
    const int i1 = i0 + 8 < m ? i0 + 8 : m;
    for (size_t j = 0; j < n; ++j) {
      float acc = y[j];
      for (int i = i0; i < i1; ++i) acc += a[i] * rows[i][j];
      y[j] = acc;
    }
  }
}

void AccumulateSquares(const float* x, float* y, size_t n) {
#ifdef KVC_X86
  if (HaveAvx2()) return AccumulateSquaresAvx2(x, y, n);
#endif
  for (size_t i = 0; i < n; ++i) y[i] += x[i] * x[i];
}

void AccumulateAbs(const float* x, float* y, size_t n) {
  // Auto-vectorized well enough at -O2/-O3 (no transcendental), and rare (l1 channels only).
  for (size_t i = 0; i < n; ++i) y[i] += std::fabs(x[i]);
}

float SumSquares(const float* x, size_t n) {
#ifdef KVC_X86
  if (HaveAvx2()) return SumSquaresAvx2(x, n);
#endif
  float s = 0.0f;
  for (size_t i = 0; i < n; ++i) s += x[i] * x[i];
  return s;
}

}  // namespace kvc::simd

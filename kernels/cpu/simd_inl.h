// Vector building blocks shared by simd.cc and simd_noise.cc (internal to the CPU backend).
// The exp kernels are the classic Cephes single-precision scheme: n = round(x / ln 2), a degree-6
// polynomial on the reduced argument, then scaling by 2^n (relative error ~1e-7). Softmax over
// 10^7+ logits per layer made libm's scalar expf the bottleneck.
#ifndef KVC_KERNELS_CPU_SIMD_INL_H_
#define KVC_KERNELS_CPU_SIMD_INL_H_

#include <cstddef>

#if defined(__x86_64__)
#include <immintrin.h>
#define KVC_X86 1
#endif

namespace kvc::simd::detail {

// Whether the AVX2 + FMA paths run, and the AVX-512F + DQ ones (the level of kvc/cpu_isa.h).
bool HaveAvx2();
bool HaveAvx512();

#ifdef KVC_X86
__attribute__((target("avx2,fma"))) inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp(x) for x clamped to [-87.34, 88]: n = round(x / log 2), x reduced by n log 2 (in two
// parts), a degree-6 series, then 2^n applied as one exact multiply (n <= 127 fits the exponent
// field). Saturates at the smallest normal float below and at exp(88) ~ 1.65e38 above (never
// inf); the softmaxes that call it pass x - max <= 0.
__attribute__((target("avx2,fma"))) inline __m256 Exp8(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365447505531f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}

// GCC 12 reports the self-initialized placeholder operand inside its AVX-512 intrinsics
// (_mm512_undefined_*) as uninitialized once they are inlined into these loops (a false positive,
// GCC bug 105593); the operand is never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// Exp8's scheme on sixteen lanes; vscalefps applies 2^n (no exponent-field overflow to avoid),
// so no upper clamp is needed: x > 88.72 gives +inf, as expf does.
__attribute__((target("avx512f,avx512dq"))) inline __m512 Exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365447505531f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

inline __mmask16 TailMask(size_t rest) { return static_cast<__mmask16>((1u << rest) - 1); }

#pragma GCC diagnostic pop
#endif  // KVC_X86

}  // namespace kvc::simd::detail

#endif  // KVC_KERNELS_CPU_SIMD_INL_H_

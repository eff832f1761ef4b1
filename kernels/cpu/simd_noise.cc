// Keyformer's Gumbel noise, vectorized: the counter hash and the table-driven logarithm of
// kvc/noise.h evaluated exactly on 8 lanes (AVX2: the 64-bit hash in 32-bit halves; AVX-512DQ:
// native 64-bit multiplies), so that every path, and the CUDA backend, produce bit-identical noise.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/simd.h"
#include "cpu/simd_inl.h"
#include "kvc/noise.h"

namespace kvc::simd {
namespace {
using detail::HaveAvx2;
using detail::HaveAvx512;

#ifdef KVC_X86
using detail::Exp16;
using detail::Exp8;
using detail::HorizontalSum;
using detail::TailMask;

// table[i & 31] for each lane i of idx, from registers: the lane's bits 3 and 4 are the sign bits
// of sel3 and sel4. Four in-lane permutes and three blends; an AVX2 gather of the same eight
// floats took about a third of the noise's time on the machines measured (docs/performance.md).
__attribute__((target("avx2,fma"))) inline __m256 Lookup32(const float* table, __m256i idx,
                                                           __m256 sel3, __m256 sel4) {
  const __m256 t01 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(table), idx),
                                      _mm256_permutevar8x32_ps(_mm256_load_ps(table + 8), idx),
                                      sel3);
  const __m256 t23 = _mm256_blendv_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(table + 16), idx),
                                      _mm256_permutevar8x32_ps(_mm256_load_ps(table + 24), idx),
                                      sel3);
  return _mm256_blendv_ps(t01, t23, sel4);
}

// -NoiseLog(x) of kvc/noise.h on eight lanes, operation for operation (so the results are
// bit-identical): x = m * 2^e with m in [0.75, 1.5), the top five mantissa bits pick 1/c and
// log(1/c) from the shared table, and a degree-5 series gives log1p(m/c - 1). The negation is
// folded into the last three roundings: fnmsub rounds -(a * b + c) exactly as fmadd rounds
// a * b + c, negated (round-to-nearest is symmetric), and the sum of negated parts is the
// negated sum.
__attribute__((target("avx2,fma"))) inline __m256 NegLog8(__m256 x) {
  const __m256i xi = _mm256_castps_si256(x);
  const __m256i mant = _mm256_and_si256(xi, _mm256_set1_epi32(0x007fffff));
  // big: the mantissa 1.f is >= 1.5, so m = 1.f / 2 and the exponent goes up by one.
  const __m256i big = _mm256_cmpgt_epi32(mant, _mm256_set1_epi32(0x003fffff));
  const __m256 m = _mm256_castsi256_ps(_mm256_or_si256(
      mant, _mm256_sub_epi32(_mm256_set1_epi32(0x3f800000),
                             _mm256_and_si256(big, _mm256_set1_epi32(0x00800000)))));
  const __m256 e = _mm256_cvtepi32_ps(
      _mm256_sub_epi32(_mm256_sub_epi32(_mm256_srli_epi32(xi, 23), _mm256_set1_epi32(127)), big));
  // The index is mantissa bits 18..22: permutes read bits 18..20, the blends bits 21 and 22.
  const __m256i idx = _mm256_srli_epi32(xi, 18);
  const __m256 sel3 = _mm256_castsi256_ps(_mm256_slli_epi32(xi, 10));
  const __m256 sel4 = _mm256_castsi256_ps(_mm256_slli_epi32(xi, 9));
  const __m256 inv_c = Lookup32(kNoiseInvC, idx, sel3, sel4);
  const __m256 log_c = Lookup32(kNoiseLogC, idx, sel3, sel4);
  const __m256 r = _mm256_fmsub_ps(m, inv_c, _mm256_set1_ps(1.0f));
  __m256 p = _mm256_set1_ps(0.2f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(-0.25f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 3.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(-0.5f));
  const __m256 neg_log1p = _mm256_fnmsub_ps(p, _mm256_mul_ps(r, r), r);
  const __m256 neg_hi = _mm256_fnmsub_ps(e, _mm256_set1_ps(0.693359375f), log_c);
  return _mm256_add_ps(neg_hi, _mm256_fmadd_ps(e, _mm256_set1_ps(2.12194440e-4f), neg_log1p));
}

// NoiseLog on eight lanes (the sign flip is exact).
__attribute__((target("avx2,fma"))) inline __m256 Log8(__m256 x) {
  return _mm256_xor_ps(NegLog8(x), _mm256_set1_ps(-0.0f));
}

// The per-row hash key of CounterUniform: Mix64(h ^ ((row << 32) | col)) = Mix64(key ^ col).
inline uint64_t RowKey(uint64_t seed, uint32_t layer, uint32_t head, uint32_t row) {
  return Mix64(seed ^ Mix64((uint64_t{layer} << 32) | head)) ^ (uint64_t{row} << 32);
}

// Mix64(key ^ col) on AVX2, eight columns at a time. AVX2 has no 64-bit multiply, and a 64-bit
// lane holds only four columns, so every 64-bit value v is carried as two vectors of 32-bit
// halves, lo(v) and hi(v). Within a row only lo(key ^ col) varies (col < 2^32): the first step,
// z = (key ^ col) + kMixAdd, has hi(z) = hi(key) + hi(kMixAdd) + carry, one of two values, so
// what depends on hi(z) alone is computed once per row for carry 0 and 1 and chosen per lane.
struct RowHash {
  __m256i key_lo;    // lo(key)
  __m256i add_lo;    // lo(kMixAdd)
  __m256i bound;     // lo(kMixAdd) - 2^31: "lo(z) < lo(kMixAdd)" (the carry) as a signed compare
  __m256i shl2[2];   // hi(z) << 2, the bits that z >> 30 moves into lo(z ^ (z >> 30)), per carry
  __m256i cross[2];  // lo(hi(a) * lo(kMixMul1)) for a = z ^ (z >> 30), per carry
};

// The low 32 bits of v in every lane.
__attribute__((target("avx2,fma"))) inline __m256i Splat32(uint64_t v) {
  return _mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(v)));
}

__attribute__((target("avx2,fma"))) inline RowHash MakeRowHash(uint64_t key) {
  RowHash rh;
  rh.key_lo = Splat32(key);
  rh.add_lo = Splat32(kMixAdd);
  rh.bound = Splat32(kMixAdd ^ 0x80000000u);
  for (uint32_t carry = 0; carry < 2; ++carry) {
    const uint32_t hz =
        static_cast<uint32_t>(key >> 32) + static_cast<uint32_t>(kMixAdd >> 32) + carry;
    rh.shl2[carry] = Splat32(hz << 2);
    rh.cross[carry] = Splat32((hz ^ (hz >> 30)) * static_cast<uint32_t>(kMixMul1));
  }
  return rh;
}

// Each lane's 64-bit product a * c of 32-bit values, as its halves (two vpmuludq, one per
// parity of lanes; the low half costs a shift and a blend where a vpmulld would cost a multiply).
__attribute__((target("avx2,fma"))) inline void MulWide32(__m256i a, __m256i c, __m256i* lo,
                                                         __m256i* hi) {
  const __m256i even = _mm256_mul_epu32(a, c);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), c);
  *lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xaa);
  *hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xaa);
}

// Bits 40..63 of Mix64(key ^ col) for the eight columns of `cols` (32-bit lanes), in bits 0..23.
// Mix64's final x ^= x >> 31 is left out: it leaves bits 33..63 unchanged.
__attribute__((target("avx2,fma"))) inline __m256i Hash24(const RowHash& rh, __m256i cols) {
  // lo(z) and the carry out of it.
  const __m256i z = _mm256_add_epi32(_mm256_xor_si256(rh.key_lo, cols), rh.add_lo);
  const __m256i carry =
      _mm256_cmpgt_epi32(rh.bound, _mm256_xor_si256(z, _mm256_set1_epi32(INT32_MIN)));
  // a = z ^ (z >> 30); b = a * kMixMul1 (mod 2^64): with M = kMixMul1, lo(b) = lo(lo(a) lo(M))
  // and hi(b) = hi(lo(a) lo(M)) + lo(lo(a) hi(M)) + lo(hi(a) lo(M)), the last the row's cross.
  const __m256i a = _mm256_xor_si256(_mm256_xor_si256(z, _mm256_srli_epi32(z, 30)),
                                     _mm256_blendv_epi8(rh.shl2[0], rh.shl2[1], carry));
  __m256i b_lo, b_hi;
  MulWide32(a, Splat32(kMixMul1), &b_lo, &b_hi);
  b_hi = _mm256_add_epi32(
      _mm256_add_epi32(b_hi, _mm256_mullo_epi32(a, Splat32(kMixMul1 >> 32))),
      _mm256_blendv_epi8(rh.cross[0], rh.cross[1], carry));
  // c = b ^ (b >> 27); hi(c * kMixMul2) the same way (its low half is not needed).
  const __m256i c_lo = _mm256_xor_si256(_mm256_xor_si256(b_lo, _mm256_srli_epi32(b_lo, 27)),
                                        _mm256_slli_epi32(b_hi, 5));
  const __m256i c_hi = _mm256_xor_si256(b_hi, _mm256_srli_epi32(b_hi, 27));
  __m256i d_lo, d_hi;
  MulWide32(c_lo, Splat32(kMixMul2), &d_lo, &d_hi);
  d_hi = _mm256_add_epi32(
      _mm256_add_epi32(d_hi, _mm256_mullo_epi32(c_lo, Splat32(kMixMul2 >> 32))),
      _mm256_mullo_epi32(c_hi, Splat32(kMixMul2)));
  return _mm256_srli_epi32(d_hi, 8);
}

// CounterUniform for the eight columns of `cols`: (b + 0.5) * 2^-24 rounded once (the scaling is
// exact, so one fma rounds as noise.h's add then multiply do), then the clamp below 1.
__attribute__((target("avx2,fma"))) inline __m256 Uniform8(const RowHash& rh, __m256i cols) {
  return _mm256_min_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(Hash24(rh, cols)),
                                       _mm256_set1_ps(1.0f / 16777216.0f),
                                       _mm256_set1_ps(0.5f / 16777216.0f)),
                       _mm256_set1_ps(kBelowOne));
}

// Columns per pass of the AVX2 noise: 1 KiB of values, in L1.
constexpr size_t kNoiseBlock = 256;

// out[k] = -log(u) (NoiseLog) for columns col0 + k, k < n rounded up to a multiple of 8 (out holds
// that many; columns past n are computed, for the caller to ignore). Two passes, hash then
// logarithm: one loop doing both (or the caller's arithmetic too) keeps more constants live than
// AVX2's 16 registers hold, and GCC's spills and reloads made it ~25% slower.
__attribute__((target("avx2,fma"))) void NegLogUniforms(const RowHash& rh, uint32_t col0,
                                                        size_t n, float* out) {
  __m256i cols = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(col0)),
                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (size_t k = 0; k < n; k += 8, cols = _mm256_add_epi32(cols, _mm256_set1_epi32(8))) {
    _mm256_store_ps(out + k, Uniform8(rh, cols));
  }
  for (size_t k = 0; k < n; k += 8) _mm256_store_ps(out + k, NegLog8(_mm256_load_ps(out + k)));
}

// The n < 8 last values of a row as one vector padded with `pad`, and back: a column's value
// must not depend on where a caller splits the row, so the tail goes through the same operations
// as full vectors.
__attribute__((target("avx2,fma"))) inline __m256 LoadTail(const float* x, size_t n, float pad) {
  alignas(32) float tail[8];
  for (size_t i = 0; i < 8; ++i) tail[i] = i < n ? x[i] : pad;
  return _mm256_load_ps(tail);
}

__attribute__((target("avx2,fma"))) inline void StoreTail(__m256 v, size_t n, float* x) {
  alignas(32) float tail[8];
  _mm256_store_ps(tail, v);
  for (size_t i = 0; i < n; ++i) x[i] = tail[i];
}

__attribute__((target("avx2,fma"))) inline float MaxOfLanes(__m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = lanes[i] > m ? lanes[i] : m;
  return m;
}

// (x + G) / tau, G = -log(-log(u)).
__attribute__((target("avx2,fma"))) inline __m256 NoisyLogits8(__m256 x, const float* neg_log_u,
                                                               __m256 inv_tau) {
  return _mm256_mul_ps(_mm256_add_ps(x, NegLog8(_mm256_load_ps(neg_log_u))), inv_tau);
}

__attribute__((target("avx2,fma"))) float AddGumbelAvx2Impl(float* x, size_t n, uint64_t seed,
                                                            uint32_t layer, uint32_t head,
                                                            uint32_t row, uint32_t col0,
                                                            float inv_tau) {
  const RowHash rh = MakeRowHash(RowKey(seed, layer, head, row));
  const __m256 vtau = _mm256_set1_ps(inv_tau);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(32) float neg_log_u[kNoiseBlock];
  for (size_t j = 0; j < n; j += kNoiseBlock) {
    const size_t len = std::min(kNoiseBlock, n - j);
    NegLogUniforms(rh, col0 + static_cast<uint32_t>(j), len, neg_log_u);
    size_t k = 0;
    for (; k + 8 <= len; k += 8) {
      const __m256 y = NoisyLogits8(_mm256_loadu_ps(x + j + k), neg_log_u + k, vtau);
      _mm256_storeu_ps(x + j + k, y);
      vmax = _mm256_max_ps(vmax, y);
    }
    if (k < len) {  // the row's last vector
      float m = MaxOfLanes(vmax);
      float* t = x + j + k;
      StoreTail(NoisyLogits8(LoadTail(t, len - k, 0.0f), neg_log_u + k, vtau), len - k, t);
      for (size_t i = 0; i < len - k; ++i) m = t[i] > m ? t[i] : m;
      return m;
    }
  }
  return MaxOfLanes(vmax);
}

// exp(x - m) / -log(u), which is exp(x + g - m) for g = -log(-log(u)): one logarithm, not two.
__attribute__((target("avx2,fma"))) inline __m256 GumbelExp8(__m256 x, __m256 m,
                                                             const float* neg_log_u) {
  return _mm256_div_ps(Exp8(_mm256_sub_ps(x, m)), _mm256_load_ps(neg_log_u));
}

__attribute__((target("avx2,fma"))) float GumbelExpSumAvx2Impl(float* x, size_t n, float m,
                                                               uint64_t seed, uint32_t layer,
                                                               uint32_t head, uint32_t row,
                                                               uint32_t col0) {
  const RowHash rh = MakeRowHash(RowKey(seed, layer, head, row));
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  alignas(32) float neg_log_u[kNoiseBlock];
  for (size_t j = 0; j < n; j += kNoiseBlock) {
    const size_t len = std::min(kNoiseBlock, n - j);
    NegLogUniforms(rh, col0 + static_cast<uint32_t>(j), len, neg_log_u);
    size_t k = 0;
    for (; k + 8 <= len; k += 8) {
      const __m256 e = GumbelExp8(_mm256_loadu_ps(x + j + k), vm, neg_log_u + k);
      _mm256_storeu_ps(x + j + k, e);
      acc = _mm256_add_ps(acc, e);
    }
    if (k < len) {  // the row's last vector; its padding (-100 - m) is never read back
      float sum = HorizontalSum(acc);
      float* t = x + j + k;
      StoreTail(GumbelExp8(LoadTail(t, len - k, -100.0f), vm, neg_log_u + k), len - k, t);
      for (size_t i = 0; i < len - k; ++i) sum += t[i];
      return sum;
    }
  }
  return HorizontalSum(acc);
}

__attribute__((target("avx2,fma"))) void LogAvx2Impl(const float* x, float* y, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, Log8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float tail[8] = {1, 1, 1, 1, 1, 1, 1, 1};
    for (size_t k = i; k < n; ++k) tail[k - i] = x[k];
    _mm256_store_ps(tail, Log8(_mm256_load_ps(tail)));
    for (size_t k = i; k < n; ++k) y[k] = tail[k - i];
  }
}

// GCC 12 reports the self-initialized placeholder operand inside its AVX-512 intrinsics
// (_mm512_undefined_*) as uninitialized once they are inlined into these loops (a false positive,
// GCC bug 105593); the operand is never read.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// AVX-512: native 64-bit multiplies (vpmullq). Mix64 of kvc/noise.h on eight lanes, without its
// final x ^= x >> 31: that step leaves bits 33..63 unchanged, and the uniforms use only bits
// 40..63.
__attribute__((target("avx512f,avx512dq"))) inline __m512i Mix64High8(__m512i x) {
  x = _mm512_add_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(kMixAdd)));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 30)),
                         _mm512_set1_epi64(static_cast<int64_t>(kMixMul1)));
  return _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 27)),
                            _mm512_set1_epi64(static_cast<int64_t>(kMixMul2)));
}

// Natural log for positive normal floats, table-driven: x = m * 2^e with m in [0.75, 1.5)
// (getmant/getexp), the top five mantissa bits of m pick c ~ m from 32 (c = 1 next to m = 1, so
// that logs of values near 1 keep their relative accuracy), and
//   log x = e log 2 - log(1/c) + log1p(m/c - 1),
// where |m/c - 1| <= 1/32 and a degree-5 series gives log1p to ~1e-9 relative. 1/c and
// log(1/c) sit in two registers each (vpermt2ps lookups). About 15 instructions against the
// 23 of the Cephes polynomial.
__attribute__((target("avx512f,avx512dq"))) inline __m512 Log16(__m512 x) {
  // The shared table of kvc/noise.h (NoiseLog there is this function on one lane).
  const float* kInvC = kNoiseInvC;
  const float* kLogC = kNoiseLogC;
  const __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p75_1p5, _MM_MANT_SIGN_src);
  __m512 e = _mm512_getexp_ps(x);
  e = _mm512_mask_add_ps(e, _mm512_cmp_ps_mask(m, _mm512_set1_ps(1.0f), _CMP_LT_OQ), e,
                         _mm512_set1_ps(1.0f));  // m < 1: x's mantissa was halved
  const __m512i idx = _mm512_srli_epi32(_mm512_castps_si512(m), 18);  // low 5 bits used
  const __m512 inv_c =
      _mm512_permutex2var_ps(_mm512_load_ps(kInvC), idx, _mm512_load_ps(kInvC + 16));
  const __m512 log_c =
      _mm512_permutex2var_ps(_mm512_load_ps(kLogC), idx, _mm512_load_ps(kLogC + 16));
  const __m512 r = _mm512_fmsub_ps(m, inv_c, _mm512_set1_ps(1.0f));
  __m512 p = _mm512_set1_ps(0.2f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-0.25f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 3.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(-0.5f));
  const __m512 log1p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
  // e * log 2 in two parts (the first exact for |e| < 2^14) so the sum rounds once.
  const __m512 hi = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), log_c);
  return _mm512_add_ps(hi, _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), log1p));
}

// Uniform8 on sixteen lanes, columns c[i] (lanes 0..7) and c[i] + 8 (lanes 8..15).
__attribute__((target("avx512f,avx512dq"))) inline __m512 Uniform16(__m512i key, __m512i c) {
  const __m512i h0 = Mix64High8(_mm512_xor_si512(key, c));
  const __m512i h1 = Mix64High8(_mm512_xor_si512(key, _mm512_add_epi64(c, _mm512_set1_epi64(8))));
  // The high 32-bit halves of h0's then h1's lanes, shifted down to their top 24 bits.
  const __m512i odd = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  const __m512i bits = _mm512_srli_epi32(_mm512_permutex2var_epi32(h0, odd, h1), 8);
  // (b + 0.5) * 2^-24 rounded once, as noise.h's float (b + 0.5f) then exact scaling does; then
  // CounterUniform's clamp below 1.
  return _mm512_min_ps(_mm512_fmadd_ps(_mm512_cvtepi32_ps(bits), _mm512_set1_ps(1.0f / 16777216.0f),
                                       _mm512_set1_ps(0.5f / 16777216.0f)),
                       _mm512_set1_ps(kBelowOne));
}

inline constexpr int64_t kLane[8] = {0, 1, 2, 3, 4, 5, 6, 7};

// 1 / x for positive normal x: rcp14 plus one Newton step (relative error ~1e-7).
__attribute__((target("avx512f,avx512dq"))) inline __m512 Reciprocal16(__m512 x) {
  const __m512 r = _mm512_rcp14_ps(x);
  return _mm512_fmadd_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(1.0f)), r);
}

__attribute__((target("avx512f,avx512dq"))) float AddGumbelAvx512Impl(float* x, size_t n,
                                                                      uint64_t seed, uint32_t layer,
                                                                      uint32_t head, uint32_t row,
                                                                      uint32_t col0,
                                                                      float inv_tau) {
  const __m512i key = _mm512_set1_epi64(static_cast<int64_t>(RowKey(seed, layer, head, row)));
  const __m512 vtau = _mm512_set1_ps(inv_tau);
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i c = _mm512_add_epi64(_mm512_loadu_si512(kLane), _mm512_set1_epi64(col0));
  for (size_t j = 0; j < n; j += 16, c = _mm512_add_epi64(c, _mm512_set1_epi64(16))) {
    const __mmask16 k = n - j >= 16 ? __mmask16{0xffff} : TailMask(n - j);
    const __m512 neg_log_u = _mm512_sub_ps(_mm512_setzero_ps(), Log16(Uniform16(key, c)));
    const __m512 g = _mm512_sub_ps(_mm512_setzero_ps(), Log16(neg_log_u));
    const __m512 y = _mm512_mul_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(k, x + j), g), vtau);
    _mm512_mask_storeu_ps(x + j, k, y);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, y);
  }
  return _mm512_reduce_max_ps(vmax);
}

__attribute__((target("avx512f,avx512dq"))) float GumbelExpSumAvx512Impl(
    float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
    uint32_t col0) {
  const __m512i key = _mm512_set1_epi64(static_cast<int64_t>(RowKey(seed, layer, head, row)));
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  __m512i c = _mm512_add_epi64(_mm512_loadu_si512(kLane), _mm512_set1_epi64(col0));
  size_t j = 0;
  // Two independent vectors per iteration: each is one long dependency chain (hash, log, exp).
  __m512 acc2 = _mm512_setzero_ps();
  for (; j + 32 <= n; j += 32, c = _mm512_add_epi64(c, _mm512_set1_epi64(32))) {
    const __m512i c2 = _mm512_add_epi64(c, _mm512_set1_epi64(16));
    const __m512 nl0 = _mm512_sub_ps(_mm512_setzero_ps(), Log16(Uniform16(key, c)));
    const __m512 nl1 = _mm512_sub_ps(_mm512_setzero_ps(), Log16(Uniform16(key, c2)));
    const __m512 e0 =
        _mm512_mul_ps(Exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j), vm)), Reciprocal16(nl0));
    const __m512 e1 =
        _mm512_mul_ps(Exp16(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16), vm)), Reciprocal16(nl1));
    _mm512_storeu_ps(x + j, e0);
    _mm512_storeu_ps(x + j + 16, e1);
    acc = _mm512_add_ps(acc, e0);
    acc2 = _mm512_add_ps(acc2, e1);
  }
  acc = _mm512_add_ps(acc, acc2);
  for (; j < n; j += 16, c = _mm512_add_epi64(c, _mm512_set1_epi64(16))) {
    const __mmask16 k = n - j >= 16 ? __mmask16{0xffff} : TailMask(n - j);
    const __m512 neg_log_u = _mm512_sub_ps(_mm512_setzero_ps(), Log16(Uniform16(key, c)));
    const __m512 e = _mm512_mul_ps(Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + j), vm)),
                                   Reciprocal16(neg_log_u));
    _mm512_mask_storeu_ps(x + j, k, e);
    acc = _mm512_mask_add_ps(acc, k, acc, e);
  }
  return _mm512_reduce_add_ps(acc);
}

__attribute__((target("avx512f,avx512dq"))) void LogAvx512Impl(const float* x, float* y, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? __mmask16{0xffff} : TailMask(n - i);
    _mm512_mask_storeu_ps(y + i, k, Log16(_mm512_mask_loadu_ps(_mm512_set1_ps(1.0f), k, x + i)));
  }
}

#pragma GCC diagnostic pop
#endif  // KVC_X86

}  // namespace

float AddGumbel(float* x, size_t n, uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                uint32_t col0, float inv_tau) {
  float m;
  if (internal::AddGumbelAvx512(x, n, seed, layer, head, row, col0, inv_tau, &m)) return m;
  if (internal::AddGumbelAvx2(x, n, seed, layer, head, row, col0, inv_tau, &m)) return m;
  return internal::AddGumbelScalar(x, n, seed, layer, head, row, col0, inv_tau);
}

float GumbelExpSum(float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head,
                   uint32_t row, uint32_t col0) {
  float sum;
  if (internal::GumbelExpSumAvx512(x, n, m, seed, layer, head, row, col0, &sum)) return sum;
  if (internal::GumbelExpSumAvx2(x, n, m, seed, layer, head, row, col0, &sum)) return sum;
  return internal::GumbelExpSumScalar(x, n, m, seed, layer, head, row, col0);
}

namespace internal {

float AddGumbelScalar(float* x, size_t n, uint64_t seed, uint32_t layer, uint32_t head,
                      uint32_t row, uint32_t col0, float inv_tau) {
  float m = -std::numeric_limits<float>::infinity();
  for (size_t j = 0; j < n; ++j) {
    x[j] =
        (x[j] + CounterGumbel(seed, layer, head, row, col0 + static_cast<uint32_t>(j))) * inv_tau;
    m = x[j] > m ? x[j] : m;
  }
  return m;
}

float GumbelExpSumScalar(float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head,
                         uint32_t row, uint32_t col0) {
  float sum = 0.0f;
  for (size_t j = 0; j < n; ++j) {
    const float u = CounterUniform(seed, layer, head, row, col0 + static_cast<uint32_t>(j));
    x[j] = std::exp(x[j] - m) / -NoiseLog(u);
    sum += x[j];
  }
  return sum;
}

bool AddGumbelAvx2(float* x, size_t n, uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                   uint32_t col0, float inv_tau, float* max) {
#ifdef KVC_X86
  if (HaveAvx2()) {
    *max = AddGumbelAvx2Impl(x, n, seed, layer, head, row, col0, inv_tau);
    return true;
  }
#endif
  return false;
}

bool AddGumbelAvx512(float* x, size_t n, uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                     uint32_t col0, float inv_tau, float* max) {
#ifdef KVC_X86
  if (HaveAvx512()) {
    *max = AddGumbelAvx512Impl(x, n, seed, layer, head, row, col0, inv_tau);
    return true;
  }
#endif
  return false;
}

bool LogAvx2(const float* x, float* y, size_t n) {
#ifdef KVC_X86
  if (HaveAvx2()) {
    LogAvx2Impl(x, y, n);
    return true;
  }
#endif
  return false;
}

bool LogAvx512(const float* x, float* y, size_t n) {
#ifdef KVC_X86
  if (HaveAvx512()) {
    LogAvx512Impl(x, y, n);
    return true;
  }
#endif
  return false;
}

bool GumbelExpSumAvx2(float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head,
                      uint32_t row, uint32_t col0, float* sum) {
#ifdef KVC_X86
  if (HaveAvx2()) {
    *sum = GumbelExpSumAvx2Impl(x, n, m, seed, layer, head, row, col0);
    return true;
  }
#endif
  return false;
}

bool GumbelExpSumAvx512(float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head,
                        uint32_t row, uint32_t col0, float* sum) {
#ifdef KVC_X86
  if (HaveAvx512()) {
    *sum = GumbelExpSumAvx512Impl(x, n, m, seed, layer, head, row, col0);
    return true;
  }
#endif
  return false;
}

}  // namespace internal

}  // namespace kvc::simd

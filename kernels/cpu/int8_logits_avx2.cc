// The int8 attention-logit kernels' entry points and their AVX2 kernels (see int8_logits.h): 7-bit
// queries against 8-bit keys on `vpmaddubsw` + `vpmaddwd`. Compiled with AVX2, FMA and F16C;
// scoring.cc calls it only when i8::Usable (level kAvx2 or above), and the entry points take the
// AVX-512 VNNI kernels of int8_logits.cc when the caller passes Kernel::kVnni.
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cpu/int8_logits.h"
#include "cpu/row_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVC_INT8_LOGITS_AVX2_BUILT 1
#endif

#if KVC_INT8_LOGITS_AVX2_BUILT
#include <immintrin.h>

#include "cpu/avx2_rows.h"

namespace kvc::cpu::i8 {
namespace {

using avx2::Load8;

constexpr int kMaxDim = 256;
constexpr int kGroup = KeyGroup(Kernel::kAvx2);  // a ymm register holds a quad of 8 keys
static_assert(kGroup == 8);
// Query rows per register block: 4 rows x 16 keys (two groups) take 8 accumulators, two key
// registers, a broadcast, a product and the ones of the 16 ymm registers.
constexpr int kRowBlock = 4;
constexpr int kQueryMax = QueryCodeMax(Kernel::kAvx2);
constexpr int kQueryBias = QueryBias(Kernel::kAvx2);

inline float ReduceMax(__m256 m) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}

inline int32_t ReduceAdd(__m256i v) {
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return _mm_cvtsi128_si32(x);
}

// One row of head_dim (<= kMaxDim, a multiple of 16) values as floats in x, zero-filled up to a
// multiple of 32 values, and the largest magnitude among them.
inline float LoadRow(const uint8_t* row, DType t, int head_dim, __m256* x) {
  const size_t esize = DTypeSize(t);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  const int vecs = head_dim / 8;
  for (int c = 0; c < vecs; ++c) {
    x[c] = Load8(row + static_cast<size_t>(c) * 8 * esize, t);
    m = _mm256_max_ps(m, _mm256_and_ps(x[c], abs_mask));
  }
  for (int c = vecs; c % 4 != 0; ++c) x[c] = _mm256_setzero_ps();
  return ReduceMax(m);
}

// round(x * inv) (to nearest even, as std::nearbyint) as 8 int32 lanes.
inline __m256i Round(__m256 x, float inv) {
  return _mm256_cvtps_epi32(_mm256_mul_ps(x, _mm256_set1_ps(inv)));
}

// Four vectors of 8 int32 (each in int8 range) -> 32 bytes in order.
inline __m256i Narrow(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
  // packs work within 128-bit lanes: the result holds, by dword, v0[0..3] v1[0..3] v2[0..3]
  // v3[0..3] v0[4..7] v1[4..7] v2[4..7] v3[4..7]; the permute puts them in order.
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v0, v1), _mm256_packs_epi32(v2, v3));
  return _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

void PackQueriesAvx2(const float* q, int rows, int head_dim, float scale, uint8_t* codes,
                     float* scales) {
  const __m256i bias = _mm256_set1_epi32(kQueryBias);
  for (int r = 0; r < rows; ++r) {
    __m256 x[kMaxDim / 8];
    const float* row = q + static_cast<size_t>(r) * head_dim;
    const float m = LoadRow(reinterpret_cast<const uint8_t*>(row), DType::kF32, head_dim, x);
    const RowStep st = StepFor(m, kQueryMax);
    scales[r] = scale * st.step;
    uint8_t* out = codes + static_cast<size_t>(r) * head_dim;
    for (int c = 0; c < head_dim / 8; c += 4) {
      __m256i v[4];
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_add_epi32(Round(x[c + i], st.inv), bias);  // in [1, 127]
      }
      alignas(32) uint8_t bytes[32];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), Narrow(v[0], v[1], v[2], v[3]));
      std::memcpy(out + 8 * c, bytes, std::min(32, head_dim - 8 * c));
    }
  }
}

void PackKeysAvx2(const void* src, DType t, size_t row_stride, int n, int head_dim, int8_t* codes,
                  float* scales, int32_t* offsets) {
  const auto* base = static_cast<const uint8_t*>(src);
  const size_t esize = DTypeSize(t);
  const int padded = static_cast<int>(PaddedKeys(n));
  const int quads = head_dim / 4;
  // A group's codes row by row, each row padded to whole 32-byte blocks, then transposed block
  // by block: 8 keys x 8 dwords (channel quads) -> 8 quads x 8 keys.
  const int blocks = (quads + 7) / 8;
  for (int g0 = 0; g0 < padded; g0 += kGroup) {
    alignas(32) int8_t rows[kGroup * kMaxDim];
    for (int i = 0; i < kGroup; ++i) {
      const int key = g0 + i;
      int8_t* dst = rows + static_cast<size_t>(i) * blocks * 32;
      if (key >= n) {
        std::memset(dst, 0, static_cast<size_t>(blocks) * 32);
        scales[key] = 0.0f;
        offsets[key] = 0;
        continue;
      }
      __m256 x[kMaxDim / 8];
      const float m = LoadRow(base + static_cast<size_t>(key) * row_stride * esize, t, head_dim, x);
      const RowStep st = StepFor(m, kKeyCodeMax);
      __m256i sum = _mm256_setzero_si256();
      for (int b = 0; b < blocks; ++b) {
        __m256i v[4];
        for (int j = 0; j < 4; ++j) {
          v[j] = Round(x[4 * b + j], st.inv);  // in [-127, 127]; zero past head_dim
          sum = _mm256_add_epi32(sum, v[j]);
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(dst + 32 * b),
                           Narrow(v[0], v[1], v[2], v[3]));
      }
      scales[key] = st.step;
      offsets[key] = kQueryBias * ReduceAdd(sum);
    }
    int8_t* out = codes + static_cast<size_t>(g0) * head_dim;
    for (int b = 0; b < blocks; ++b) {
      __m256 r[8];  // dwords (four channel codes each) as floats, for the transpose
      for (int i = 0; i < kGroup; ++i) {
        r[i] = _mm256_load_ps(
            reinterpret_cast<const float*>(rows + (static_cast<size_t>(i) * blocks + b) * 32));
      }
      avx2::Transpose8(r);
      for (int p = 0; p < 8 && b * 8 + p < quads; ++p) {
        _mm256_storeu_ps(reinterpret_cast<float*>(out + static_cast<size_t>(b * 8 + p) * 32),
                         r[p]);
      }
    }
  }
}

// acc += per int32 lane the four u8 x s8 products of a and b: `vpmaddubsw` sums two products per
// int16 lane (at most 2 * 127 * 127: no saturation with 7-bit queries), `vpmaddwd` against ones
// sums pairs of those. In assembly: as with int8_logits.cc's vpdpbusd, GCC 12 compiled the
// intrinsics in the unrolled loop with register copies around every step and a spill.
inline void MulAdd(__m256i& acc, __m256i a, __m256i b, __m256i ones) {
  __m256i t;
  asm("vpmaddubsw %[b], %[a], %[t]\n\t"
      "vpmaddwd %[ones], %[t], %[t]\n\t"
      "vpaddd %[t], %[acc], %[acc]"
      : [acc] "+x"(acc), [t] "=&x"(t)
      : [a] "x"(a), [b] "x"(b), [ones] "x"(ones));
}

// Logits of MR query rows (codes at q + r * head_dim) and the 16 keys of two packed groups
// (k: the first; channels 4p..4p+3 of its 8 keys at byte p * 32, the second group head_dim * 8
// bytes on); `keys` (< 16 for the last pair) of the 16 columns are stored.
// (Not inlined, as f32_logits_avx2.cc's Block: GCC keeps the accumulators in registers then.)
template <int MR>
__attribute__((noinline)) void DotBlock(const uint8_t* q, const float* q_scales, int head_dim,
                                        const int8_t* k, const float* k_scales,
                                        const int32_t* k_offsets, float* dst, size_t ldc,
                                        int keys) {
  __m256i acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int quads = head_dim / 4;
  const auto* k0 = reinterpret_cast<const __m256i*>(k);
  const auto* k1 = k0 + quads;
  for (int p = 0; p < quads; ++p) {
    const __m256i b0 = _mm256_loadu_si256(k0 + p);
    const __m256i b1 = _mm256_loadu_si256(k1 + p);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      int32_t w;
      std::memcpy(&w, q + static_cast<size_t>(r) * head_dim + 4 * p, sizeof(w));
      const __m256i a = _mm256_set1_epi32(w);
      MulAdd(acc0[r], a, b0, ones);
      MulAdd(acc1[r], a, b1, ones);
    }
  }
  const __m256i o0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k_offsets));
  const __m256i o1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k_offsets + 8));
  const __m256 s0 = _mm256_loadu_ps(k_scales), s1 = _mm256_loadu_ps(k_scales + 8);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    const __m256 qs = _mm256_set1_ps(q_scales[r]);
    float* out = dst + static_cast<size_t>(r) * ldc;
    const __m256 v0 =
        _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc0[r], o0)), s0), qs);
    const __m256 v1 =
        _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc1[r], o1)), s1), qs);
    if (keys >= 2 * kGroup) {
      _mm256_storeu_ps(out, v0);
      _mm256_storeu_ps(out + 8, v1);
    } else {  // the last pair of groups: only its keys' columns
      alignas(32) float tmp[2 * kGroup];
      _mm256_store_ps(tmp, v0);
      _mm256_store_ps(tmp + 8, v1);
      std::memcpy(out, tmp, static_cast<size_t>(keys) * sizeof(float));
    }
  }
}

void LogitsAvx2(const uint8_t* q_codes, const float* q_scales, int rows, const int8_t* k_codes,
                const float* k_scales, const int32_t* k_offsets, int n, int head_dim, float* dst,
                size_t ldc) {
  ForRowBlocks<kRowBlock>(rows, n, 2 * kGroup, [&](auto mr, int r, int j0) {
    DotBlock<decltype(mr)::value>(q_codes + static_cast<size_t>(r) * head_dim, q_scales + r,
                                  head_dim, k_codes + static_cast<size_t>(j0) * head_dim,
                                  k_scales + j0, k_offsets + j0,
                                  dst + static_cast<size_t>(r) * ldc + j0, ldc,
                                  std::min(2 * kGroup, n - j0));
  });
}

}  // namespace

bool Built() { return true; }

void PackQueries(Kernel kernel, const float* q, int rows, int head_dim, float scale,
                 uint8_t* codes, float* scales) {
  if (kernel == Kernel::kVnni) {
    return internal::PackQueriesVnni(q, rows, head_dim, scale, codes, scales);
  }
  PackQueriesAvx2(q, rows, head_dim, scale, codes, scales);
}

void PackKeys(Kernel kernel, const void* src, DType t, size_t row_stride, int n, int head_dim,
              int8_t* codes, float* scales, int32_t* offsets) {
  if (kernel == Kernel::kVnni) {
    return internal::PackKeysVnni(src, t, row_stride, n, head_dim, codes, scales, offsets);
  }
  PackKeysAvx2(src, t, row_stride, n, head_dim, codes, scales, offsets);
}

void Logits(Kernel kernel, const uint8_t* q_codes, const float* q_scales, int rows,
            const int8_t* k_codes, const float* k_scales, const int32_t* k_offsets, int n,
            int head_dim, float* dst, size_t ldc) {
  if (kernel == Kernel::kVnni) {
    return internal::LogitsVnni(q_codes, q_scales, rows, k_codes, k_scales, k_offsets, n,
                                head_dim, dst, ldc);
  }
  LogitsAvx2(q_codes, q_scales, rows, k_codes, k_scales, k_offsets, n, head_dim, dst, ldc);
}

}  // namespace kvc::cpu::i8

#else  // built without AVX2: Built() and so Usable() are false; nothing below is ever called.

namespace kvc::cpu::i8 {
bool Built() { return false; }
void PackQueries(Kernel, const float*, int, int, float, uint8_t*, float*) { std::abort(); }
void PackKeys(Kernel, const void*, DType, size_t, int, int, int8_t*, float*, int32_t*) {
  std::abort();
}
void Logits(Kernel, const uint8_t*, const float*, int, const int8_t*, const float*, const int32_t*,
            int, int, float*, size_t) {
  std::abort();
}
}  // namespace kvc::cpu::i8

#endif

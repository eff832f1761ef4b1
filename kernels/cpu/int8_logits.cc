// The AVX-512 VNNI int8 attention-logit kernels (see int8_logits.h). Compiled with AVX-512 VNNI
// enabled; int8_logits_avx2.cc's entry points call them only when CpuIsaAtLeast(kAvx512Vnni).
#include "cpu/int8_logits.h"

#include <cstdlib>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define KVC_INT8_LOGITS_BUILT 1
#endif

#if KVC_INT8_LOGITS_BUILT
#include <immintrin.h>

#include "cpu/avx512_rows.h"
#include "cpu/row_blocks.h"

namespace kvc::cpu::i8::internal {

bool VnniBuilt() { return true; }

namespace {

constexpr int kMaxDim = 256;

// One row of head_dim (<= kMaxDim) values as floats, and the largest magnitude among them.
inline float LoadRow(const uint8_t* row, DType t, int head_dim, __m512* x) {
  const size_t esize = DTypeSize(t);
  __m512 m = _mm512_setzero_ps();
  for (int c = 0; c < head_dim / 16; ++c) {
    x[c] = avx512::Load16(row + static_cast<size_t>(c) * 16 * esize, t);
    m = _mm512_max_ps(m, _mm512_abs_ps(x[c]));
  }
  return _mm512_reduce_max_ps(m);
}

// round(x * inv) as 16 int32 lanes.
inline __m512i Round(__m512 x, float inv) {
  return _mm512_cvtps_epi32(_mm512_mul_ps(x, _mm512_set1_ps(inv)));
}

// acc += the four u8 x s8 products of each lane of a and b, summed (vpdpbusd). In assembly: GCC
// 12 compiles the intrinsic in this unrolled loop with a register copy before and after every
// multiply-add and spills the accumulators to the stack, which made the kernel no faster than
// the bf16 one it is meant to beat by 2x.
inline void Dpbusd(__m512i& acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
}

// Logits of MR query rows (codes at q + r * head_dim) and the 32 keys of two packed groups
// (k: the first group; channels 4p..4p+3 of its 16 keys at byte p * 64, the second group
// head_dim * 16 bytes on); the m0 / m1 lanes of each group are stored.
template <int MR>
void DotBlock(const uint8_t* q, const float* q_scales, int head_dim, const int8_t* k,
              const float* k_scales, const int32_t* k_offsets, float* dst, size_t ldc,
              __mmask16 m0, __mmask16 m1) {
  __m512i acc0[MR], acc1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_si512();
  const int quads = head_dim / 4;
  const auto* k0 = reinterpret_cast<const __m512i*>(k);
  const auto* k1 = k0 + quads;
  for (int p = 0; p < quads; ++p) {
    const __m512i b0 = _mm512_loadu_si512(k0 + p);
    const __m512i b1 = _mm512_loadu_si512(k1 + p);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      int32_t w;
      std::memcpy(&w, q + static_cast<size_t>(r) * head_dim + 4 * p, sizeof(w));
      const __m512i a = _mm512_set1_epi32(w);
      Dpbusd(acc0[r], a, b0);
      Dpbusd(acc1[r], a, b1);
    }
  }
  const __m512i o0 = _mm512_loadu_si512(k_offsets), o1 = _mm512_loadu_si512(k_offsets + 16);
  const __m512 s0 = _mm512_loadu_ps(k_scales), s1 = _mm512_loadu_ps(k_scales + 16);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    const __m512 qs = _mm512_set1_ps(q_scales[r]);
    float* out = dst + static_cast<size_t>(r) * ldc;
    const __m512 v0 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc0[r], o0));
    const __m512 v1 = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc1[r], o1));
    _mm512_mask_storeu_ps(out, m0, _mm512_mul_ps(_mm512_mul_ps(v0, s0), qs));
    _mm512_mask_storeu_ps(out + 16, m1, _mm512_mul_ps(_mm512_mul_ps(v1, s1), qs));
  }
}

}  // namespace

void PackQueriesVnni(const float* q, int rows, int head_dim, float scale, uint8_t* codes,
                     float* scales) {
  const __m512i bias = _mm512_set1_epi32(QueryBias(Kernel::kVnni));
  for (int r = 0; r < rows; ++r) {
    __m512 x[kMaxDim / 16];
    const float* row = q + static_cast<size_t>(r) * head_dim;
    const float m = LoadRow(reinterpret_cast<const uint8_t*>(row), DType::kF32, head_dim, x);
    const RowStep st = StepFor(m, QueryCodeMax(Kernel::kVnni));
    scales[r] = scale * st.step;
    uint8_t* out = codes + static_cast<size_t>(r) * head_dim;
    for (int c = 0; c < head_dim / 16; ++c) {
      const __m512i u = _mm512_add_epi32(Round(x[c], st.inv), bias);  // in [1, 255]
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * c), _mm512_cvtusepi32_epi8(u));
    }
  }
}

void PackKeysVnni(const void* src, DType t, size_t row_stride, int n, int head_dim, int8_t* codes,
                  float* scales, int32_t* offsets) {
  const auto* base = static_cast<const uint8_t*>(src);
  const size_t esize = DTypeSize(t);
  const int padded = static_cast<int>(PaddedKeys(n));
  const int quads = head_dim / 4;
  // A group's codes row by row, each row padded to whole 64-byte blocks, then transposed block
  // by block: 16 keys x 16 dwords (channel quads) -> 16 quads x 16 keys.
  const int blocks = (quads + 15) / 16;
  for (int g0 = 0; g0 < padded; g0 += 16) {
    alignas(64) int8_t rows[16 * kMaxDim];
    for (int i = 0; i < 16; ++i) {
      const int key = g0 + i;
      int8_t* dst = rows + static_cast<size_t>(i) * blocks * 64;
      if (key >= n) {
        std::memset(dst, 0, static_cast<size_t>(blocks) * 64);
        scales[key] = 0.0f;
        offsets[key] = 0;
        continue;
      }
      std::memset(dst + head_dim, 0, static_cast<size_t>(blocks) * 64 - head_dim);
      __m512 x[kMaxDim / 16];
      const float m = LoadRow(base + static_cast<size_t>(key) * row_stride * esize, t, head_dim, x);
      const RowStep st = StepFor(m, kKeyCodeMax);
      __m512i sum = _mm512_setzero_si512();
      for (int c = 0; c < head_dim / 16; ++c) {
        const __m512i v = Round(x[c], st.inv);  // in [-127, 127]
        sum = _mm512_add_epi32(sum, v);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16 * c), _mm512_cvtsepi32_epi8(v));
      }
      scales[key] = st.step;
      offsets[key] = QueryBias(Kernel::kVnni) * _mm512_reduce_add_epi32(sum);
    }
    int8_t* out = codes + static_cast<size_t>(g0) * head_dim;
    for (int b = 0; b < blocks; ++b) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = _mm512_load_si512(rows + (static_cast<size_t>(i) * blocks + b) * 64);
      }
      avx512::Transpose16(r);
      for (int p = 0; p < 16 && b * 16 + p < quads; ++p) {
        _mm512_storeu_si512(out + static_cast<size_t>(b * 16 + p) * 64, r[p]);
      }
    }
  }
}

void LogitsVnni(const uint8_t* q_codes, const float* q_scales, int rows, const int8_t* k_codes,
                const float* k_scales, const int32_t* k_offsets, int n, int head_dim, float* dst,
                size_t ldc) {
  // 12 rows x 32 keys: 24 accumulators, two key registers and one broadcast query quad of the 32
  // zmm registers; a group pair's 32 keys (head_dim * 32 bytes) stay in L1 across the rows.
  ForRowBlocks<12>(rows, n, 32, [&](auto mr, int r, int j0) {
    __mmask16 m0, m1;
    avx512::TilePairMasks(n - j0, &m0, &m1);
    DotBlock<decltype(mr)::value>(q_codes + static_cast<size_t>(r) * head_dim, q_scales + r,
                                  head_dim, k_codes + static_cast<size_t>(j0) * head_dim,
                                  k_scales + j0, k_offsets + j0,
                                  dst + static_cast<size_t>(r) * ldc + j0, ldc, m0, m1);
  });
}

}  // namespace kvc::cpu::i8::internal

#else  // built without AVX-512 VNNI: VnniBuilt() is false and nothing below is called.

namespace kvc::cpu::i8::internal {
bool VnniBuilt() { return false; }
void PackQueriesVnni(const float*, int, int, float, uint8_t*, float*) { std::abort(); }
void PackKeysVnni(const void*, DType, size_t, int, int, int8_t*, float*, int32_t*) {
  std::abort();
}
void LogitsVnni(const uint8_t*, const float*, int, const int8_t*, const float*, const int32_t*,
                int, int, float*, size_t) {
  std::abort();
}
}  // namespace kvc::cpu::i8::internal

#endif

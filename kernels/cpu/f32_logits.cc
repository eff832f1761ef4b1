// The fp32 scoring logits' AVX-512 kernels (see f32_logits.h). Compiled with AVX-512F and BW;
// f32_logits_avx2.cc calls them only when CpuIsaAtLeast(kAvx512).
#include "cpu/f32_logits.h"

#include <cstdlib>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define KVC_F32_LOGITS_BUILT 1
#endif

#if KVC_F32_LOGITS_BUILT
#include <immintrin.h>

#include "cpu/avx512_rows.h"
#include "cpu/row_blocks.h"

namespace kvc::cpu::f32::internal {
namespace {

// Query rows per register block (PackQueries groups them so): 12 rows x 32 keys take 24
// accumulators, two key registers and a broadcast of the 32 zmm registers. Tiles are 16 keys, a
// zmm register's lanes.
constexpr int kRowBlock = kAvx512RowBlock;
static_assert(kAvx512Tile == 16);

}  // namespace

bool Avx512Built() { return true; }

void PackKeysAvx512(const void* src, DType t, size_t row_stride, int n, int head_dim, float* out) {
  const auto* base = static_cast<const uint8_t*>(src);
  const size_t esize = DTypeSize(t);
  const int tiles = (n + 31) / 32 * 2;
  for (int kt = 0; kt < tiles; ++kt) {
    float* tile = out + static_cast<size_t>(kt) * head_dim * 16;
    PrefetchRows(base, (kt + 1) * 16, 16, n, row_stride * esize, head_dim * esize);
    for (int d0 = 0; d0 < head_dim; d0 += 16) {
      // Rows: 16 keys' channels d0 .. d0 + 15 -> rows: channels, lanes: keys.
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int key = kt * 16 + i;
        r[i] = key < n ? _mm512_castps_si512(avx512::Load16(
                             base + (static_cast<size_t>(key) * row_stride + d0) * esize, t))
                       : _mm512_setzero_si512();
      }
      avx512::Transpose16(r);
      for (int d = 0; d < 16; ++d) _mm512_storeu_si512(tile + (d0 + d) * 16, r[d]);
    }
  }
}

namespace {

// MR query rows, packed [head_dim][MR] (PackQueries), against the 32 keys of two packed tiles (k:
// the first; the second head_dim * 16 floats on): per channel one load of each tile's 16 keys and
// one broadcast per row, two multiply-adds per row; the m0 / m1 lanes of each tile are stored.
template <int MR>
void Block(const float* qt, int head_dim, const float* k, float scale, float* dst, size_t ldc,
           __mmask16 m0, __mmask16 m1) {
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    acc0[r] = _mm512_setzero_ps();
    acc1[r] = _mm512_setzero_ps();
  }
  const float* k1 = k + static_cast<size_t>(head_dim) * 16;
  for (int d = 0; d < head_dim; ++d) {
    const __m512 b0 = _mm512_loadu_ps(k + d * 16);
    const __m512 b1 = _mm512_loadu_ps(k1 + d * 16);
    const float* a = qt + d * MR;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r]);
      acc0[r] = _mm512_fmadd_ps(ar, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(ar, b1, acc1[r]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    float* o = dst + static_cast<size_t>(r) * ldc;
    _mm512_mask_storeu_ps(o, m0, _mm512_mul_ps(acc0[r], s));
    _mm512_mask_storeu_ps(o + 16, m1, _mm512_mul_ps(acc1[r], s));
  }
}

}  // namespace

void LogitsAvx512(const float* q, int rows, const float* k, int n, int head_dim, float scale,
                  float* dst, size_t ldc) {
  ForRowBlocks<kRowBlock>(rows, n, 32, [&](auto mr, int r, int j0) {
    __mmask16 m0, m1;
    avx512::TilePairMasks(n - j0, &m0, &m1);
    Block<decltype(mr)::value>(q + static_cast<size_t>(r) * head_dim, head_dim,
                               k + static_cast<size_t>(j0) * head_dim, scale,
                               dst + static_cast<size_t>(r) * ldc + j0, ldc, m0, m1);
  });
}

}  // namespace kvc::cpu::f32::internal

#else  // built without AVX-512: Avx512Built() is false; nothing below is ever called.

namespace kvc::cpu::f32::internal {
bool Avx512Built() { return false; }
void PackKeysAvx512(const void*, DType, size_t, int, int, float*) { std::abort(); }
void LogitsAvx512(const float*, int, const float*, int, int, float, float*, size_t) {
  std::abort();
}
}  // namespace kvc::cpu::f32::internal

#endif

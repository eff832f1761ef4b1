// The fp32 scoring logits (see f32_logits.h): the AVX2 kernels and the entry points, which take
// the AVX-512 kernels of f32_logits.cc from that level up. Compiled with AVX2, FMA and F16C;
// scoring.cc calls it only when f32::Usable (level kAvx2 or above).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "cpu/f32_logits.h"
#include "cpu/row_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVC_F32_LOGITS_AVX2_BUILT 1
#endif

#if KVC_F32_LOGITS_AVX2_BUILT
#include <immintrin.h>

#include "cpu/avx2_rows.h"

namespace kvc::cpu::f32 {
namespace {

using avx2::Load8;
using avx2::Transpose8;

// Keys per tile and query rows per register block: 6 rows x 16 keys (two tiles) take 12
// accumulators, two key registers and a broadcast of the 16 ymm registers.
constexpr int kTile = internal::kAvx2Tile;  // a ymm register's lanes
constexpr int kRowBlock = internal::kAvx2RowBlock;
static_assert(kTile == 8);

bool UseAvx512() { return CpuIsaAtLeast(CpuIsa::kAvx512) && internal::Avx512Built(); }

void PackKeysAvx2(const void* src, DType t, size_t row_stride, int n, int head_dim, float* out) {
  const auto* base = static_cast<const uint8_t*>(src);
  const size_t esize = DTypeSize(t);
  const int tiles = (n + 31) / 32 * (32 / kTile);
  for (int kt = 0; kt < tiles; ++kt) {
    float* tile = out + static_cast<size_t>(kt) * head_dim * kTile;
    internal::PrefetchRows(base, (kt + 1) * kTile, kTile, n, row_stride * esize, head_dim * esize);
    for (int d0 = 0; d0 < head_dim; d0 += 8) {
      // Rows: 8 keys' channels d0 .. d0 + 7 -> rows: channels, lanes: keys.
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const int key = kt * kTile + i;
        r[i] = key < n ? Load8(base + (static_cast<size_t>(key) * row_stride + d0) * esize, t)
                       : _mm256_setzero_ps();
      }
      Transpose8(r);
      for (int d = 0; d < 8; ++d) _mm256_storeu_ps(tile + (d0 + d) * kTile, r[d]);
    }
  }
}

// MR query rows, packed [head_dim][MR], against the 16 keys of two packed tiles (k: the first;
// the second head_dim * 8 floats on): per channel one load of each tile's 8 keys and one
// broadcast per row, two multiply-adds per row. `keys` (< 16 for the last group) of the 16
// columns are stored.
// (Not inlined: inlined into the loop over row blocks, GCC 12 kept fewer accumulators in
// registers and the AVX2 path ran at 0.6x of its speed.)
template <int MR>
__attribute__((noinline)) void Block(const float* qt, int head_dim, const float* k, float scale,
                                     float* dst, size_t ldc, int keys) {
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  const float* k1 = k + static_cast<size_t>(head_dim) * kTile;
  for (int d = 0; d < head_dim; ++d) {
    const __m256 b0 = _mm256_loadu_ps(k + d * kTile);
    const __m256 b1 = _mm256_loadu_ps(k1 + d * kTile);
    const float* a = qt + d * MR;
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 ar = _mm256_broadcast_ss(a + r);
      acc0[r] = _mm256_fmadd_ps(ar, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(ar, b1, acc1[r]);
    }
  }
  const __m256 s = _mm256_set1_ps(scale);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    float* o = dst + static_cast<size_t>(r) * ldc;
    if (keys >= 16) {
      _mm256_storeu_ps(o, _mm256_mul_ps(acc0[r], s));
      _mm256_storeu_ps(o + 8, _mm256_mul_ps(acc1[r], s));
    } else {  // the last group: only its keys' columns
      alignas(32) float tmp[16];
      _mm256_store_ps(tmp, _mm256_mul_ps(acc0[r], s));
      _mm256_store_ps(tmp + 8, _mm256_mul_ps(acc1[r], s));
      std::memcpy(o, tmp, static_cast<size_t>(keys) * sizeof(float));
    }
  }
}

void LogitsAvx2(const float* q, int rows, const float* k, int n, int head_dim, float scale,
                float* dst, size_t ldc) {
  ForRowBlocks<kRowBlock>(rows, n, 2 * kTile, [&](auto mr, int r, int j0) {
    Block<decltype(mr)::value>(q + static_cast<size_t>(r) * head_dim, head_dim,
                               k + static_cast<size_t>(j0) * head_dim, scale,
                               dst + static_cast<size_t>(r) * ldc + j0, ldc,
                               std::min(2 * kTile, n - j0));
  });
}

}  // namespace

namespace internal {

void PrefetchRows(const uint8_t* base, int first, int count, int n, size_t stride,
                  size_t row_bytes) {
  for (int i = first; i < first + count && i < n; ++i) {
    const uint8_t* row = base + static_cast<size_t>(i) * stride;
    for (size_t off = 0; off < row_bytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(row + off), _MM_HINT_T0);
    }
  }
}

}  // namespace internal

bool Built() { return true; }

int KeyTile() { return UseAvx512() ? internal::kAvx512Tile : kTile; }
int RowBlock() { return UseAvx512() ? internal::kAvx512RowBlock : kRowBlock; }

void PackKeys(const void* src, DType t, size_t row_stride, int n, int head_dim, float* out) {
  if (UseAvx512()) return internal::PackKeysAvx512(src, t, row_stride, n, head_dim, out);
  PackKeysAvx2(src, t, row_stride, n, head_dim, out);
}

void PackQueries(const float* q, int rows, int head_dim, float* out) {
  const int block = RowBlock();
  for (int r0 = 0; r0 < rows; r0 += block) {
    const int mr = std::min(block, rows - r0);
    float* o = out + static_cast<size_t>(r0) * head_dim;
    for (int d = 0; d < head_dim; ++d) {
      for (int r = 0; r < mr; ++r) o[d * mr + r] = q[static_cast<size_t>(r0 + r) * head_dim + d];
    }
  }
}

void Logits(const float* q, int rows, const float* k, int n, int head_dim, float scale, float* dst,
            size_t ldc) {
  if (UseAvx512()) return internal::LogitsAvx512(q, rows, k, n, head_dim, scale, dst, ldc);
  LogitsAvx2(q, rows, k, n, head_dim, scale, dst, ldc);
}

}  // namespace kvc::cpu::f32

#else  // built without AVX2: Built() and so Usable() are false; nothing below is ever called.

namespace kvc::cpu::f32 {
namespace internal {
void PrefetchRows(const uint8_t*, int, int, int, size_t, size_t) { std::abort(); }
}  // namespace internal
bool Built() { return false; }
int KeyTile() { std::abort(); }
int RowBlock() { std::abort(); }
void PackKeys(const void*, DType, size_t, int, int, float*) { std::abort(); }
void PackQueries(const float*, int, int, float*) { std::abort(); }
void Logits(const float*, int, const float*, int, int, float, float*, size_t) { std::abort(); }
}  // namespace kvc::cpu::f32

#endif

// AMX tile kernels for attention logits, and the AVX-512 BF16 dot-product kernel that reads the
// same packed keys (see amx_logits.h). Compiled with AVX-512 BF16 and AMX enabled; the tile code
// is only called when CpuIsaAtLeast(kAmx), the rest when CpuIsaAtLeast(kAvx512Bf16).
#include "cpu/amx_logits.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

// GCC spells the AMX macros __AMX_TILE__ / __AMX_BF16__, clang up to 16 __AMXTILE__ / __AMXBF16__.
#if (defined(__AMX_TILE__) || defined(__AMXTILE__)) && \
    (defined(__AMX_BF16__) || defined(__AMXBF16__)) && defined(__AVX512BF16__)
#define KVC_AMX_BUILT 1
#endif

#if KVC_AMX_BUILT
#include <immintrin.h>

#include "cpu/avx512_rows.h"
#include "cpu/row_blocks.h"

namespace kvc::cpu::amx {

bool Built() { return true; }
namespace {

// The tile configuration (palette 1): eight tiles of 16 rows x 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

void ConfigureTiles() {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// x0 = elements 0..15 and x1 = 16..31 of 32 floats: their bf16 hi parts (in order, as 16 dwords
// holding pairs) and lo parts.
inline void Split(__m512 x0, __m512 x1, __m512i* hi, __m512i* lo) {
  const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(x1, x0);
  const __m512 b0 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
  const __m512 b1 = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
  *hi = h;
  *lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(x1, b1), _mm512_sub_ps(x0, b0));
}

// Where accumulator tile t (16 x 16 floats) goes: straight into dst at rows r0.., columns c0..
// when wholly inside rows x n; else (nullptr) into a buffer whose inside part CopyClipped copies.
inline float* TileDst(float* dst, size_t ldc, int r0, int c0, int rows, int n) {
  return r0 + 16 <= rows && c0 + 16 <= n ? dst + static_cast<size_t>(r0) * ldc + c0 : nullptr;
}
inline void CopyClipped(const float* buf, float* dst, size_t ldc, int r0, int c0, int rows, int n) {
  if (r0 >= rows || c0 >= n) return;
  const int nr = std::min(16, rows - r0), nc = std::min(16, n - c0);
  for (int i = 0; i < nr; ++i) {
    std::memcpy(dst + static_cast<size_t>(r0 + i) * ldc + c0, buf + i * 16, nc * sizeof(float));
  }
}

}  // namespace

void PackQueries(const float* q, int rows, int head_dim, float scale, uint16_t* hi, uint16_t* lo) {
  const int padded = (rows + 31) / 32 * 32;
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < padded; ++r) {
    for (int d = 0; d < head_dim; d += 32) {
      __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
      if (r < rows) {
        const float* src = q + static_cast<size_t>(r) * head_dim + d;
        x0 = _mm512_mul_ps(_mm512_loadu_ps(src), s);
        x1 = _mm512_mul_ps(_mm512_loadu_ps(src + 16), s);
      }
      __m512i h, l;
      Split(x0, x1, &h, &l);
      const size_t at = static_cast<size_t>(r) * head_dim + d;
      _mm512_storeu_si512(hi + at, h);
      _mm512_storeu_si512(lo + at, l);
    }
  }
}

void PackKeys(const void* src, DType t, size_t row_stride, int n, int head_dim, uint16_t* hi,
              uint16_t* lo) {
  const auto* base = static_cast<const uint8_t*>(src);
  const size_t esize = DTypeSize(t);
  const int tiles = (n + 31) / 32 * 2;
  const int blocks = head_dim / 32;
  for (int kt = 0; kt < tiles; ++kt) {
    for (int db = 0; db < blocks; ++db) {
      __m512i rh[16], rl[16];
      for (int i = 0; i < 16; ++i) {
        const int key = kt * 16 + i;
        const uint8_t* row = base + (static_cast<size_t>(key) * row_stride + db * 32) * esize;
        if (t == DType::kBF16 && lo == nullptr) {
          // bf16 keys are their own hi part: the 32 values as they are (16 dwords of pairs).
          rh[i] = key < n ? _mm512_loadu_si512(row) : _mm512_setzero_si512();
          continue;
        }
        __m512 x0 = _mm512_setzero_ps(), x1 = _mm512_setzero_ps();
        if (key < n) {
          x0 = avx512::Load16(row, t);
          x1 = avx512::Load16(row + 16 * esize, t);
        }
        Split(x0, x1, &rh[i], &rl[i]);
      }
      // Rows: keys, dwords: dimension pairs -> rows: pairs, dwords: keys.
      const size_t at = (static_cast<size_t>(kt) * blocks + db) * 512;
      avx512::Transpose16(rh);
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(hi + at + p * 32, rh[p]);
      if (lo != nullptr) {
        avx512::Transpose16(rl);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(lo + at + p * 32, rl[p]);
      }
    }
  }
}

void Logits(const uint16_t* q_hi, const uint16_t* q_lo, int rows, const uint16_t* k_hi,
            const uint16_t* k_lo, int n, int head_dim, float* dst, size_t ldc) {
  if (rows <= 0 || n <= 0) return;
  ConfigureTiles();
  const int row_tiles = (rows + 31) / 32 * 2;
  const int key_tiles = (n + 31) / 32 * 2;
  const int blocks = head_dim / 32;
  const long q_stride = static_cast<long>(head_dim) * 2;  // bytes per packed query row
  // Tiles 0-3: accumulators of 2 row tiles x 2 key tiles; 4-5: queries; 6-7: keys.
  for (int rt = 0; rt < row_tiles; rt += 2) {
    for (int kt = 0; kt < key_tiles; kt += 2) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int db = 0; db < blocks; ++db) {
        const size_t a0 = static_cast<size_t>(rt) * 16 * head_dim + db * 32;
        const size_t a1 = a0 + static_cast<size_t>(16) * head_dim;
        const size_t b0 = (static_cast<size_t>(kt) * blocks + db) * 512;
        const size_t b1 = (static_cast<size_t>(kt + 1) * blocks + db) * 512;
        _tile_loadd(4, q_hi + a0, q_stride);
        _tile_loadd(5, q_hi + a1, q_stride);
        if (k_lo != nullptr) {  // q_hi . k_lo
          _tile_loadd(6, k_lo + b0, 64);
          _tile_loadd(7, k_lo + b1, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_loadd(6, k_hi + b0, 64);  // q_hi . k_hi
        _tile_loadd(7, k_hi + b1, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
        _tile_loadd(4, q_lo + a0, q_stride);  // q_lo . k_hi
        _tile_loadd(5, q_lo + a1, q_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
      // (The tile number of a tile intrinsic must be a literal: one statement per tile.)
      const int r0 = rt * 16, c0 = kt * 16;
      alignas(64) float buf[256];
      const long ld = static_cast<long>(ldc * sizeof(float));
#define KVC_AMX_STORE(T, R, C)                                   \
  if (float* at = TileDst(dst, ldc, R, C, rows, n)) {            \
    _tile_stored(T, at, ld);                                     \
  } else if ((R) < rows && (C) < n) {                            \
    _tile_stored(T, buf, 64);                                    \
    CopyClipped(buf, dst, ldc, R, C, rows, n);                   \
  }
      KVC_AMX_STORE(0, r0, c0)
      KVC_AMX_STORE(1, r0, c0 + 16)
      KVC_AMX_STORE(2, r0 + 16, c0)
      KVC_AMX_STORE(3, r0 + 16, c0 + 16)
#undef KVC_AMX_STORE
    }
  }
  _tile_release();
}

namespace {

// Logits of MR query rows (bf16, row r at q + r * head_dim) and the 32 keys of two packed tiles
// (k: the first tile; pair p of its 16 keys at dword p * 16, the second tile head_dim / 2 * 16
// dwords on): acc[r] += q_r[2p] k[2p] + q_r[2p+1] k[2p+1] per key lane, times scale at the end;
// the m0 / m1 lanes of each tile are stored.
template <int MR>
void DotBlock(const uint16_t* q, int head_dim, const uint16_t* k, float scale, float* dst,
              size_t ldc, __mmask16 m0, __mmask16 m1) {
  __m512 acc0[MR], acc1[MR];
  for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
  const int pairs = head_dim / 2;
  const auto* k0 = reinterpret_cast<const __m512i*>(k);
  const auto* k1 = k0 + pairs;
  for (int p = 0; p < pairs; ++p) {
    const auto b0 = (__m512bh)_mm512_loadu_si512(k0 + p);
    const auto b1 = (__m512bh)_mm512_loadu_si512(k1 + p);
    for (int r = 0; r < MR; ++r) {
      uint32_t w;
      std::memcpy(&w, q + static_cast<size_t>(r) * head_dim + 2 * p, sizeof(w));
      const auto a = (__m512bh)_mm512_set1_epi32(static_cast<int>(w));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < MR; ++r) {
    float* out = dst + static_cast<size_t>(r) * ldc;
    _mm512_mask_storeu_ps(out, m0, _mm512_mul_ps(acc0[r], s));
    _mm512_mask_storeu_ps(out + 16, m1, _mm512_mul_ps(acc1[r], s));
  }
}

}  // namespace

void DotLogits(const uint16_t* q, int rows, const uint16_t* k, int n, int head_dim, float scale,
               float* dst, size_t ldc) {
  // 12 rows x 32 keys: 24 accumulators, two key registers and one broadcast query pair of the
  // 32 zmm registers; a group's 32 keys (2 * head_dim * 2 bytes) stay in L1 across the rows.
  ForRowBlocks<12>(rows, n, 32, [&](auto mr, int r, int j0) {
    __mmask16 m0, m1;
    avx512::TilePairMasks(n - j0, &m0, &m1);
    DotBlock<decltype(mr)::value>(q + static_cast<size_t>(r) * head_dim, head_dim,
                                  k + static_cast<size_t>(j0) * head_dim,  // tile j0 / 16
                                  scale, dst + static_cast<size_t>(r) * ldc + j0, ldc, m0, m1);
  });
}

}  // namespace kvc::cpu::amx

#else  // built without AMX: Built() and so Usable() are false; nothing below is ever called.

namespace kvc::cpu::amx {
bool Built() { return false; }
void PackQueries(const float*, int, int, float, uint16_t*, uint16_t*) { std::abort(); }
void PackKeys(const void*, DType, size_t, int, int, uint16_t*, uint16_t*) { std::abort(); }
void Logits(const uint16_t*, const uint16_t*, int, const uint16_t*, const uint16_t*, int, int,
            float*, size_t) {
  std::abort();
}
void DotLogits(const uint16_t*, int, const uint16_t*, int, int, float, float*, size_t) {
  std::abort();
}
}  // namespace kvc::cpu::amx

#endif

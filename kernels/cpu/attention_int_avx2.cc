// The AVX2 integer kernels of attention_int.h (vpmaddubsw + vpmaddwd). This file alone is
// compiled with -mavx2 -mfma (kernels/CMakeLists.txt), so nothing here may run before the caller
// checked the CPU, and nothing here may be shared with other files: everything but the entry
// points is internal, and the one header with inline functions it includes
// (cpu/attention_int_blocks.h) keeps them in an unnamed namespace, so this file has its own
// copy (one built for AVX-512 could otherwise be picked by the linker for everyone).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "cpu/attention_int.h"

#if defined(__AVX2__) && defined(__FMA__)

#include "cpu/attention_int_blocks.h"

namespace kvc::cpu::attn::isa {
namespace {

template <int Bits>
inline __m256i Plane(__m256i x, int s) {
  const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << Bits) - 1));
  return _mm256_and_si256(_mm256_srli_epi16(x, Bits * s), mask);
}

// `bytes` (16 or 32) bytes of a row as a vector, zero above.
inline __m256i LoadPiece(const uint8_t* p, int bytes) {
  if (bytes >= 32) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// ---- Keys -------------------------------------------------------------------------------------

inline __m256i LaneMask(int n) {  // the first n of 8 int32 lanes set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// 32 query bytes (channels in order) as [block][plane] dwords, 8 / P blocks of P planes (2- and
// 4-bit codes): dword [k][s] holds the query bytes that block k of the row (code bytes
// 4k .. 4k + 3) meets in plane s, i.e. channels (4k + t) * P + s for t = 0..3. Within each
// 128-bit lane one pshufb gathers each plane's bytes; with 4 planes a lane is one block and that
// is the order, with 2 it holds two blocks and one dword permute interleaves their planes.
template <int P>
inline __m256i BlockPlanes(__m256i v) {
  static_assert(P == 2 || P == 4);
  if constexpr (P == 2) {
    const __m256i ctl = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2,
                                         4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    return _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v, ctl),
                                       _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7));
  } else {
    const __m256i ctl = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4,
                                         8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm256_shuffle_epi8(v, ctl);
  }
}

// The max over each 128-bit lane (four lanes), in every lane of it.
inline __m256 LanesMax4(__m256 a) {
  a = _mm256_max_ps(a, _mm256_permute_ps(a, 0x4E));
  return _mm256_max_ps(a, _mm256_permute_ps(a, 0xB1));
}

// Tree16 of the 16 partial sums held as lo (0..7) and hi (8..15), in vector registers with the
// same additions in the same order.
inline float Tree16v(__m256 lo, __m256 hi) {
  const __m256 t = _mm256_add_ps(lo, hi);  // t[i] = p[i] + p[i + 8]
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));  // u[i] + u[i + 2]
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_shuffle_ps(v, v, 1)));
}

// The preparation for 8-bit codes (blocks of 4 channels, two to a vector): qi widened to int16
// [piece of 16][16] for vpmaddwd, alpha one per block.
void PrepareKeys8(const KeyQueryArgs& A) {
  const int n = A.n;
  const float mid = 255.0f / 2.0f;
  alignas(32) float qs[256 + 32];
  alignas(32) int8_t qi[256 + 32];
  alignas(32) float al8[8];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int a = 0; a < A.nq; ++a) {
    const float* q = A.qm + static_cast<size_t>(a) * n;
    __m256 zp[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int c0 = 0; c0 < n; c0 += 8) {
      const __m256i m = LaneMask(n - c0);
      const __m256 x = _mm256_maskload_ps(q + c0, m);
      _mm256_store_ps(qs + c0, _mm256_mul_ps(x, _mm256_maskload_ps(A.scale + c0, m)));
      __m256& z = zp[(c0 / 8) % 2];  // lanes c mod 16
      z = _mm256_fmadd_ps(x, _mm256_maskload_ps(A.zero + c0, m), z);
    }
    const float qz = Tree16v(zp[0], zp[1]);
    float* alpha = A.alpha + static_cast<size_t>(a) * 64;
    __m256 cp[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    const int padded = (n + 31) / 32 * 32;
    for (int c0 = 0; c0 < padded; c0 += 16) {
      __m256i i32[2];
      for (int h = 0; h < 2; ++h) {
        const __m256 y = _mm256_and_ps(_mm256_load_ps(qs + c0 + 8 * h),
                                       _mm256_castsi256_ps(LaneMask(n - c0 - 8 * h)));
        const __m256 amax = LanesMax4(_mm256_andnot_ps(sign, y));
        const __m256 live = _mm256_cmp_ps(amax, _mm256_set1_ps(0x1p-100f), _CMP_GE_OQ);
        const __m256 inv = _mm256_and_ps(live, _mm256_div_ps(_mm256_set1_ps(127.0f), amax));
        const __m256 al = _mm256_and_ps(live, _mm256_div_ps(amax, _mm256_set1_ps(127.0f)));
        const __m256 x =
            _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(y, inv), _mm256_set1_ps(-127.0f)),
                          _mm256_set1_ps(127.0f));
        i32[h] = _mm256_cvtps_epi32(x);
        // The rounding errors' sum (centring, attention_int.h): qs - alpha * qi, lane c mod 16.
        cp[h] = _mm256_add_ps(cp[h], _mm256_fnmadd_ps(al, _mm256_cvtepi32_ps(i32[h]), y));
        _mm256_store_ps(al8, al);
        const int c = c0 + 8 * h;
        if (c < n) {
          alpha[c / 4] = al8[0];
          alpha[c / 4 + 1] = al8[4];
        }
      }
      const __m256i i16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(i32[0], i32[1]), 0xD8);
      const __m256i i8 = _mm256_permute4x64_epi64(_mm256_packs_epi16(i16, i16), 0x08);
      _mm_store_si128(reinterpret_cast<__m128i*>(qi + c0), _mm256_castsi256_si128(i8));
    }
    A.qz[a] = __builtin_fmaf(mid, Tree16v(cp[0], cp[1]), qz);
    auto* out = static_cast<int16_t*>(A.planes) + static_cast<size_t>(a) * ((n + 15) / 16 * 16);
    for (int c0 = 0; c0 < n; c0 += 16) {
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(out + c0),
          _mm256_cvtepi8_epi16(_mm_load_si128(reinterpret_cast<const __m128i*>(qi + c0))));
    }
  }
}

// The max of each of eight vectors, as the lanes of one: lane i = max over v[i]'s eight lanes.
// Always inlined: called out of line, its eight inputs went through the stack on every call.
inline __attribute__((always_inline)) __m256 Max8x8(const __m256* v) {
  __m256 t[4];
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_max_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  __m256 u[2];
  for (int i = 0; i < 2; ++i) {
    u[i] = _mm256_max_ps(_mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                         _mm256_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  }
  return _mm256_max_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20),
                       _mm256_permute2f128_ps(u[0], u[1], 0x31));
}

// The preparation for 2- and 4-bit codes (blocks of 8 or 16 channels: one or two 8-channel
// chunks), the arithmetic of PrepareKeys in a cheaper order: the magnitudes of eight chunks are
// reduced together (one transpose instead of eight) and the two divisions run once per eight
// chunks. The int8 query goes out as int32 [query][block][plane]: the four query bytes that
// block k of a row (its code bytes 4k .. 4k + 3) meets in plane s, for KeyTiles to broadcast.
// NC: 64-channel pieces (n <= 64 NC), a constant so that the loops over the 8-channel chunks
// unroll and their magnitudes stay in registers (through the stack they cost a store and a load
// each, most of this function's time).
template <int P, int NC>
void PrepareKeysWide(const KeyQueryArgs& A) {
  static_assert(P == 2 || P == 4);
  const int n = A.n;
  const int blocks = static_cast<int>(A.row_bytes) / 4;  // of 4 code bytes
  const float mid = static_cast<float>((1 << (8 / P)) - 1) / 2.0f;
  const int chunks = (n + 7) / 8;         // of 8 channels, <= 8 NC
  const int padded = (chunks + 3) / 4 * 4;  // to whole 32-channel vectors of int8
  alignas(32) float inv[32], al[32];
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int a = 0; a < A.nq; ++a) {
    const float* q = A.qm + static_cast<size_t>(a) * n;
    __m256 zp[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    __m256 ys[8 * NC], mag[8 * NC];  // q * scale and its magnitude, by 8-channel chunk
#pragma GCC unroll 32
    for (int i = 0; i < 8 * NC; ++i) {
      if (i >= chunks) {
        ys[i] = mag[i] = _mm256_setzero_ps();
        continue;
      }
      const int c0 = 8 * i;
      __m256 x, sc, z;
      if (c0 + 8 <= n) {
        x = _mm256_loadu_ps(q + c0);
        sc = _mm256_loadu_ps(A.scale + c0);
        z = _mm256_loadu_ps(A.zero + c0);
      } else {
        const __m256i m = LaneMask(n - c0);
        x = _mm256_maskload_ps(q + c0, m);
        sc = _mm256_maskload_ps(A.scale + c0, m);
        z = _mm256_maskload_ps(A.zero + c0, m);
      }
      const __m256 y = _mm256_mul_ps(x, sc);
      ys[i] = y;
      zp[i % 2] = _mm256_fmadd_ps(x, z, zp[i % 2]);
      mag[i] = _mm256_andnot_ps(sign, y);
    }
    const float qz = Tree16v(zp[0], zp[1]);
    float* alpha = A.alpha + static_cast<size_t>(a) * 64;
#pragma GCC unroll 4
    for (int i = 0; i < 8 * NC; i += 8) {
      if (i >= chunks) break;
      __m256 amax = Max8x8(mag + i);
      // 4 bits per code: a block is two chunks (lanes 2b, 2b + 1).
      if constexpr (P == 4) amax = _mm256_max_ps(amax, _mm256_permute_ps(amax, 0xB1));
      const __m256 live = _mm256_cmp_ps(amax, _mm256_set1_ps(0x1p-100f), _CMP_GE_OQ);
      _mm256_store_ps(inv + i, _mm256_and_ps(live, _mm256_div_ps(_mm256_set1_ps(127.0f), amax)));
      const __m256 al8 = _mm256_and_ps(live, _mm256_div_ps(amax, _mm256_set1_ps(127.0f)));
      _mm256_store_ps(al + i, al8);
      // The block scales out: a chunk each with 2 planes; with 4, a block is two chunks
      // (equal lanes 2b, 2b + 1), the even lanes. Stored whole: alpha has room (64 a query).
      if constexpr (P == 2) {
        _mm256_storeu_ps(alpha + i, al8);
      } else {
        _mm_storeu_ps(alpha + i / 2,
                      _mm256_castps256_ps128(_mm256_permutevar8x32_ps(
                          al8, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6))));
      }
    }
    __m256 cp[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    int32_t* out = static_cast<int32_t*>(A.planes) + static_cast<size_t>(a) * blocks * P;
    for (int v = 0; v < padded; v += 4) {
      __m256i i32[4];
      for (int h = 0; h < 4; ++h) {
        const int i = v + h;
        if (i >= chunks) {
          i32[h] = _mm256_setzero_si256();
          continue;
        }
        const __m256 y = ys[i];
        // |y * inv| <= 127 (1 + 2^-23) rounds to at most 127: no upper clamp; the lower one maps
        // NaN to -127 as the portable kernel does.
        const __m256 x =
            _mm256_max_ps(_mm256_mul_ps(y, _mm256_broadcast_ss(inv + i)), _mm256_set1_ps(-127.0f));
        i32[h] = _mm256_cvtps_epi32(x);
        // The rounding errors' sum (centring, attention_int.h): y - alpha * qi, lane c mod 16
        // (cp[h % 2] is cp[i % 2]: v is a multiple of 4, and h a constant once unrolled).
        cp[h % 2] = _mm256_add_ps(
            cp[h % 2],
            _mm256_fnmadd_ps(_mm256_broadcast_ss(al + i), _mm256_cvtepi32_ps(i32[h]), y));
      }
      const __m256i i8 = _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]),
                                            _mm256_packs_epi32(i32[2], i32[3]));
      // Channels 8v .. 8v + 31 in order, then as [block][plane] dwords (BlockPlanes), stored
      // whole where the row has all 8 / P blocks (the scoring loop reads them right after: a
      // whole store forwards, scattered dwords cost a store each).
      const __m256i by_block = BlockPlanes<P>(
          _mm256_permutevar8x32_epi32(i8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const int k0 = v / 4 * 8 / P;  // this vector's first block
      int32_t* dst = out + static_cast<size_t>(k0) * P;
      if (k0 + 8 / P <= blocks) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), by_block);
      } else if (k0 < blocks) {
        _mm256_maskstore_epi32(dst, LaneMask((blocks - k0) * P), by_block);
      }
    }
    A.qz[a] = __builtin_fmaf(mid, Tree16v(cp[0], cp[1]), qz);
  }
}

template <int P>
void PrepareKeysWideChunks(const KeyQueryArgs& A) {
  switch ((A.n + 63) / 64) {
    case 1:
      return PrepareKeysWide<P, 1>(A);
    case 2:
      return PrepareKeysWide<P, 2>(A);
    case 3:
      return PrepareKeysWide<P, 3>(A);
    default:
      return PrepareKeysWide<P, 4>(A);
  }
}

// 8-bit codes, queries a0 .. a0 + NQ against every row: pieces of 16 bytes widened to int16
// against the query's int16 [piece][16]; lane l of piece k holds channels 16k + 2l, 2l + 1 (block
// 4k + l/2), and each lane's integer sum is scaled by its block's alpha.
template <int NQ>
void KeyRows8(const KeyArgs& A, int a0) {
  const int rb = static_cast<int>(A.row_bytes);
  const int pieces = rb / 16;
  const auto* planes = static_cast<const int16_t*>(A.planes);
  const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  // The block scales of each (query, piece) in lane order, computed once.
  alignas(32) float alpha[NQ][16][8];
  for (int a = 0; a < NQ; ++a) {
    const float* al = A.alpha + static_cast<size_t>(a0 + a) * 64;
    for (int k = 0; k < pieces; ++k) {
      _mm256_store_ps(alpha[a][k], _mm256_permutevar8x32_ps(
                                       _mm256_castps128_ps256(_mm_loadu_ps(al + 4 * k)), pairs));
    }
  }
  alignas(32) float qz8[8], out[8];
  for (int i = 0; i < 8; ++i) qz8[i] = i % 4 < NQ ? A.qz[a0 + i % 4] : 0.0f;
  const __m256 qz = _mm256_load_ps(qz8);
  for (int j = 0; j < A.rows; j += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(A.codes + static_cast<size_t>(j + 16) * rb),
                 _MM_HINT_T0);
    __m256 acc[4][2];
    for (int a = 0; a < 4; ++a) acc[a][0] = acc[a][1] = _mm256_setzero_ps();
    for (int v = 0; v < 2 && j + v < A.rows; ++v) {
      const uint8_t* row = A.codes + static_cast<size_t>(j + v) * rb;
      for (int k = 0; k < pieces; ++k) {
        const __m256i x =
            _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * k)));
        for (int a = 0; a < NQ; ++a) {
          const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
              planes + static_cast<size_t>(a0 + a) * rb + 16 * k));
          acc[a][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(x, q)),
                                      _mm256_load_ps(alpha[a][k]), acc[a][v]);
        }
      }
    }
    // [row j: q0..q3 | row j + 1: q0..q3]
    const __m256 x =
        _mm256_hadd_ps(_mm256_hadd_ps(acc[0][0], acc[1][0]), _mm256_hadd_ps(acc[2][0], acc[3][0]));
    const __m256 y =
        _mm256_hadd_ps(_mm256_hadd_ps(acc[0][1], acc[1][1]), _mm256_hadd_ps(acc[2][1], acc[3][1]));
    const __m256 sum =
        _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    _mm256_store_ps(out, _mm256_add_ps(sum, qz));
    const int n = Min(2, A.rows - j);
    for (int a = 0; a < NQ; ++a) {
      float* s = A.s + static_cast<size_t>(a0 + a) * A.ss + j;
      for (int r = 0; r < n; ++r) s[r] = out[4 * r + a];
    }
  }
}

// One block (4 code bytes) of eight rows, a row to a 32-bit lane, into the queries' scores:
// P vpmaddubsw against the query's broadcast dwords, one vpmaddwd, the block's alpha broadcast.
template <int Bits, int NQ>
inline void TileBlock(__m256i t, const int32_t* qd, const float* al, int k, int blocks,
                      __m256* acc) {
  constexpr int P = 8 / Bits;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i xs[P];
  for (int s = 0; s < P; ++s) xs[s] = Plane<Bits>(t, s);
  for (int a = 0; a < NQ; ++a) {
    const int32_t* q = qd + (static_cast<size_t>(a) * blocks + k) * P;
    // |sum| <= P * 2 * 15 * 127 < 2^15: no saturation before widening.
    __m256i sum = _mm256_maddubs_epi16(xs[0], _mm256_set1_epi32(q[0]));
    for (int s = 1; s < P; ++s) {
      sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(xs[s], _mm256_set1_epi32(q[s])));
    }
    acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum, ones)),
                             _mm256_broadcast_ss(al + a * 64 + k), acc[a]);
  }
}

// 2/4-bit codes, queries a0 .. a0 + NQ: eight rows at a time, transposed so that a lane is a row
// and a vector one block of the eight rows; no horizontal sums, and eight scores stored at once.
template <int Bits, int NQ>
void KeyTiles(const KeyArgs& A, int a0) {
  constexpr int P = 8 / Bits;
  const int rb = static_cast<int>(A.row_bytes);
  const int blocks = rb / 4;
  const int32_t* qd = static_cast<const int32_t*>(A.planes) + static_cast<size_t>(a0) * blocks * P;
  const float* al = A.alpha + static_cast<size_t>(a0) * 64;
  alignas(32) uint8_t tail[8 * 256];  // a last tile of fewer than 8 rows, zero below
  alignas(32) float out[8];
  for (int j0 = 0; j0 < A.rows; j0 += 8) {
    const int nr = Min(8, A.rows - j0);
    const uint8_t* base = A.codes + static_cast<size_t>(j0) * rb;
    if (nr < 8) {
      __builtin_memset(tail, 0, static_cast<size_t>(8) * rb);
      __builtin_memcpy(tail, base, static_cast<size_t>(nr) * rb);
      base = tail;
    }
    __m256 acc[NQ];
    for (int a = 0; a < NQ; ++a) acc[a] = _mm256_setzero_ps();
    int off = 0;
    for (; off + 32 <= rb; off += 32) {  // 8 blocks: an 8x8 dword transpose
      __m256i r[8], h[8];
      for (int i = 0; i < 8; ++i) {
        r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + i * rb + off));
      }
      for (int g = 0; g < 8; g += 4) {  // rows g .. g + 3 within each 128-bit half
        const __m256i t0 = _mm256_unpacklo_epi32(r[g], r[g + 1]);
        const __m256i t1 = _mm256_unpackhi_epi32(r[g], r[g + 1]);
        const __m256i t2 = _mm256_unpacklo_epi32(r[g + 2], r[g + 3]);
        const __m256i t3 = _mm256_unpackhi_epi32(r[g + 2], r[g + 3]);
        h[g] = _mm256_unpacklo_epi64(t0, t2);      // blocks 0 | 4
        h[g + 1] = _mm256_unpackhi_epi64(t0, t2);  // 1 | 5
        h[g + 2] = _mm256_unpacklo_epi64(t1, t3);  // 2 | 6
        h[g + 3] = _mm256_unpackhi_epi64(t1, t3);  // 3 | 7
      }
      const int k0 = off / 4;
      for (int i = 0; i < 4; ++i) {
        TileBlock<Bits, NQ>(_mm256_permute2x128_si256(h[i], h[4 + i], 0x20), qd, al, k0 + i,
                            blocks, acc);
        TileBlock<Bits, NQ>(_mm256_permute2x128_si256(h[i], h[4 + i], 0x31), qd, al, k0 + 4 + i,
                            blocks, acc);
      }
    }
    if (off < rb) {  // 16 bytes left, 4 blocks: rows i and i + 4 share a vector
      __m256i y[4];
      for (int i = 0; i < 4; ++i) {
        y[i] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + i * rb + off))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + (i + 4) * rb + off)), 1);
      }
      const __m256i t0 = _mm256_unpacklo_epi32(y[0], y[1]);
      const __m256i t1 = _mm256_unpackhi_epi32(y[0], y[1]);
      const __m256i t2 = _mm256_unpacklo_epi32(y[2], y[3]);
      const __m256i t3 = _mm256_unpackhi_epi32(y[2], y[3]);
      const int k0 = off / 4;
      TileBlock<Bits, NQ>(_mm256_unpacklo_epi64(t0, t2), qd, al, k0, blocks, acc);
      TileBlock<Bits, NQ>(_mm256_unpackhi_epi64(t0, t2), qd, al, k0 + 1, blocks, acc);
      TileBlock<Bits, NQ>(_mm256_unpacklo_epi64(t1, t3), qd, al, k0 + 2, blocks, acc);
      TileBlock<Bits, NQ>(_mm256_unpackhi_epi64(t1, t3), qd, al, k0 + 3, blocks, acc);
    }
    for (int a = 0; a < NQ; ++a) {
      const __m256 sc = _mm256_add_ps(acc[a], _mm256_set1_ps(A.qz[a0 + a]));
      float* s = A.s + static_cast<size_t>(a0 + a) * A.ss + j0;
      if (nr == 8) {
        _mm256_storeu_ps(s, sc);
      } else {
        _mm256_store_ps(out, sc);
        for (int r = 0; r < nr; ++r) s[r] = out[r];
      }
    }
  }
}

template <int Bits>
void KeyQueries(const KeyArgs& A) {
  // Queries in fours (the caller passes at most four).
  switch (A.nq) {
    case 4:
      return Bits == 8 ? KeyRows8<4>(A, 0) : KeyTiles<Bits, 4>(A, 0);
    case 3:
      return Bits == 8 ? KeyRows8<3>(A, 0) : KeyTiles<Bits, 3>(A, 0);
    case 2:
      return Bits == 8 ? KeyRows8<2>(A, 0) : KeyTiles<Bits, 2>(A, 0);
    case 1:
      return Bits == 8 ? KeyRows8<1>(A, 0) : KeyTiles<Bits, 1>(A, 0);
    default:
      return;
  }
}

// ---- Values -----------------------------------------------------------------------------------
//
// As the AVX-512 kernel (attention_int_avx512.cc): four rows interleaved per 32-bit lane, their
// weights of the lane's group broadcast to it; vpmaddubsw sums pairs into 16 bits, which add up
// over four steps before vpmaddwd widens them. The weights of the lanes (a, g) = a * groups + g
// (up to 16) are held as two 8-lane halves; groups must be 1, 2, 4 or 8 so that each query's
// lanes sit in one half.

// Vector (piece k, plane s, u) lane 4L + t holds the four rows' codes of byte
// 32k + 16L + 4u + t, i.e. channel (that byte) * P + s.
struct ValueLanes {
  int vectors = 0;  // pieces * P * 4
  alignas(32) int32_t group[32][8];
  alignas(32) int32_t channel[32][8];  // 0 where none
  uint8_t valid[32];
  // Per (piece, plane): how many distinct group patterns its four vectors have: 1 (all the same),
  // 2 (u = 0, 1 share one and u = 2, 3 another) or 4. The weights are permuted once per pattern.
  uint8_t patterns[8];
};

void MakeLanes(int bits, int rb, int n, int group, ValueLanes* L) {
  const int P = 8 / bits;
  const int pieces = (rb + 31) / 32;
  L->vectors = pieces * P * 4;
  for (int k = 0; k < pieces; ++k) {
    for (int s = 0; s < P; ++s) {
      for (int u = 0; u < 4; ++u) {
        const int vi = (k * P + s) * 4 + u;
        L->valid[vi] = 0;
        for (int l = 0; l < 8; ++l) {
          const int b = 32 * k + 16 * (l / 4) + 4 * u + l % 4;
          const int c = b * P + s;
          const bool ok = b < rb && c < n;
          L->channel[vi][l] = ok ? c : 0;
          L->group[vi][l] = ok ? c / group : 0;
          if (ok) L->valid[vi] |= static_cast<uint8_t>(1u << l);
        }
      }
      const auto same = [&](int u, int w) {
        for (int l = 0; l < 8; ++l) {
          if (L->group[(k * P + s) * 4 + u][l] != L->group[(k * P + s) * 4 + w][l]) return false;
        }
        return true;
      };
      L->patterns[k * P + s] = same(0, 1) && same(2, 3) ? (same(0, 2) ? 1 : 2) : 4;
    }
  }
}

inline void Interleave4(__m256i x0, __m256i x1, __m256i x2, __m256i x3, __m256i* v) {
  const __m256i u0 = _mm256_unpacklo_epi8(x0, x1), u1 = _mm256_unpackhi_epi8(x0, x1);
  const __m256i u2 = _mm256_unpacklo_epi8(x2, x3), u3 = _mm256_unpackhi_epi8(x2, x3);
  v[0] = _mm256_unpacklo_epi16(u0, u2);
  v[1] = _mm256_unpackhi_epi16(u0, u2);
  v[2] = _mm256_unpacklo_epi16(u1, u3);
  v[3] = _mm256_unpackhi_epi16(u1, u3);
}

// A row's per-group floats (NG of 1, 2, 4, 8) in the lanes l of a half, group l % NG.
template <int NG>
inline __m256 GroupLanes(const float* row) {
  if constexpr (NG == 1) {
    return _mm256_broadcast_ss(row);
  } else if constexpr (NG == 2) {
    return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(row)));
  } else if constexpr (NG == 4) {
    return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(row));
  } else {
    return _mm256_loadu_ps(row);
  }
}

// Bytes [32k, 32k + bytes) of a row, zero past them and past the last row.
inline __m256i LoadRow(const ValueArgs& A, int row, int k, int bytes) {
  if (row >= A.rows) return _mm256_setzero_si256();
  return LoadPiece(A.codes + static_cast<size_t>(row) * A.row_bytes + 32 * k, bytes);
}

// Step q of InterleaveBlock: four rows' pieces interleaved, then split into the P planes.
template <int Bits>
inline void InterleaveStep(__m256i x0, __m256i x1, __m256i x2, __m256i x3, int q,
                           __m256i (*buf)[kValueBlock / 4][4]) {
  __m256i v[4];
  Interleave4(x0, x1, x2, x3, v);
  for (int s = 0; s < 8 / Bits; ++s) {
    for (int u = 0; u < 4; ++u) buf[s][q][u] = Plane<Bits>(v[u], s);
  }
}

// Piece k of the rows [b0, b0 + nb) of a block, interleaved four rows to a 32-bit lane, as the
// P planes of its codes: buf[s][q][u] for step q (rows b0 + 4q ..) and vector u (Interleave4).
// The bytes are interleaved once and the planes taken after (both act byte by byte).
template <int Bits>
void InterleaveBlock(const ValueArgs& A, int b0, int nb, int k,
                     __m256i (*buf)[kValueBlock / 4][4]) {
  const int bytes = Min(32, static_cast<int>(A.row_bytes) - 32 * k);
  const int steps = (nb + 3) / 4;
  if (bytes == 32 && b0 + 4 * steps <= A.rows) {  // whole pieces of rows that all exist: no checks
    const size_t rb = A.row_bytes;
    const uint8_t* p = A.codes + static_cast<size_t>(b0) * rb + 32 * k;
    for (int q = 0; q < steps; ++q, p += 4 * rb) {
      InterleaveStep<Bits>(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + rb)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * rb)),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 3 * rb)), q,
                           buf);
    }
    return;
  }
  for (int q = 0; q < steps; ++q) {
    const int row = b0 + 4 * q;
    InterleaveStep<Bits>(LoadRow(A, row, k, bytes), LoadRow(A, row + 1, k, bytes),
                         LoadRow(A, row + 2, k, bytes), LoadRow(A, row + 3, k, bytes), q, buf);
  }
}

// The integer sums of one plane of a block's piece (`buf`: InterleaveBlock's, steps of four
// rows) for queries a0 .. a0 + QB, scaled by beta into accf's vectors v0 .. v0 + 3. Each query
// runs over the block alone: its 16-bit and 32-bit sums take eight registers, where all queries
// at once would need 32 and spill every step (AVX2 has 16).
template <int Bits, int QB, int NU>
void BlockSums(const ValueLanes& L, int ng, int steps, int v0, const __m256i (*buf)[4],
               const int32_t (*w4)[16], const float* beta16, float (*accf)[32][8]) {
  // Steps of 16-bit sums before widening: 2 * 255 * (2^Bits - 1) per step stays below 2^15.
  constexpr int kSteps16 = Bits == 4 ? 4 : 16;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int a = 0; a < QB; ++a) {
    const int half = (a * ng) / 8;  // which 8 of the 16 lanes (a, g) hold this query's weights
    __m256i idx[NU];  // pattern d: that of vector u = 4d / NU (ValueLanes::patterns)
    for (int d = 0; d < NU; ++d) {
      idx[d] = _mm256_add_epi32(
          _mm256_load_si256(reinterpret_cast<const __m256i*>(L.group[v0 + d * 4 / NU])),
          _mm256_set1_epi32((a * ng) % 8));
    }
    __m256i acc[4], t16[4];
    for (int u = 0; u < 4; ++u) acc[u] = t16[u] = _mm256_setzero_si256();
    for (int q = 0; q < steps; ++q) {
      const __m256i w = _mm256_load_si256(reinterpret_cast<const __m256i*>(w4[q] + 8 * half));
      __m256i wv[NU];
      for (int d = 0; d < NU; ++d) wv[d] = _mm256_permutevar8x32_epi32(w, idx[d]);
      for (int u = 0; u < 4; ++u) {
        t16[u] = _mm256_add_epi16(t16[u], _mm256_maddubs_epi16(wv[u * NU / 4], buf[q][u]));
      }
      if ((q + 1) % kSteps16 == 0 || q + 1 == steps) {
        for (int u = 0; u < 4; ++u) {
          acc[u] = _mm256_add_epi32(acc[u], _mm256_madd_epi16(t16[u], ones));
          t16[u] = _mm256_setzero_si256();
        }
      }
    }
    const __m256 beta = _mm256_load_ps(beta16 + half * 8);
    for (int u = 0; u < 4; ++u) {
      float* f = accf[a][v0 + u];
      _mm256_store_ps(f, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[u]),
                                         _mm256_permutevar8x32_ps(beta, idx[u * NU / 4]),
                                         _mm256_load_ps(f)));
    }
  }
}

// The weights of a block's rows b0 + j, j < nb, for queries a0 .. a0 + QB: w[j][l] = p[a][b0 + j]
// * scale[b0 + j][g] in lane l = a * NG + g, with the lanes' max (wmax) and sum (wsum), and
// zacc += p * zero. NG (groups a row) is fixed at compile time so that the row loop has no branch
// on it.
//
// Eight rows at a time, the two 8-lane halves in turn, unrolled: a half's running values, its two
// lane maps and the transposed probabilities then fit in registers. (Both halves in one loop over
// the rows kept the maps and the probabilities on the stack, or spilt a running sum there, about
// twice the instructions a row.) Each lane sees the same operations in the same order.
template <int QB, int NG>
void BlockWeights(const ValueArgs& A, int a0, int b0, int nb, const int32_t (*qidx)[2][8],
                  float (*w)[16], __m256* wmax, __m256* wsum, __m256* zacc) {
  const size_t rb = A.row_bytes;
  const float* const p = A.p;
  const size_t ps = A.ps;
  __m256 mx[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 sm[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  __m256 zs[2] = {zacc[0], zacc[1]};
  const uint8_t* codes = A.codes + static_cast<size_t>(b0) * rb;
  const float* scale = A.scale + static_cast<size_t>(b0) * NG;
  const float* zero = A.zero + static_cast<size_t>(b0) * NG;
  for (int j0 = 0; j0 < nb; j0 += 8) {
    const int n8 = Min(8, nb - j0);
    // These rows' codes are read right after this function: fetch them now.
    const uint8_t* rows = codes + static_cast<size_t>(j0) * rb;
    for (size_t off = 0; off < static_cast<size_t>(n8) * rb; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(rows + off), _MM_HINT_T0);
    }
    __m256 pa[4];
    for (int a = 0; a < 4; ++a) {
      pa[a] = a < QB ? _mm256_maskload_ps(p + static_cast<size_t>(a0 + a) * ps + b0 + j0,
                                          LaneMask(nb - j0))
                     : _mm256_setzero_ps();
    }
    const __m256 t0 = _mm256_unpacklo_ps(pa[0], pa[1]), t1 = _mm256_unpackhi_ps(pa[0], pa[1]);
    const __m256 t2 = _mm256_unpacklo_ps(pa[2], pa[3]), t3 = _mm256_unpackhi_ps(pa[2], pa[3]);
    __m256 ur[4];  // ur[r] lane 4L + a = p[a][row 4L + r]
    ur[0] = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2)));
    ur[1] = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t0), _mm256_castps_pd(t2)));
    ur[2] = _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3)));
    ur[3] = _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(t1), _mm256_castps_pd(t3)));
    const float* sc = scale + static_cast<size_t>(j0) * NG;
    const float* zr = zero + static_cast<size_t>(j0) * NG;
    const auto half = [&](int h, int count) __attribute__((always_inline)) {
      const __m256i ix0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(qidx[0][h]));
      const __m256i ix1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(qidx[1][h]));
      __m256 m = mx[h], s = sm[h], z = zs[h];
#pragma GCC unroll 8
      for (int r = 0; r < count; ++r) {
        const __m256 pv = _mm256_permutevar8x32_ps(ur[r % 4], r < 4 ? ix0 : ix1);
        const __m256 wv = _mm256_mul_ps(pv, GroupLanes<NG>(sc + r * NG));
        _mm256_store_ps(w[j0 + r] + 8 * h, wv);
        m = _mm256_max_ps(m, wv);
        s = _mm256_add_ps(s, wv);
        z = _mm256_fmadd_ps(pv, GroupLanes<NG>(zr + r * NG), z);
      }
      mx[h] = m, sm[h] = s, zs[h] = z;
    };
    if (n8 == 8) {  // a constant count: the eight rows unroll
      half(0, 8);
      half(1, 8);
    } else {
      half(0, n8);
      half(1, n8);
    }
  }
  wmax[0] = mx[0], wmax[1] = mx[1];
  wsum[0] = sm[0], wsum[1] = sm[1];
  zacc[0] = zs[0], zacc[1] = zs[1];
}

// Queries a0 .. a0 + QB, QB * groups <= 16 lanes (a, g).
template <int Bits, int QB>
void ValueQueries(const ValueArgs& A, const ValueLanes& L, int a0) {
  constexpr int P = 8 / Bits;
  constexpr float kMid = static_cast<float>((1 << Bits) - 1) / 2.0f;
  const int rb = static_cast<int>(A.row_bytes);
  const int ng = A.groups;
  const int pieces = (rb + 31) / 32;
  const int lanes = QB * ng;
  // pv for row 4L + r of an 8-row transpose, half h: lanes l' <- u_r[4L + (8h + l') / ng].
  alignas(32) int32_t qidx[2][2][8];
  alignas(32) float live_lanes[16];
  for (int l = 0; l < 16; ++l) {
    live_lanes[l] = l < lanes ? 1.0f : 0.0f;
    for (int L4 = 0; L4 < 2; ++L4) qidx[L4][l / 8][l % 8] = 4 * L4 + (l < lanes ? l / ng : 0);
  }
  alignas(32) float accf[4][32][8];
  for (int a = 0; a < QB; ++a) {
    for (int v = 0; v < L.vectors; ++v) _mm256_store_ps(accf[a][v], _mm256_setzero_ps());
  }
  __m256 zacc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  alignas(32) float w[kValueBlock][16];
  alignas(32) int32_t w4[kValueBlock / 4][16];
  alignas(32) float beta16[16];
  alignas(32) __m256i buf[P][kValueBlock / 4][4];  // one piece of a block, by plane (8 KiB at most)
  for (int b0 = 0; b0 < A.rows; b0 += kValueBlock) {
    const int nb = Min(kValueBlock, A.rows - b0);
    __m256 wmax[2], wsum[2];
    switch (ng) {
      case 1:
        BlockWeights<QB, 1>(A, a0, b0, nb, qidx, w, wmax, wsum, zacc);
        break;
      case 2:
        BlockWeights<QB, 2>(A, a0, b0, nb, qidx, w, wmax, wsum, zacc);
        break;
      case 4:
        BlockWeights<QB, 4>(A, a0, b0, nb, qidx, w, wmax, wsum, zacc);
        break;
      default:
        BlockWeights<QB, 8>(A, a0, b0, nb, qidx, w, wmax, wsum, zacc);
        break;
    }
    __m256 beta[2], inv[2];
    for (int h = 0; h < 2; ++h) {
      const __m256 live = _mm256_and_ps(
          _mm256_cmp_ps(_mm256_load_ps(live_lanes + 8 * h), _mm256_setzero_ps(), _CMP_GT_OQ),
          _mm256_cmp_ps(wmax[h], _mm256_set1_ps(0x1p-100f), _CMP_GE_OQ));
      beta[h] = _mm256_and_ps(live, _mm256_div_ps(wmax[h], _mm256_set1_ps(255.0f)));
      inv[h] = _mm256_and_ps(live, _mm256_div_ps(_mm256_set1_ps(255.0f), wmax[h]));
      _mm256_store_ps(beta16 + 8 * h, beta[h]);
    }
    for (int h = 0; h < 2; ++h) {
      __m256i wisum = _mm256_setzero_si256();
      for (int q = 0; q < (nb + 3) / 4; ++q) {
        __m256i packed = _mm256_setzero_si256();
        for (int r = 0; r < 4; ++r) {
          const int j = 4 * q + r;
          if (j >= nb) break;
          // w * inv <= 255 (1 + 2^-22): no upper clamp needed; the lower one maps NaN to 0.
          const __m256i wi = _mm256_cvtps_epi32(_mm256_max_ps(
              _mm256_mul_ps(_mm256_load_ps(w[j] + 8 * h), inv[h]), _mm256_setzero_ps()));
          wisum = _mm256_add_epi32(wisum, wi);
          packed = _mm256_or_si256(packed, _mm256_slli_epi32(wi, 8 * r));
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(w4[q] + 8 * h), packed);
      }
      // Centring (attention_int.h): the weights' rounding errors times the mid code, exactly.
      zacc[h] =
          _mm256_fmadd_ps(_mm256_set1_ps(kMid),
                          _mm256_fnmadd_ps(beta[h], _mm256_cvtepi32_ps(wisum), wsum[h]), zacc[h]);
    }
    const int steps = (nb + 3) / 4;
    for (int k = 0; k < pieces; ++k) {
      InterleaveBlock<Bits>(A, b0, nb, k, buf);
      for (int s = 0; s < P; ++s) {
        const int v0 = (k * P + s) * 4;
        switch (L.patterns[k * P + s]) {
          case 1:
            BlockSums<Bits, QB, 1>(L, ng, steps, v0, buf[s], w4, beta16, accf);
            break;
          case 2:
            BlockSums<Bits, QB, 2>(L, ng, steps, v0, buf[s], w4, beta16, accf);
            break;
          default:
            BlockSums<Bits, QB, 4>(L, ng, steps, v0, buf[s], w4, beta16, accf);
            break;
        }
      }
    }
  }
  alignas(32) float z[16];
  _mm256_store_ps(z, zacc[0]);
  _mm256_store_ps(z + 8, zacc[1]);
  for (int a = 0; a < QB; ++a) {
    float* acc = A.acc + static_cast<size_t>(a0 + a) * A.n;
    for (int v = 0; v < L.vectors; ++v) {
      for (int l = 0; l < 8; ++l) {
        if ((L.valid[v] >> l) & 1) acc[L.channel[v][l]] += accf[a][v][l];
      }
    }
    for (int g = 0; g < ng; ++g) {  // channel by channel, without a division each
      const float zg = z[a * ng + g];
      for (int c = g * A.group; c < Min(A.n, (g + 1) * A.group); ++c) acc[c] += zg;
    }
  }
}

template <int Bits>
void ValueBits(const ValueArgs& A, const ValueLanes& lanes) {
  const int qb = Min(4, 16 / A.groups);
  for (int a0 = 0; a0 < A.nq; a0 += qb) {
    switch (Min(qb, A.nq - a0)) {
      case 4:
        ValueQueries<Bits, 4>(A, lanes, a0);
        break;
      case 3:
        ValueQueries<Bits, 3>(A, lanes, a0);
        break;
      case 2:
        ValueQueries<Bits, 2>(A, lanes, a0);
        break;
      default:
        ValueQueries<Bits, 1>(A, lanes, a0);
        break;
    }
  }
}

}  // namespace

void ScoreKeysAvx2(const KeyChunkArgs& C) {
  // Written in full for every block the rows have; zeroed only so that nothing uninitialized is
  // ever read.
  alignas(32) int8_t planes[4 * 512] = {};
  alignas(32) float alpha[4 * 64 + 8] = {};  // per query, <= 64 blocks (zero past the last)
  float qz[4];
  ForEachKeyBlock(C, planes, alpha, qz, [&](const KeyQueryArgs& q, const KeyArgs& k) {
    if (C.bits == 4) {
      PrepareKeysWideChunks<2>(q);
      KeyQueries<4>(k);
    } else if (C.bits == 2) {
      PrepareKeysWideChunks<4>(q);
      KeyQueries<2>(k);
    } else {
      PrepareKeys8(q);
      KeyQueries<8>(k);
    }
  });
}

void AccumulateValuesAvx2(const ValueArgs& A) {
  // The lane maps depend on the shape only: kept per thread for the next call.
  static thread_local ValueLanes lanes;
  static thread_local int shape[4] = {-1, -1, -1, -1};
  const int now[4] = {A.bits, static_cast<int>(A.row_bytes), A.n, A.group};
  if (__builtin_memcmp(shape, now, sizeof(now)) != 0) {
    MakeLanes(A.bits, static_cast<int>(A.row_bytes), A.n, A.group, &lanes);
    __builtin_memcpy(shape, now, sizeof(now));
  }
  if (A.bits == 4) {
    ValueBits<4>(A, lanes);
  } else {
    ValueBits<2>(A, lanes);
  }
}

}  // namespace kvc::cpu::attn::isa

#else  // the compiler could not target AVX2: never called (attention_int.cc checks)

namespace kvc::cpu::attn::isa {
void ScoreKeysAvx2(const KeyChunkArgs&) {}
void AccumulateValuesAvx2(const ValueArgs&) {}
}  // namespace kvc::cpu::attn::isa

#endif

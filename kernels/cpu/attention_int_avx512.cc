// The AVX-512 VNNI integer kernels of attention_int.h. This file alone is compiled with
// -mavx512{f,bw,dq,vl,vnni} (kernels/CMakeLists.txt), so nothing here may run before the caller
// checked the CPU, and nothing here may be shared with other files: everything but the entry
// points is internal, and the one header with inline functions it includes
// (cpu/attention_int_blocks.h) keeps them in an unnamed namespace, so this file has its own
// copy (one built for AVX-512 could otherwise be picked by the linker for everyone).
#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "cpu/attention_int.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

#include "cpu/attention_int_blocks.h"

// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (_mm512_undefined_*): bug 105593.
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace kvc::cpu::attn::isa {
namespace {

// Plane s of 64 packed code bytes: the codes of channels b * (8 / Bits) + s, one per byte.
template <int Bits>
inline __m512i Plane(__m512i x, int s) {
  if constexpr (Bits == 8) {
    return x;
  } else {
    const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << Bits) - 1));
    return _mm512_and_si512(_mm512_srli_epi16(x, Bits * s), mask);
  }
}

inline __mmask64 BytesMask(int n) { return n >= 64 ? ~__mmask64{0} : ((__mmask64{1} << n) - 1); }

// ---- Keys -----------------------------------------------------------------------------------

// The fixed pairwise sum of a vector's 16 lanes (attention_int.h's Tree16), in registers: the
// halves of 512, then 256, then 128 bits, then the last two lanes.
inline float Tree16(__m512 v) {
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_shuffle_ps(x, x, 1)));
}

// Per 128-bit lane, the bytes of each plane together (pshufb), then the lanes' dwords of each
// plane together: 64 query bytes become [plane 0 | plane 1 | ...], 64 / P bytes each.
template <int P>
inline __m512i GroupPlanes(__m512i v) {
  if constexpr (P == 1) {
    return v;
  } else if constexpr (P == 2) {
    const __m512i ctl =
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
    const __m512i perm = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    return _mm512_permutexvar_epi32(perm, _mm512_shuffle_epi8(v, ctl));
  } else {
    const __m512i ctl =
        _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i perm = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    return _mm512_permutexvar_epi32(perm, _mm512_shuffle_epi8(v, ctl));
  }
}

// The max of each block of B = 4P lanes (channels), in every lane of the block.
template <int P>
inline __m512 BlockMax(__m512 a) {
  if constexpr (P == 4) {
    return _mm512_set1_ps(_mm512_reduce_max_ps(a));
  } else {
    if constexpr (P == 2) a = _mm512_max_ps(a, _mm512_shuffle_f32x4(a, a, 0xB1));
    a = _mm512_max_ps(a, _mm512_permute_ps(a, 0x4E));
    return _mm512_max_ps(a, _mm512_permute_ps(a, 0xB1));
  }
}

// Blocks' scales from their largest magnitudes: inv = 127 / amax and alpha = amax / 127 where
// amax >= 2^-100, else both 0 (attention_int.h).
inline void BlockScales(__m512 amax, __m512* inv, __m512* al) {
  const __mmask16 live = _mm512_cmp_ps_mask(amax, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ);
  *inv = _mm512_maskz_div_ps(live, _mm512_set1_ps(127.0f), amax);
  *al = _mm512_maskz_div_ps(live, amax, _mm512_set1_ps(127.0f));
}

// Query a's int8 channels (qi: 64 per vector) in the kernels' layout (KeyRows).
template <int P, int NC>
inline void StorePlanes(const KeyQueryArgs& A, int a, const __m512i* qi) {
  const int rb = static_cast<int>(A.row_bytes);
  const int width = A.rows_per_vector > 1 ? rb : 64;  // bytes per plane vector in `planes`
  const int pieces = A.rows_per_vector > 1 ? 1 : (rb + 63) / 64;
  const size_t per_query = static_cast<size_t>(pieces) * P * width;
  alignas(64) int8_t grouped[128];  // 64 bytes, read 64 at a time from any plane's start
  auto* out = static_cast<int8_t*>(A.planes) + per_query * a;
  if (A.rows_per_vector > 1 && rb * P == 64) {  // [plane][rb] is the grouped vector itself
    _mm512_storeu_si512(out, GroupPlanes<P>(qi[0]));
  } else if (A.rows_per_vector > 1) {  // [plane][rb], rb = 16 or 32
    for (int c0 = 0; c0 < A.n; c0 += 64) {
      _mm512_store_si512(grouped, GroupPlanes<P>(qi[c0 >> 6]));
      const int b0 = c0 / P;
      const __mmask64 keep = BytesMask(Min(64 / P, rb - b0));
      for (int s = 0; s < P; ++s) {
        _mm512_mask_storeu_epi8(out + s * rb + b0, keep,
                                _mm512_maskz_loadu_epi8(keep, grouped + s * (64 / P)));
      }
    }
  } else {  // [piece][plane][64]: 64 channels make 64 / P bytes of each plane
    for (int c0 = 0; c0 < A.n; c0 += 64) {
      _mm512_store_si512(grouped, GroupPlanes<P>(qi[c0 >> 6]));
      const int b0 = c0 / P;
      for (int s = 0; s < P; ++s) {
        int8_t* dst = out + (static_cast<size_t>(b0 >> 6) * P + s) * 64 + (b0 & 63);
        __builtin_memcpy(dst, grouped + s * (64 / P), 64 / P);
      }
    }
  }
}

// The lanes of channels c0 .. c0 + 15 below n.
inline __mmask16 ChannelMask(int n, int c0) {
  return c0 >= n        ? __mmask16{0}
         : n - c0 >= 16 ? __mmask16{0xffff}
                        : static_cast<__mmask16>((1u << (n - c0)) - 1);
}

// Lane c of 16 channels reads the scale of block c / (4P), counted from the vector's first.
template <int P>
inline __m512i BlockOfLane() {
  return _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           P == 4 ? 4 : P == 2 ? 3 : 2);
}

// Query a's int8 channels from its scaled channels qs (64 NC, zero past n) and the block scales
// inv = 127 / amax and al = amax / 127 (block b in lane b % 16 of vector b / 16; the query's
// first block is `first`), the rounding errors' sum (centring, attention_int.h) into qz[a], and
// the kernels' layout (StorePlanes).
template <int P, int NC>
inline void QuantizeQuery(const KeyQueryArgs& A, int a, const float* qs, const __m512* inv,
                          const __m512* al, int first, float qz) {
  constexpr int kB = 4 * P;  // channels per block
  const float mid = static_cast<float>((1 << (8 / P)) - 1) / 2.0f;
  const __m512i block_of = BlockOfLane<P>();
  __m512 cp = _mm512_setzero_ps();
  __m512i qi[NC];
  for (int i = 0; i < NC; ++i) qi[i] = _mm512_setzero_si512();
  for (int c0 = 0; c0 < 64 * NC; c0 += 16) {
    const __mmask16 m = ChannelMask(A.n, c0);
    const int b = first + c0 / kB;  // the chunk's first block
    const __m512i lanes = _mm512_add_epi32(block_of, _mm512_set1_epi32(b & 15));
    const __m512 y = _mm512_load_ps(qs + c0);
    const __m512 iv = _mm512_permutexvar_ps(lanes, inv[b >> 4]);
    const __m512 av = _mm512_permutexvar_ps(lanes, al[b >> 4]);
    // |y * inv| <= 127 (1 + 2^-23) rounds to at most 127: no upper clamp; the lower one maps
    // NaN to -127 as the portable kernel does.
    const __m512 x = _mm512_max_ps(_mm512_mul_ps(y, iv), _mm512_set1_ps(-127.0f));
    const __m512i i32 = _mm512_maskz_cvtps_epi32(m, x);
    qi[c0 >> 6] = _mm512_mask_broadcast_i32x4(
        qi[c0 >> 6], static_cast<__mmask16>(0xFu << (4 * ((c0 >> 4) & 3))),
        _mm512_cvtepi32_epi8(i32));
    // qs - alpha * qi, lane c mod 16.
    cp = _mm512_add_ps(cp, _mm512_fnmadd_ps(av, _mm512_cvtepi32_ps(i32), y));
  }
  A.qz[a] = __builtin_fmaf(mid, Tree16(cp), qz);
  StorePlanes<P, NC>(A, a, qi);
}

// Everything stays in registers from the query to the stored layout: a vector load of bytes
// that were just stored in smaller or masked pieces cannot be forwarded from the store buffer,
// and such stalls once made this preparation cost as much as scoring its token group.
// NC: 64-channel chunks (n <= 64 NC), a constant so that the loops unroll and the chunks'
// vectors stay in registers.
template <int P, int NC>
void PrepareKeys(const KeyQueryArgs& A) {
  constexpr int kB = 4 * P;  // channels per block
  const int n = A.n;
  const __mmask16 firsts = P == 4 ? 0x0001 : P == 2 ? 0x0101 : 0x1111;  // a lane per block
  constexpr __mmask16 kBlockLanes = (1u << (16 / kB)) - 1;  // the blocks of 16 channels
  constexpr int padded = 64 * NC;
  alignas(64) float qs[256];
  for (int a = 0; a < A.nq; ++a) {
    const float* q = A.qm + static_cast<size_t>(a) * n;
    // The scaled channels, the zero term, and each block's largest magnitude (block b in lane
    // b % 16 of amax[b / 16]).
    __m512 zp = _mm512_setzero_ps();
    __m512 amax[NC];
    for (int i = 0; i < NC; ++i) amax[i] = _mm512_setzero_ps();
    for (int c0 = 0; c0 < padded; c0 += 16) {
      const __mmask16 m = ChannelMask(n, c0);
      const __m512 x = _mm512_maskz_loadu_ps(m, q + c0);
      const __m512 y = _mm512_mul_ps(x, _mm512_maskz_loadu_ps(m, A.scale + c0));
      _mm512_store_ps(qs + c0, y);
      zp = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, A.zero + c0), zp);
      // One lane per block, compressed in a register (a compressing store to memory is
      // microcoded and slow on some CPUs, AMD Zen 4), then expanded into place.
      const int b = c0 / kB;
      amax[b >> 4] =
          _mm512_mask_expand_ps(amax[b >> 4], static_cast<__mmask16>(kBlockLanes << (b & 15)),
                                _mm512_maskz_compress_ps(firsts, BlockMax<P>(_mm512_abs_ps(y))));
    }
    const float qz = Tree16(zp);
    // Two divisions per 16 blocks. alpha stored whole (blocks past the last are 0; the buffer
    // holds 64 per query).
    float* alpha = A.alpha + static_cast<size_t>(a) * 64;
    __m512 inv[NC], al[NC];
    for (int i = 0; i < padded / kB; i += 16) {
      BlockScales(amax[i >> 4], &inv[i >> 4], &al[i >> 4]);
      _mm512_storeu_ps(alpha + i, al[i >> 4]);
    }
    QuantizeQuery<P, NC>(A, a, qs, inv, al, 0, qz);
  }
}

// The largest magnitude of every block of 4P lanes of 16 vectors (block i of v[j] is block
// 4j / P + i overall), into 4 / P vectors (out[o] lane l: block 16 o + l), by halving: each
// step takes half of every block's lanes from two vectors and keeps the larger, as a transpose
// does. Exact (max only). v is overwritten.
template <int P>
inline void BlockMaxima(__m512* v, __m512* out) {
  int m = 16;
  if constexpr (P == 4) {  // blocks of 16 lanes -> 8: 256-bit halves
    for (int i = 0; i < m / 2; ++i) {
      v[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    }
    m /= 2;
  }
  if constexpr (P >= 2) {  // 8 -> 4: 128-bit quarters
    for (int i = 0; i < m / 2; ++i) {
      v[i] = _mm512_max_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                           _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
    }
    m /= 2;
  }
  for (int i = 0; i < m / 2; ++i) {  // 4 -> 2 within each 128-bit lane
    v[i] = _mm512_max_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xEE));
  }
  m /= 2;
  for (int i = 0; i < m / 2; ++i) {  // 2 -> 1
    v[i] = _mm512_max_ps(_mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_ps(v[2 * i], v[2 * i + 1], 0xDD));
  }
  m /= 2;
  // Lane 4L + t now holds block 4t + L of its 16: back to order.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int i = 0; i < m; ++i) out[i] = _mm512_permutexvar_ps(order, v[i]);
}

// PrepareKeys for up to four queries of at most 64 channels (the common decode shape: a GQA
// group of four, 64 or fewer kept channels), all four at once: the block maxima of the sixteen
// 16-channel vectors come from one transpose-like reduction (BlockMaxima) instead of a
// horizontal one per vector, and the divisions run once per 16 blocks of all queries. The same
// arithmetic as PrepareKeys, value for value. Queries past nq count as zero and are not stored.
template <int P>
void PrepareKeysSmall(const KeyQueryArgs& A) {
  constexpr int kB = 4 * P;
  constexpr int kBlocks = 64 / kB;  // per query
  const int n = A.n;
  alignas(64) float qs[4][64];
  __m512 mag[16];
  float qz[4];
  for (int a = 0; a < 4; ++a) {
    const float* q = A.qm + static_cast<size_t>(a < A.nq ? a : 0) * n;  // a >= nq: masked out
    __m512 zp = _mm512_setzero_ps();
    for (int c0 = 0; c0 < 64; c0 += 16) {
      const __mmask16 m = a < A.nq ? ChannelMask(n, c0) : __mmask16{0};
      const __m512 x = _mm512_maskz_loadu_ps(m, q + c0);
      const __m512 y = _mm512_mul_ps(x, _mm512_maskz_loadu_ps(m, A.scale + c0));
      _mm512_store_ps(qs[a] + c0, y);
      zp = _mm512_fmadd_ps(x, _mm512_maskz_loadu_ps(m, A.zero + c0), zp);
      mag[a * 4 + c0 / 16] = _mm512_abs_ps(y);
    }
    qz[a] = Tree16(zp);
  }
  constexpr int kOut = 16 / kB;  // vectors of block maxima: 1, 2 or 4
  __m512 amax[kOut], inv[kOut], al[kOut];
  BlockMaxima<P>(mag, amax);
  for (int i = 0; i < kOut; ++i) BlockScales(amax[i], &inv[i], &al[i]);
  // Query a's blocks are blocks a * kBlocks .. of the maxima, stored as the kernels load them
  // (KeyRows: 4, 8 or 16 floats from the query's start), blocks past n being 0.
  for (int a = 0; a < A.nq; ++a) {
    float* alpha = A.alpha + static_cast<size_t>(a) * 64;
    if constexpr (P == 4) {
      const __m512i four = _mm512_add_epi32(
          _mm512_setr_epi32(0, 1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_set1_epi32(4 * a));
      _mm_storeu_ps(alpha, _mm512_castps512_ps128(_mm512_permutexvar_ps(four, al[0])));
    } else if constexpr (P == 2) {
      _mm256_storeu_ps(alpha, a % 2 == 0 ? _mm512_castps512_ps256(al[a / 2])
                                         : _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                               _mm512_castps_pd(al[a / 2]), 1)));
    } else {
      _mm512_storeu_ps(alpha, al[a]);
    }
  }
  for (int a = 0; a < A.nq; ++a) {
    QuantizeQuery<P, 1>(A, a, qs[a], inv, al, a * kBlocks, qz[a]);
  }
}

template <int P>
void PrepareKeysChunks(const KeyQueryArgs& A) {
  switch ((A.n + 63) / 64) {
    case 1:
      return PrepareKeysSmall<P>(A);
    case 2:
      return PrepareKeys<P, 2>(A);
    case 3:
      return PrepareKeys<P, 3>(A);
    default:
      return PrepareKeys<P, 4>(A);
  }
}

// x[4L + v] = sum over 128-bit lane L of a[v], for four accumulators a[0..3].
inline __m512 LaneSums(const __m512* a) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)),
                       _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
}

// [a0 + a1, a2 + a3, b0 + b1, b2 + b3] of 128-bit lanes.
inline __m512 PairLanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}

// Scores rows [j, j + kStep) for queries a0 .. a0 + NQ, kStep = 4 * R. Rows at or past `rows`
// read as zero and are not stored. R > 1: R rows share a vector (row_bytes = 64 / R), the query
// broadcast to each; R = 1: a row is `pieces` vectors of 64 bytes (the last one masked). Each
// 32-bit lane's integer sum (one block of channels) is scaled by its block's alpha in fp32.
template <int Bits, int R, int NQ>
inline void KeyStep(const KeyArgs& A, const __m512i (*q)[8], const __m512 (*alpha)[4], int a0,
                    int j) {
  constexpr int P = 8 / Bits;
  const int rb = static_cast<int>(A.row_bytes);
  __m512 acc[NQ][4];
  for (int a = 0; a < NQ; ++a) {
    for (int v = 0; v < 4; ++v) acc[a][v] = _mm512_setzero_ps();
  }
  const int pieces = R == 1 ? A.pieces : 1;
  for (int k = 0; k < pieces; ++k) {
    for (int v = 0; v < 4; ++v) {
      __m512i x;
      if constexpr (R == 1) {
        if (j + v >= A.rows) continue;
        x = _mm512_maskz_loadu_epi8(BytesMask(rb - 64 * k),
                                    A.codes + static_cast<size_t>(j + v) * rb + 64 * k);
      } else {
        const int first = j + v * R;
        if (first >= A.rows) continue;
        x = _mm512_maskz_loadu_epi8(BytesMask((A.rows - first) * rb),
                                    A.codes + static_cast<size_t>(first) * rb);
      }
      __m512i sum[NQ];
      for (int a = 0; a < NQ; ++a) sum[a] = _mm512_setzero_si512();
      for (int s = 0; s < P; ++s) {
        const __m512i xs = Plane<Bits>(x, s);
        for (int a = 0; a < NQ; ++a) sum[a] = _mm512_dpbusd_epi32(sum[a], xs, q[a][k * P + s]);
      }
      for (int a = 0; a < NQ; ++a) {
        acc[a][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[a]), alpha[a][k], acc[a][v]);
      }
    }
  }
  __m512 u[4];
  for (int a = 0; a < 4; ++a) u[a] = a < NQ ? LaneSums(acc[a]) : _mm512_setzero_ps();
  alignas(64) float out[4][16];
  if constexpr (R == 1) {
    // u[a][4L + v]: row j + v; sum the lanes: z[4a + v].
    const __m512 z = PairLanes(PairLanes(u[0], u[1]), PairLanes(u[2], u[3]));
    __m512 qz = _mm512_setzero_ps();
    for (int a = 0; a < NQ; ++a) {
      qz = _mm512_mask_mov_ps(qz, static_cast<__mmask16>(0xf << (4 * a)),
                              _mm512_set1_ps(A.qz[a0 + a]));
    }
    _mm512_store_ps(out[0], _mm512_add_ps(z, qz));
    const int n = Min(4, A.rows - j);
    for (int a = 0; a < NQ; ++a) {
      float* s = A.s + static_cast<size_t>(a0 + a) * A.ss + j;
      for (int r = 0; r < n; ++r) s[r] = out[0][4 * a + r];
    }
  } else if constexpr (R == 2) {
    // Rows 2v (lanes 0, 1 of u[a]) and 2v + 1 (lanes 2, 3): w[8b + 4h + v] for queries (a, a + 1).
    const __m512i idx = _mm512_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15);
    const int n = Min(8, A.rows - j);
    for (int a = 0; a < NQ; a += 2) {
      const __m512 w = _mm512_permutexvar_ps(idx, PairLanes(u[a], u[a + 1]));
      const __m512 qz = _mm512_mask_mov_ps(_mm512_set1_ps(A.qz[a0 + a]), 0xff00,
                                           _mm512_set1_ps(a + 1 < NQ ? A.qz[a0 + a + 1] : 0));
      _mm512_store_ps(out[a], _mm512_add_ps(w, qz));
      for (int b = 0; b < 2 && a + b < NQ; ++b) {
        float* s = A.s + static_cast<size_t>(a0 + a + b) * A.ss + j;
        for (int r = 0; r < n; ++r) s[r] = out[a][8 * b + r];
      }
    }
  } else {
    // Row 4v + L of u[a] at lane 4L + v.
    const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const int n = Min(16, A.rows - j);
    for (int a = 0; a < NQ; ++a) {
      const __m512 f =
          _mm512_add_ps(_mm512_permutexvar_ps(idx, u[a]), _mm512_set1_ps(A.qz[a0 + a]));
      float* s = A.s + static_cast<size_t>(a0 + a) * A.ss + j;
      if (n == 16) {
        _mm512_storeu_ps(s, f);
      } else {
        _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << n) - 1), f);
      }
    }
  }
}

template <int Bits, int R, int NQ>
void KeyRows(const KeyArgs& A, int a0) {
  constexpr int P = 8 / Bits;
  const int pieces = R == 1 ? A.pieces : 1;
  const int rb = static_cast<int>(A.row_bytes);
  // The query's plane vectors and block scales, loaded once (R > 1: repeated for each row).
  __m512i q[NQ][8];
  __m512 alpha[NQ][4];
  const auto* planes = static_cast<const int8_t*>(A.planes);
  const size_t per_query =
      R == 1 ? static_cast<size_t>(pieces) * P * 64 : static_cast<size_t>(P) * rb;
  for (int a = 0; a < NQ; ++a) {
    const int8_t* qa = planes + static_cast<size_t>(a0 + a) * per_query;
    const float* al = A.alpha + static_cast<size_t>(a0 + a) * 64;
    for (int v = 0; v < pieces * P; ++v) {
      if constexpr (R == 1) {
        q[a][v] = _mm512_loadu_si512(qa + 64 * v);
      } else if constexpr (R == 2) {
        q[a][v] = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qa + 32 * v)));
      } else {
        q[a][v] =
            _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qa + 16 * v)));
      }
    }
    for (int k = 0; k < pieces; ++k) {  // lane l: the block of bytes 4l..4l+3 of its row
      if constexpr (R == 1) {
        alpha[a][k] = _mm512_loadu_ps(al + 16 * k);
      } else if constexpr (R == 2) {
        alpha[a][k] = _mm512_broadcast_f32x8(_mm256_loadu_ps(al));
      } else {
        alpha[a][k] = _mm512_broadcast_f32x4(_mm_loadu_ps(al));
      }
    }
  }
  constexpr int kStep = 4 * R;
  for (int j = 0; j < A.rows; j += kStep) KeyStep<Bits, R, NQ>(A, q, alpha, a0, j);
}

template <int Bits, int R>
void KeyQueries(const KeyArgs& A) {
  int a = 0;
  for (; a + 4 <= A.nq; a += 4) KeyRows<Bits, R, 4>(A, a);
  switch (A.nq - a) {
    case 3:
      return KeyRows<Bits, R, 3>(A, a);
    case 2:
      return KeyRows<Bits, R, 2>(A, a);
    case 1:
      return KeyRows<Bits, R, 1>(A, a);
    default:
      return;
  }
}

template <int Bits>
void KeyBits(const KeyArgs& A) {
  if (A.rows_per_vector == 4) return KeyQueries<Bits, 4>(A);
  if (A.rows_per_vector == 2) return KeyQueries<Bits, 2>(A);
  KeyQueries<Bits, 1>(A);
}

// ---- Values -----------------------------------------------------------------------------------
//
// Four rows at a time: the rows' bytes are interleaved (vpunpck) so that each 32-bit lane holds
// the four rows' codes of one channel, and vpdpbusd multiplies them by the four rows' weights of
// that channel's group. Rows of at most 32 bytes ("half" mode) put two steps of four rows in one
// vector (rows j..j+3 in the low 256 bits, j+4..j+7 in the high ones).

// The lanes of the vectors one step produces: vector (piece k, plane s, u) lane l = 4L + t holds
// byte 64k + 16L + 4u + t of its rows (half mode: byte 16 (L % 2) + 4u + t, L >= 2 for the second
// four rows), i.e. channel (that byte) * P + s.
// Most patterns whose permuted weights are computed once per block for all planes.
inline constexpr int kMaxSharedPatterns = 2;

struct ValueLanes {
  int vectors = 0;                      // pieces * P * 4
  alignas(64) int32_t group[16][16];    // group of each lane (0 where no channel)
  alignas(64) int32_t channel[16][16];  // channel of each lane (0 where none)
  __mmask16 valid[16];                  // lanes that hold a channel
  // Group patterns among the four vectors of (k, s): 1 (all share vector 0's), 2 (u = 0, 1 share
  // vector 0's and u = 2, 3 vector 2's: half mode with groups of 8 bytes), or 4 (each its own).
  int8_t patterns[16];
  // Per piece: its planes' vectors have the same group patterns (groups of a multiple of 8 / bits
  // channels), so the permuted weights serve them all.
  bool planes_share[4];
};

void MakeLanes(int bits, int rb, int n, int group, bool half, ValueLanes* L) {
  const int P = 8 / bits;
  const int pieces = half ? 1 : (rb + 63) / 64;
  L->vectors = pieces * P * 4;
  for (int k = 0; k < pieces; ++k) {
    for (int s = 0; s < P; ++s) {
      for (int u = 0; u < 4; ++u) {
        const int vi = (k * P + s) * 4 + u;
        L->valid[vi] = 0;
        for (int l = 0; l < 16; ++l) {
          const int lane128 = l / 4;
          const int b = (half ? 16 * (lane128 % 2) : 64 * k + 16 * lane128) + 4 * u + l % 4;
          const int c = b * P + s;
          const bool ok = b < rb && c < n;
          L->channel[vi][l] = ok ? c : 0;
          L->group[vi][l] = ok ? c / group : 0;
          if (ok) L->valid[vi] |= static_cast<__mmask16>(1u << l);
        }
      }
      const auto same = [&](int u0, int u1) {
        const int v0 = (k * P + s) * 4;
        for (int l = 0; l < 16; ++l) {
          if (L->group[v0 + u0][l] != L->group[v0 + u1][l]) return false;
        }
        return true;
      };
      const bool pairs = same(0, 1) && same(2, 3);
      L->patterns[k * P + s] = pairs && same(0, 2) ? 1 : pairs ? 2 : 4;
    }
    L->planes_share[k] = L->patterns[k * P] <= kMaxSharedPatterns;
    for (int s = 1; s < P; ++s) {
      for (int i = 0; i < 4; ++i) {
        for (int l = 0; l < 16; ++l) {
          L->planes_share[k] = L->planes_share[k] &&
                               L->group[(k * P + s) * 4 + i][l] == L->group[k * P * 4 + i][l];
        }
      }
    }
  }
}

// v[u] lane 4L + t = the bytes 16L + 4u + t of x0..x3 (one per row).
inline void Interleave4(__m512i x0, __m512i x1, __m512i x2, __m512i x3, __m512i* v) {
  const __m512i u0 = _mm512_unpacklo_epi8(x0, x1), u1 = _mm512_unpackhi_epi8(x0, x1);
  const __m512i u2 = _mm512_unpacklo_epi8(x2, x3), u3 = _mm512_unpackhi_epi8(x2, x3);
  v[0] = _mm512_unpacklo_epi16(u0, u2);
  v[1] = _mm512_unpackhi_epi16(u0, u2);
  v[2] = _mm512_unpacklo_epi16(u1, u3);
  v[3] = _mm512_unpackhi_epi16(u1, u3);
}

// A row's per-group floats (scale or zero, `ng` of them) in the lanes (a, g) = a * ng + g.
inline __m512 GroupLanes(const float* row, int ng, __m512i vg, __mmask16 group_mask) {
  switch (ng) {
    case 1:
      return _mm512_set1_ps(row[0]);
    case 2:
      return _mm512_castpd_ps(_mm512_set1_pd(*reinterpret_cast<const double*>(row)));
    case 4:
      return _mm512_broadcast_f32x4(_mm_loadu_ps(row));
    case 8:
      return _mm512_broadcast_f32x8(_mm256_loadu_ps(row));
    case 16:
      return _mm512_loadu_ps(row);
    default:
      return _mm512_permutexvar_ps(vg, _mm512_maskz_loadu_ps(group_mask, row));
  }
}

// Rows `row` (and, half mode, row + 4) of piece k; rows past the end read as zero.
template <bool Half>
inline __m512i LoadRowPiece(const ValueArgs& A, int row, int k) {
  const int rb = static_cast<int>(A.row_bytes);
  if constexpr (Half) {
    const __mmask32 bytes = static_cast<__mmask32>(BytesMask(rb));
    const __m256i lo = row < A.rows
                           ? _mm256_maskz_loadu_epi8(bytes, A.codes + static_cast<size_t>(row) * rb)
                           : _mm256_setzero_si256();
    const __m256i hi = row + 4 < A.rows ? _mm256_maskz_loadu_epi8(
                                              bytes, A.codes + static_cast<size_t>(row + 4) * rb)
                                        : _mm256_setzero_si256();
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  } else {
    if (row >= A.rows) return _mm512_setzero_si512();
    return _mm512_maskz_loadu_epi8(BytesMask(rb - 64 * k),
                                   A.codes + static_cast<size_t>(row) * rb + 64 * k);
  }
}

// The rows [b0, b0 + nb) of piece k interleaved (Interleave4), a step of four rows (half mode:
// eight) at a time, read once for all planes: a plane's bits are a bytewise mask, so taking it
// commutes with the interleaving.
template <bool Half>
inline void InterleaveBlock(const ValueArgs& A, int b0, int nb, int k, __m512i (*out)[4]) {
  constexpr int kStep = Half ? 8 : 4;
  for (int q = 0; q * kStep < nb; ++q) {
    const int row = b0 + kStep * q;
    Interleave4(LoadRowPiece<Half>(A, row, k), LoadRowPiece<Half>(A, row + 1, k),
                LoadRowPiece<Half>(A, row + 2, k), LoadRowPiece<Half>(A, row + 3, k), out[q]);
  }
}

// The weight lanes of each query (a, group of each lane; +16: the second four rows in half
// mode) for pattern t of vector v0's four (ValueLanes::patterns).
template <bool Half, int QB, int NU>
inline void WeightLanes(const ValueLanes& L, int ng, int v0, __m512i (*idx)[NU]) {
  for (int a = 0; a < QB; ++a) {
    for (int t = 0; t < NU; ++t) {
      __m512i g = _mm512_add_epi32(_mm512_load_si512(L.group[v0 + t * (4 / NU)]),
                                   _mm512_set1_epi32(a * ng));
      if constexpr (Half) g = _mm512_mask_add_epi32(g, 0xff00, g, _mm512_set1_epi32(16));
      idx[a][t] = g;
    }
  }
}

// Step q's weights permuted for query a, pattern t.
template <bool Half>
inline __m512i StepWeights(const int32_t (*w4)[16], int q, __m512i idx) {
  const int q4 = Half ? 2 * q : q;  // the first four rows' weights in w4
  const __m512i wq = _mm512_load_si512(w4[q4]);
  if constexpr (Half) {
    return _mm512_permutex2var_epi32(wq, idx, _mm512_load_si512(w4[q4 + 1]));
  } else {
    return _mm512_permutexvar_epi32(idx, wq);
  }
}

// The permuted weights of every step of a block (nb rows) for vector v0's patterns, when all
// the planes of its piece share them (ValueLanes::planes_share): pre[q][a][t].
template <bool Half, int QB, int NU>
inline void PermuteBlockWeights(const ValueLanes& L, int ng, int v0, int nb,
                                const int32_t (*w4)[16],
                                __m512i (*pre)[4][kMaxSharedPatterns]) {
  static_assert(NU <= kMaxSharedPatterns);
  constexpr int kStep = Half ? 8 : 4;
  __m512i idx[QB][NU];
  WeightLanes<Half, QB, NU>(L, ng, v0, idx);
  for (int q = 0; q * kStep < nb; ++q) {
    for (int a = 0; a < QB; ++a) {
      for (int t = 0; t < NU; ++t) pre[q][a][t] = StepWeights<Half>(w4, q, idx[a][t]);
    }
  }
}

// The integer sums of piece k, plane s over the rows [b0, b0 + nb) of a block, for queries
// a0 .. a0 + QB, scaled by beta into accf. NU: the group patterns among the four vectors
// (ValueLanes::patterns): each query's weights are permuted once per pattern, here (Pre false)
// or once for all planes (Pre: PermuteBlockWeights' pre).
template <int Bits, bool Half, int QB, int NU, bool Pre>
inline void BlockSums(const ValueArgs& A, const ValueLanes& L, const __m512i (*rows)[4], int nb,
                      int k, int s, const int32_t (*w4)[16],
                      const __m512i (*pre)[4][kMaxSharedPatterns], __m512 beta,
                      float (*accf)[16][16]) {
  constexpr int kStep = Half ? 8 : 4;  // rows per step
  constexpr int P = 8 / Bits;
  const int ng = A.groups;
  const int v0 = (k * P + s) * 4;
  __m512i idx[QB][NU];
  if constexpr (!Pre) WeightLanes<Half, QB, NU>(L, ng, v0, idx);
  __m512i iacc[QB][4];
  for (int a = 0; a < QB; ++a) {
    for (int u = 0; u < 4; ++u) iacc[a][u] = _mm512_setzero_si512();
  }
  for (int q = 0; q * kStep < nb; ++q) {
    __m512i v[4];
    for (int u = 0; u < 4; ++u) v[u] = Plane<Bits>(_mm512_load_si512(&rows[q][u]), s);
    for (int a = 0; a < QB; ++a) {
      __m512i wv[NU];
      for (int t = 0; t < NU; ++t) {
        if constexpr (Pre) {
          wv[t] = _mm512_load_si512(&pre[q][a][t]);
        } else {
          wv[t] = StepWeights<Half>(w4, q, idx[a][t]);
        }
      }
      for (int u = 0; u < 4; ++u) {
        iacc[a][u] = _mm512_dpbusd_epi32(iacc[a][u], wv[u / (4 / NU)], v[u]);
      }
    }
  }
  for (int a = 0; a < QB; ++a) {
    for (int u = 0; u < 4; ++u) {
      const __m512i gi =
          _mm512_add_epi32(_mm512_load_si512(L.group[v0 + u]), _mm512_set1_epi32(a * ng));
      const __m512 bv = _mm512_permutexvar_ps(gi, beta);
      __m512i sum = iacc[a][u];
      // Half mode: the two steps' sums of each channel add exactly before the scaling.
      if constexpr (Half) sum = _mm512_add_epi32(sum, _mm512_shuffle_i32x4(sum, sum, 0x4E));
      float* f = accf[a][v0 + u];
      _mm512_store_ps(f, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), bv, _mm512_load_ps(f)));
    }
  }
}

// Queries a0 .. a0 + QB (QB * groups <= 16 lanes (a, g) in the weight vectors). NG: the groups
// per row when a constant (4: 128 channels in groups of 32, the common shape), else 0.
template <int Bits, bool Half, int QB, int NG>
void ValueQueries(const ValueArgs& A, const ValueLanes& L, int a0) {
  constexpr int qb = QB;
  constexpr float kMid = static_cast<float>((1 << Bits) - 1) / 2.0f;
  constexpr int P = 8 / Bits;
  const int rb = static_cast<int>(A.row_bytes);
  const int ng = NG > 0 ? NG : A.groups;
  const int pieces = Half ? 1 : (rb + 63) / 64;
  const int lanes = qb * ng;
  const __mmask16 lane_mask = static_cast<__mmask16>((1u << lanes) - 1);
  const __mmask16 group_mask = static_cast<__mmask16>((1u << ng) - 1);
  // pv for row 4L + r of a 16-row transpose: lanes (a, g) <- u_r[4L + a].
  alignas(64) int32_t gidx[16], qidx[4][16];
  for (int l = 0; l < 16; ++l) {
    gidx[l] = l < lanes ? l % ng : 0;
    for (int L4 = 0; L4 < 4; ++L4) qidx[L4][l] = 4 * L4 + (l < lanes ? l / ng : 0);
  }
  const __m512i vg = _mm512_load_si512(gidx);
  alignas(64) float accf[4][16][16];
  for (int a = 0; a < qb; ++a) {
    for (int v = 0; v < L.vectors; ++v) _mm512_store_ps(accf[a][v], _mm512_setzero_ps());
  }
  __m512 zacc = _mm512_setzero_ps();
  alignas(64) float w[kValueBlock][16];
  alignas(64) int32_t w4[kValueBlock / 4 + 1][16];  // +1: half mode reads one step past a tail
  alignas(64) __m512i rows[kValueBlock / 4][4];      // a piece's rows, interleaved
  alignas(64) __m512i pre[kValueBlock / 4][4][kMaxSharedPatterns];  // weights for all planes
  for (int b0 = 0; b0 < A.rows; b0 += kValueBlock) {
    const int nb = Min(kValueBlock, A.rows - b0);
    // Weights w[j][(a, g)] = p * scale, their max per lane, and the zero term; p transposed 16
    // rows at a time.
    __m512 wmax = _mm512_setzero_ps(), wsum = _mm512_setzero_ps();
    for (int j0 = 0; j0 < nb; j0 += 16) {
      const __mmask16 rows16 =
          nb - j0 >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << (nb - j0)) - 1);
      __m512 pa[4];
      for (int a = 0; a < 4; ++a) {
        pa[a] = a < qb ? _mm512_maskz_loadu_ps(rows16,
                                               A.p + static_cast<size_t>(a0 + a) * A.ps + b0 + j0)
                       : _mm512_setzero_ps();
      }
      const __m512 t0 = _mm512_unpacklo_ps(pa[0], pa[1]), t1 = _mm512_unpackhi_ps(pa[0], pa[1]);
      const __m512 t2 = _mm512_unpacklo_ps(pa[2], pa[3]), t3 = _mm512_unpackhi_ps(pa[2], pa[3]);
      __m512 ur[4];  // ur[r] lane 4L + a = p[a][row 4L + r]
      ur[0] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
      ur[1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t2)));
      ur[2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
      ur[3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t1), _mm512_castps_pd(t3)));
      const int n16 = Min(16, nb - j0);
      for (int r = 0; r < n16; ++r) {
        const int j = j0 + r;
        const size_t g0 = static_cast<size_t>(b0 + j) * ng;
        // The block's code rows are read right after this loop: fetch them now (the hardware
        // prefetcher alone leaves the first plane's loads waiting on memory).
        const uint8_t* row_codes = A.codes + static_cast<size_t>(b0 + j) * A.row_bytes;
        for (size_t off = 0; off < A.row_bytes; off += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(row_codes + off), _MM_HINT_T0);
        }
        const __m512 pv = _mm512_permutexvar_ps(_mm512_load_si512(qidx[r / 4]), ur[r % 4]);
        const __m512 wj = _mm512_mul_ps(pv, GroupLanes(A.scale + g0, ng, vg, group_mask));
        _mm512_store_ps(w[j], wj);
        wmax = _mm512_max_ps(wmax, wj);
        wsum = _mm512_add_ps(wsum, wj);
        zacc = _mm512_fmadd_ps(pv, GroupLanes(A.zero + g0, ng, vg, group_mask), zacc);
      }
    }
    // beta = wmax / 255 and 255 / wmax where wmax >= 2^-100 (else the block's weights count 0).
    const __mmask16 live =
        _mm512_mask_cmp_ps_mask(lane_mask, wmax, _mm512_set1_ps(0x1p-100f), _CMP_GE_OQ);
    const __m512 beta = _mm512_maskz_div_ps(live, wmax, _mm512_set1_ps(255.0f));
    const __m512 inv = _mm512_maskz_div_ps(live, _mm512_set1_ps(255.0f), wmax);
    const int steps4 = (nb + 3) / 4;
    __m512i wisum = _mm512_setzero_si512();
    for (int q = 0; q < steps4; ++q) {
      __m512i packed = _mm512_setzero_si512();
      for (int r = 0; r < 4; ++r) {
        const int j = 4 * q + r;
        if (j >= nb) break;
        // w * inv <= 255 (1 + 2^-22): no upper clamp needed; the lower one maps NaN to 0.
        const __m512i wi = _mm512_cvtps_epi32(
            _mm512_max_ps(_mm512_mul_ps(_mm512_load_ps(w[j]), inv), _mm512_setzero_ps()));
        packed = _mm512_or_si512(packed, _mm512_slli_epi32(wi, 8 * r));
      }
      // The four bytes' sum per lane, exactly (the weights are unsigned, the ones signed).
      wisum = _mm512_dpbusd_epi32(wisum, packed, _mm512_set1_epi8(1));
      _mm512_store_si512(w4[q], packed);
    }
    _mm512_store_si512(w4[steps4], _mm512_setzero_si512());
    // Centring (attention_int.h): the weights' rounding errors times the mid code, exactly.
    zacc = _mm512_fmadd_ps(_mm512_set1_ps(kMid),
                           _mm512_fnmadd_ps(beta, _mm512_cvtepi32_ps(wisum), wsum), zacc);
    for (int k = 0; k < pieces; ++k) {
      InterleaveBlock<Half>(A, b0, nb, k, rows);
      // Two planes (4-bit codes) gain nothing from the shared weights (measured): the stores and
      // loads cost what the permutes they save do.
      const int shared = P >= 4 && L.planes_share[k] ? L.patterns[k * P] : 0;
      if (shared == 1) PermuteBlockWeights<Half, QB, 1>(L, ng, k * P * 4, nb, w4, pre);
      if (shared == 2) PermuteBlockWeights<Half, QB, 2>(L, ng, k * P * 4, nb, w4, pre);
      for (int s = 0; s < P; ++s) {
        switch (shared > 0 ? 0 : L.patterns[k * P + s]) {
          case 0:  // the planes share the block's permuted weights
            if (shared == 1) {
              BlockSums<Bits, Half, QB, 1, true>(A, L, rows, nb, k, s, w4, pre, beta, accf);
            } else {
              BlockSums<Bits, Half, QB, 2, true>(A, L, rows, nb, k, s, w4, pre, beta, accf);
            }
            break;
          case 1:
            BlockSums<Bits, Half, QB, 1, false>(A, L, rows, nb, k, s, w4, pre, beta, accf);
            break;
          case 2:
            BlockSums<Bits, Half, QB, 2, false>(A, L, rows, nb, k, s, w4, pre, beta, accf);
            break;
          default:
            BlockSums<Bits, Half, QB, 4, false>(A, L, rows, nb, k, s, w4, pre, beta, accf);
            break;
        }
      }
    }
  }
  // Back to channel order, then the zero terms.
  alignas(64) float z[16];
  _mm512_store_ps(z, zacc);
  alignas(64) float sum[256 + 16];
  for (int a = 0; a < qb; ++a) {
    for (int c = 0; c < A.n; c += 16) _mm512_store_ps(sum + c, _mm512_setzero_ps());
    for (int v = 0; v < L.vectors; ++v) {
      // Half mode: both halves hold the same total; the low one is scattered.
      const __mmask16 valid = Half ? L.valid[v] & 0x00ff : L.valid[v];
      _mm512_mask_i32scatter_ps(sum, valid, _mm512_load_si512(L.channel[v]),
                                _mm512_load_ps(accf[a][v]), 4);
    }
    float* acc = A.acc + static_cast<size_t>(a0 + a) * A.n;
    for (int g = 0; g < ng; ++g) {  // channel by channel, without a division each
      const float zg = z[a * ng + g];
      for (int c = g * A.group; c < Min(A.n, (g + 1) * A.group); ++c) {
        acc[c] += sum[c];
        acc[c] += zg;
      }
    }
  }
}

template <int Bits, bool Half>
void ValueBits(const ValueArgs& A, const ValueLanes& lanes) {
  const int qb = Min(4, 16 / A.groups);
  for (int a0 = 0; a0 < A.nq; a0 += qb) {
    switch (Min(qb, A.nq - a0)) {
      case 4:
        if (A.groups == 4) {
          ValueQueries<Bits, Half, 4, 4>(A, lanes, a0);
        } else {
          ValueQueries<Bits, Half, 4, 0>(A, lanes, a0);
        }
        break;
      case 3:
        ValueQueries<Bits, Half, 3, 0>(A, lanes, a0);
        break;
      case 2:
        ValueQueries<Bits, Half, 2, 0>(A, lanes, a0);
        break;
      default:
        ValueQueries<Bits, Half, 1, 0>(A, lanes, a0);
        break;
    }
  }
}

}  // namespace

void ScoreKeysVnni(const KeyChunkArgs& C) {
  const int rb = static_cast<int>(C.row_bytes);
  const int R = rb == 16 ? 4 : rb == 32 ? 2 : 1;
  const int pieces = R > 1 ? 1 : (rb + 63) / 64;
  // Bytes past a row's end multiply zero codes (masked loads), so the layout needs no clearing;
  // it starts zeroed only so that nothing uninitialized is ever read.
  alignas(64) int8_t planes[4 * 256] = {};  // <= 256 bytes per query
  alignas(64) float alpha[4 * 64] = {};     // per query, <= 64 blocks (zero past the last)
  float qz[4];
  ForEachKeyBlock(C, planes, alpha, qz, [&](KeyQueryArgs& q, KeyArgs& k) {
    q.rows_per_vector = R;
    k.rows_per_vector = R;
    k.pieces = pieces;
    if (C.bits == 4) {
      PrepareKeysChunks<2>(q);
      KeyBits<4>(k);
    } else if (C.bits == 2) {
      PrepareKeysChunks<4>(q);
      KeyBits<2>(k);
    } else {
      PrepareKeysChunks<1>(q);
      KeyBits<8>(k);
    }
  });
}

void AccumulateValuesVnni(const ValueArgs& A) {
  const bool half = A.row_bytes <= 32;
  // The lane maps depend on the shape only: kept per thread for the next call (most calls of a
  // decode step share one shape).
  static thread_local ValueLanes lanes;
  static thread_local int shape[5] = {-1, -1, -1, -1, -1};
  const int now[5] = {A.bits, static_cast<int>(A.row_bytes), A.n, A.group, half ? 1 : 0};
  if (__builtin_memcmp(shape, now, sizeof(now)) != 0) {
    MakeLanes(A.bits, static_cast<int>(A.row_bytes), A.n, A.group, half, &lanes);
    __builtin_memcpy(shape, now, sizeof(now));
  }
  if (A.bits == 4) {
    half ? ValueBits<4, true>(A, lanes) : ValueBits<4, false>(A, lanes);
  } else {
    half ? ValueBits<2, true>(A, lanes) : ValueBits<2, false>(A, lanes);
  }
}

}  // namespace kvc::cpu::attn::isa

#else  // the compiler could not target AVX-512 VNNI: never called (attention_int.cc checks)

namespace kvc::cpu::attn::isa {
void ScoreKeysVnni(const KeyChunkArgs&) {}
void AccumulateValuesVnni(const ValueArgs&) {}
}  // namespace kvc::cpu::attn::isa

#endif

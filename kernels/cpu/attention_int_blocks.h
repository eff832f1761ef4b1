// What the two vector kernels of attention_int.h (attention_int_avx2.cc, attention_int_avx512.cc)
// share: the argument blocks of their key kernels and the walk over token groups and blocks of
// four queries that feeds them. Only those two files include it.
//
// Everything here is in an unnamed namespace on purpose: each of the two files is compiled for
// its own instruction set, so each must get its own internal copy. An inline function with
// external linkage built with -mavx512f in one file could be the copy the linker keeps for the
// AVX2 file's callers too.
#ifndef KVC_KERNELS_CPU_ATTENTION_INT_BLOCKS_H_
#define KVC_KERNELS_CPU_ATTENTION_INT_BLOCKS_H_

#include <immintrin.h>

#include <cstddef>
#include <cstdint>

#include "cpu/attention_int.h"

namespace kvc::cpu::attn::isa {
namespace {  // NOLINT(build/namespaces): one internal copy per instruction set (above)

inline int Min(int a, int b) { return a < b ? a : b; }

// The queries of one token group and up to four queries: the preparation's inputs and outputs.
struct KeyQueryArgs {
  const float* qm = nullptr;     // [nq, n]
  const float* scale = nullptr;  // [n]
  const float* zero = nullptr;   // [n]
  int nq = 0, n = 0, bits = 0;
  size_t row_bytes = 0;
  int rows_per_vector = 1;  // AVX-512: code rows one vector holds (short rows)
  float* alpha = nullptr;   // [nq, 64]: per block of 32 / bits channels (4 code bytes)
  float* qz = nullptr;      // [nq]
  void* planes = nullptr;   // the kernels' query layout
};

// Rows of one token group against its prepared queries.
struct KeyArgs {
  const uint8_t* codes = nullptr;  // row j at codes + j * row_bytes
  size_t row_bytes = 0;
  int rows = 0, bits = 0, nq = 0;
  const void* planes = nullptr;
  int rows_per_vector = 1, pieces = 1;  // AVX-512: rows a vector holds, vectors a row takes
  const float* alpha = nullptr;         // [nq, 64]
  const float* qz = nullptr;
  float* s = nullptr;  // s[a * ss + j]
  int ss = 0;
};

// The next token group's scale, zero and code rows (from row r1 on), fetched while this group is
// scored: the hardware prefetcher alone leaves the first loads of each group waiting on memory.
inline void PrefetchGroup(const KeyChunkArgs& C, int64_t next, int r1) {
  if (next >= C.j1) return;
  const size_t gi = static_cast<size_t>(next / C.group);
  for (int c = 0; c < C.n; c += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(C.scale + gi * C.n + c), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(C.zero + gi * C.n + c), _MM_HINT_T0);
  }
  const int64_t end = next + C.group < C.j1 ? next + C.group : C.j1;
  const uint8_t* first = C.codes + static_cast<size_t>(r1) * C.row_bytes;
  const size_t bytes = static_cast<size_t>(end - r1) * C.row_bytes;
  for (size_t off = 0; off < bytes && off < 8192; off += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(first + off), _MM_HINT_T0);
  }
}

// For rows [C.j0, C.j1): each token group (its rows within the range, its scale and zero) and
// each block of up to four queries, calls score(q, k) with both blocks filled as far as the
// kernels share them (the caller adds its own fields), the queries' layout in `planes`, `alpha`
// and `qz` (prepared by the caller's kernel, then read by its row kernel).
template <class Score>
inline void ForEachKeyBlock(const KeyChunkArgs& C, void* planes, float* alpha, float* qz,
                            Score&& score) {
  const int rb = static_cast<int>(C.row_bytes);
  const int64_t G = C.group;
  for (int64_t g0 = C.j0 / G * G; g0 < C.j1; g0 += G) {
    const int r0 = static_cast<int>(g0 > C.j0 ? g0 : C.j0);
    const int r1 = static_cast<int>(g0 + G < C.j1 ? g0 + G : C.j1);
    const size_t gi = static_cast<size_t>(g0 / G);
    PrefetchGroup(C, g0 + G, r1);
    for (int a0 = 0; a0 < C.nq; a0 += 4) {
      KeyQueryArgs q;
      q.qm = C.qm + static_cast<size_t>(a0) * C.n;
      q.scale = C.scale + gi * C.n;
      q.zero = C.zero + gi * C.n;
      q.nq = Min(4, C.nq - a0);
      q.n = C.n;
      q.bits = C.bits;
      q.row_bytes = C.row_bytes;
      q.alpha = alpha;
      q.qz = qz;
      q.planes = planes;
      KeyArgs k;
      k.codes = C.codes + static_cast<size_t>(r0) * rb;
      k.row_bytes = C.row_bytes;
      k.rows = r1 - r0;
      k.bits = C.bits;
      k.nq = q.nq;
      k.planes = planes;
      k.alpha = alpha;
      k.qz = qz;
      k.s = C.s + static_cast<size_t>(a0) * C.ss + (r0 - C.j0);
      k.ss = C.ss;
      score(q, k);
    }
  }
}

}  // namespace
}  // namespace kvc::cpu::attn::isa

#endif  // KVC_KERNELS_CPU_ATTENTION_INT_BLOCKS_H_

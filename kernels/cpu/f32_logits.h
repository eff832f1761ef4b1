// Attention logits from fp32 multiply-adds (CpuIsa::kAvx2 and up): the scoring GEMM of h2o,
// snapkv, keyformer and kvzip for fp16 and fp32 layers (and bf16 layers on CPUs without AVX-512
// BF16), logits[r][j] = scale * q_r . k_j, where OpenBLAS sgemm ran before.
//
// The products are fp32 products of the exact fp32 values of the keys and queries, summed in fp32
// over the channels in order and scaled once at the end: the logits are sgemm's up to the order
// of fp32 additions (tests/kernels/f32_logits_test.cc holds them to a double reference within
// the fp32 summation bound, and scoring_test the kept sets to sgemm's up to ties at that rounding).
// What it saves over sgemm on this shape (up to a few hundred query rows against 1,024 keys,
// an inner dimension of head_dim <= 256): sgemm's fp32 copy of every key and its own packing of
// that copy become one pass that converts and transposes the cache's rows, and the product runs
// in a register tile fitted to the short inner dimension. On an AMD EPYC (Zen 4) OpenBLAS ran
// the 128 x 1024 x 128 chunks with their fp32 copies at 0.84x of its 2048^2 speed, this path at
// 0.92x (engine_bench BM_ChunkLogits); with AVX2's 16 registers the two are level (0.84-0.86x);
// whole scoring gains 5-10 points of sgemm's speed with AVX-512, 1-6 with AVX2
// (docs/performance.md, "Keyformer scoring against sgemm").
//
// Layouts, for the active level's tile width T (KeyTile(): 16 with AVX-512, 8 with AVX2) and
// row block R (RowBlock(): 12 with AVX-512, 6 with AVX2): keys [RoundUp(n, 32) / T tiles]
// [head_dim][T keys] fp32, each channel of a tile's keys one load (padding keys zero); queries
// in blocks of R rows, each [head_dim][its rows] fp32, unscaled (the values one channel's step
// broadcasts are adjacent). head_dim must be a multiple of 16 (Usable says so). Packing and
// Logits must run at the same level (the tests' caps change it only between calls).
#ifndef KVC_KERNELS_CPU_F32_LOGITS_H_
#define KVC_KERNELS_CPU_F32_LOGITS_H_

#include <cstddef>
#include <cstdint>

#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"

namespace kvc::cpu::f32 {

// Whether f32_logits_avx2.cc was compiled with AVX2 (on x86-64 it is; its entry points take the
// AVX-512 kernels of f32_logits.cc from that level up where those were built); without it its
// functions abort, so Usable() must be checked first.
bool Built();

// True when this path runs now for this head_dim (the active level is kAvx2 or above).
inline bool Usable(int head_dim) {
  return head_dim > 0 && head_dim % 16 == 0 && CpuIsaAtLeast(CpuIsa::kAvx2) && Built();
}

// The active level's key tile width and query row block (see the layouts above).
int KeyTile();
int RowBlock();

// fp32 elements the packed layout holds for n keys (at most the AMX path's hi and lo bf16 parts,
// whose scratch it uses: kvc/cost.h counts one of them).
inline size_t PackedKeyElems(int n, int head_dim) {
  return (static_cast<size_t>(n) + 31) / 32 * 32 * static_cast<size_t>(head_dim);
}

// Keys straight from the cache: n rows of head_dim elements of type t, row i at
// src + i * row_stride elements -> out (PackedKeyElems(n, head_dim) floats).
void PackKeys(const void* src, DType t, size_t row_stride, int n, int head_dim, float* out);
// q: [rows][head_dim] fp32 -> out (rows * head_dim floats), the rows in blocks of RowBlock()
// (the last one of what is left), each block [head_dim][its rows].
void PackQueries(const float* q, int rows, int head_dim, float* out);
// dst[r * ldc + j] = scale * sum_d q_r[d] * key_j[d], r < rows, j < n, with the queries as
// PackQueries and the keys as PackKeys wrote them (nothing else written).
void Logits(const float* q, int rows, const float* k, int n, int head_dim, float scale, float* dst,
            size_t ldc);

namespace internal {  // the two levels' kernels (f32_logits.cc: AVX-512, f32_logits_avx2.cc)
// Their tile widths and row blocks (KeyTile() and RowBlock() at each level).
inline constexpr int kAvx512Tile = 16, kAvx512RowBlock = 12;
inline constexpr int kAvx2Tile = 8, kAvx2RowBlock = 6;
// Fetches rows [first, min(first + count, n)) of `row_bytes` bytes each, row i at
// base + i * stride bytes: PackKeys asks for the next tile's keys while it transposes the current
// ones, whose loads otherwise waited on memory (60% of the AVX-512 packer's time on a Zen 4, keys
// contiguous in an HND layer; an NHD cache puts a stride between them). The int8 packer, which
// does more work per row, measured slower with the same prefetches.
void PrefetchRows(const uint8_t* base, int first, int count, int n, size_t stride,
                  size_t row_bytes);
bool Avx512Built();
void PackKeysAvx512(const void* src, DType t, size_t row_stride, int n, int head_dim, float* out);
void LogitsAvx512(const float* q, int rows, const float* k, int n, int head_dim, float scale,
                  float* dst, size_t ldc);
}  // namespace internal

}  // namespace kvc::cpu::f32

#endif  // KVC_KERNELS_CPU_F32_LOGITS_H_

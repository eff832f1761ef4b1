// Attention logits from fp32 multiply-adds on AVX-512 (CpuIsa::kAvx512 and up): the scoring GEMM
// of h2o, snapkv, keyformer and kvzip for fp16 and fp32 layers (and bf16 layers on CPUs without
// AVX-512 BF16), logits[r][j] = scale * q_r . k_j, where OpenBLAS sgemm ran before.
//
// The products are fp32 products of the exact fp32 values of the keys and queries, summed in fp32
// over the channels in order and scaled once at the end: the logits are sgemm's up to the order
// of fp32 additions (tests/kernels/f32_logits_test.cc holds them to a double reference within
// the fp32 summation bound, and scoring_test the kept sets to sgemm's up to ties at that rounding).
// What it saves over sgemm on this shape (up to a few hundred query rows against 1,024 keys,
// an inner dimension of head_dim <= 256): sgemm's fp32 copy of every key and its own packing of
// that copy become one pass that converts and transposes the cache's rows (fetching the next
// rows ahead), and the product runs in a register tile fitted to the short inner dimension.
// OpenBLAS ran 128 x 1024 x 128 products at 0.75x of its 2048^2 speed on an AMD EPYC (Zen 4);
// this kernel runs them at 1.0-1.1x (docs/performance.md, "Keyformer scoring against sgemm").
//
// Layouts: queries in blocks of 12 rows, each [head_dim][12] fp32, unscaled (the 12 values one
// channel's step broadcasts are adjacent); keys [RoundUp(n, 32) / 16 tiles][head_dim][16 keys]
// fp32: each channel of 16 keys is one 64-byte load (padding keys zero). head_dim must be a
// multiple of 16 (Usable says so).
#ifndef KVC_KERNELS_CPU_F32_LOGITS_H_
#define KVC_KERNELS_CPU_F32_LOGITS_H_

#include <cstddef>
#include <cstdint>

#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"

namespace kvc::cpu::f32 {

// Whether f32_logits.cc was compiled with AVX-512F (on x86-64 it is); without it its functions
// abort, so Usable() must be checked first.
bool Built();

// True when this path runs now for this head_dim (the active level is kAvx512 or above).
inline bool Usable(int head_dim) {
  return head_dim > 0 && head_dim % 16 == 0 && CpuIsaAtLeast(CpuIsa::kAvx512) && Built();
}

// fp32 elements the packed layout holds for n keys (at most the AMX path's hi and lo bf16 parts,
// whose scratch it uses: kvc/cost.h counts one of them).
inline size_t PackedKeyElems(int n, int head_dim) {
  return (static_cast<size_t>(n) + 31) / 32 * 32 * static_cast<size_t>(head_dim);
}

// Keys straight from the cache: n rows of head_dim elements of type t, row i at
// src + i * row_stride elements -> out (PackedKeyElems(n, head_dim) floats).
void PackKeys(const void* src, DType t, size_t row_stride, int n, int head_dim, float* out);
// q: [rows][head_dim] fp32 -> out (rows * head_dim floats), the rows in blocks of 12 (the last
// one of rows % 12 when that is not 0), each block [head_dim][its rows].
void PackQueries(const float* q, int rows, int head_dim, float* out);
// dst[r * ldc + j] = scale * sum_d q_r[d] * key_j[d], r < rows, j < n, with the queries as
// PackQueries and the keys as PackKeys wrote them (nothing else written).
void Logits(const float* q, int rows, const float* k, int n, int head_dim, float scale, float* dst,
            size_t ldc);

}  // namespace kvc::cpu::f32

#endif  // KVC_KERNELS_CPU_F32_LOGITS_H_

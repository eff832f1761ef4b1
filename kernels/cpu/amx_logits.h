// Attention logits on AMX tiles (CpuIsa::kAmx): the scoring GEMM of h2o, snapkv and keyformer,
// logits[r][j] = scale * q_r . k_j, in near-fp32 precision from bf16 tile products.
//
// AMX multiplies bf16 pairs and accumulates in fp32. One bf16 keeps 8 significant bits, so each
// operand is split into two bf16 parts, x = hi + lo with hi = bf16(x) and lo = bf16(x - hi), and
// the product is q_hi.k_hi + q_lo.k_hi + q_hi.k_lo (q_lo.k_lo, below 2^-16 of the product, is
// dropped). An fp16 or bf16 key is exactly hi + lo (bf16 keys have lo = 0 and skip that product);
// a query (fp32 after conversion, pre-multiplied by `scale`) keeps 16 of its 24 bits. A logit
// therefore differs from an fp32 GEMM's by at most ~2^-16 of sum_d |q_d k_d| (measured in
// tests/kernels/amx_logits_test.cc against a double reference); kept sets differ only between
// tokens whose scores tie to that precision.
//
// Operands are packed once per row block (queries) and once per key chunk (keys); the tile
// loops then read them straight from these layouts:
//   queries  [RoundUp(rows, 32)][head_dim] bf16, row-major, padding rows zero (hi and lo parts);
//   keys     [RoundUp(n, 32) / 16 key tiles][head_dim / 32 blocks][16 pairs][16 keys][2] bf16,
//            the tiles' pair-interleaved ("VNNI") layout, padding keys zero (hi and lo parts).
// head_dim must be a multiple of 32 (Usable says so). Each call configures the calling thread's
// tiles and releases them before returning.
//
// Without tiles (CpuIsa::kAvx512Bf16: Zen 4, Cooper Lake), DotLogits computes the same logits
// from the packed keys' hi part with AVX-512 BF16 dot products (vdpbf16ps: two bf16 products
// summed into each fp32 lane), one product per element pair instead of three. scoring.cc takes it
// for bf16 layers only, where queries and keys are exact in one bf16 part: a product of two bf16
// values is exact in fp32, so the logits are an fp32 sum of the exact products, as sgemm's,
// differing only in the order of the additions (and denormal inputs, flushed to zero). Twice the
// multiply-adds per instruction of fp32 FMA. fp16 and fp32 layers keep sgemm: one bf16 part
// would round their values (a relative 2^-9 per element).
// PackKeys, PackQueries and DotLogits need AVX-512 BF16 only; Logits needs AMX.
#ifndef KVC_KERNELS_CPU_AMX_LOGITS_H_
#define KVC_KERNELS_CPU_AMX_LOGITS_H_

#include <cstddef>
#include <cstdint>

#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"

namespace kvc::cpu::amx {

// Whether amx_logits.cc was compiled with the AMX instructions (it is on x86-64 with GCC and
// clang); without them its functions abort, so a CPU with AMX must not reach them.
bool Built();

// (Inline: amx_logits.cc is compiled for AMX and AVX-512 BF16 and must only run on a CPU that
// has what the function needs.)
// True when the AMX path runs now (the active level is kAmx) for this head_dim, in this build.
inline bool Usable(int head_dim) {
  return head_dim > 0 && head_dim % 32 == 0 && CpuIsaAtLeast(CpuIsa::kAmx) && Built();
}

// True when DotLogits runs now for this head_dim (the active level is kAvx512Bf16 or above).
inline bool DotUsable(int head_dim) {
  return head_dim > 0 && head_dim % 32 == 0 && CpuIsaAtLeast(CpuIsa::kAvx512Bf16) && Built();
}

// bf16 elements of one part (hi or lo) of packed queries / keys.
inline size_t PackedQueryElems(int rows, int head_dim) {
  return (static_cast<size_t>(rows) + 31) / 32 * 32 * static_cast<size_t>(head_dim);
}
inline size_t PackedKeyElems(int n, int head_dim) {
  return (static_cast<size_t>(n) + 31) / 32 * 32 * static_cast<size_t>(head_dim);
}

// q: [rows][head_dim] fp32; writes scale * q split into hi and lo.
void PackQueries(const float* q, int rows, int head_dim, float scale, uint16_t* hi, uint16_t* lo);
// Keys straight from the cache: n rows of head_dim elements of type t, row i at
// src + i * row_stride elements (HND: head_dim, NHD: num_kv_heads * head_dim). lo may be null
// when every key is a bf16 value (its lo part is zero).
void PackKeys(const void* src, DType t, size_t row_stride, int n, int head_dim, uint16_t* hi,
              uint16_t* lo);
// dst[r * ldc + j] = logit of query row r and key j, r < rows, j < n (nothing else written).
// k_lo null: keys packed without a lo part.
void Logits(const uint16_t* q_hi, const uint16_t* q_lo, int rows, const uint16_t* k_hi,
            const uint16_t* k_lo, int n, int head_dim, float* dst, size_t ldc);

// dst[r * ldc + j] = scale * sum_d q[r * head_dim + d] * key_j[d], r < rows, j < n, with q
// [rows][head_dim] bf16 row-major (unscaled; e.g. the hi part PackQueries writes with scale 1)
// and k the hi part PackKeys wrote for n keys (nothing else written).
void DotLogits(const uint16_t* q, int rows, const uint16_t* k, int n, int head_dim, float scale,
               float* dst, size_t ldc);

}  // namespace kvc::cpu::amx

#endif  // KVC_KERNELS_CPU_AMX_LOGITS_H_

// Attention logits from int8 dot products (ScoringMath::kInteger, CpuIsa::kAvx512Vnni and up):
// logits[r][j] ~= scale * q_r . k_j with both operands rounded to 8 bits, for a compressing
// upload that would rather score twice as fast than exactly.
//
// Each key is quantized on its own, symmetric: s_j = max_d |k_jd| / 127, c_jd = round(k_jd / s_j)
// in [-127, 127]; each query row the same way, s_r = max_d |q_rd| / 127, stored unsigned as
// round(q_rd / s_r) + 128 in [1, 255] because `vpdpbusd` multiplies unsigned by signed bytes
// (four products summed into each int32 lane, 64 multiply-adds an instruction against 32 for
// AVX-512 BF16). The sum then holds sum_d c_rd c_jd + 128 sum_d c_jd; the second term is
// precomputed per key (the keys' `offsets`) and subtracted, and the scales are applied after the
// integer sum: logit = scale * s_r * s_j * (sum - offset_j). No lane overflows:
// 255 * 127 * 256 < 2^31 for head_dim <= 256.
//
// Error: each operand is off by at most half a step (s / 2) per element, so a logit is off by
// at most scale * (sum_d |q_d| s_j + |k_d| s_r) / 2 + the product of the two errors; the test
// (tests/kernels/int8_logits_test.cc) holds it against a double reference, and the kept sets of
// real-model heads differ from the exact ones only near ties (docs/performance.md).
//
// Layouts: queries [rows][head_dim] uint8 row-major with their scales [rows] (times `scale`);
// keys [RoundUp(n, 32) / 16 groups][head_dim / 4][16 keys][4] int8, so that one 64-byte load
// holds four consecutive channels of 16 keys, with per-key scales and offsets [RoundUp(n, 32)]
// (padding keys zero; the kernel reads two groups at a time). head_dim must be a multiple of 16
// in [16, 256] (Usable says so).
#ifndef KVC_KERNELS_CPU_INT8_LOGITS_H_
#define KVC_KERNELS_CPU_INT8_LOGITS_H_

#include <cstddef>
#include <cstdint>

#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"

namespace kvc::cpu::i8 {

// Whether int8_logits.cc was compiled with AVX-512 VNNI (on x86-64 it is); without it its
// functions abort, so Usable() must be checked first.
bool Built();

// True when the int8 path can run now for this head_dim (the active level is kAvx512Vnni or
// above, kvc/cpu_isa.h).
inline bool Usable(int head_dim) {
  return head_dim >= 16 && head_dim <= 256 && head_dim % 16 == 0 &&
         CpuIsaAtLeast(CpuIsa::kAvx512Vnni) && Built();
}

// Keys (and their scales / offsets) the packed layout holds for n keys.
inline size_t PaddedKeys(int n) { return (static_cast<size_t>(n) + 31) / 32 * 32; }

// q: [rows][head_dim] fp32 -> codes [rows][head_dim] and scales[r] = scale * s_r.
void PackQueries(const float* q, int rows, int head_dim, float scale, uint8_t* codes,
                 float* scales);
// Keys straight from the cache: n rows of head_dim elements of type t, row i at
// src + i * row_stride elements -> codes (PaddedKeys(n) * head_dim bytes), scales and
// offsets (PaddedKeys(n) each).
void PackKeys(const void* src, DType t, size_t row_stride, int n, int head_dim, int8_t* codes,
              float* scales, int32_t* offsets);
// dst[r * ldc + j] = logit of query row r and key j, r < rows, j < n (nothing else written).
void Logits(const uint8_t* q_codes, const float* q_scales, int rows, const int8_t* k_codes,
            const float* k_scales, const int32_t* k_offsets, int n, int head_dim, float* dst,
            size_t ldc);

}  // namespace kvc::cpu::i8

#endif  // KVC_KERNELS_CPU_INT8_LOGITS_H_

// Attention logits from int8 dot products (ScoringMath::kInteger, CpuIsa::kAvx2 and up):
// logits[r][j] ~= scale * q_r . k_j with both operands rounded to integers, for a compressing
// upload that would rather score faster than exactly. Two kernels, picked at run time:
//
// - AVX-512 VNNI (level kAvx512Vnni and up; int8_logits.cc): `vpdpbusd` multiplies unsigned by
//   signed bytes, four products summed into each int32 lane, 64 multiply-adds an instruction
//   against 32 for AVX-512 BF16. Queries are rounded to 8 bits (QueryCodeMax() 127).
// - AVX2 (levels kAvx2 and kAvx512; int8_logits_avx2.cc): `vpmaddubsw` sums two u8 x s8 products
//   into a saturating int16 lane and `vpmaddwd` against ones sums two of those into int32, 32
//   multiply-adds for two multiplies where fp32 FMA needs four. No lane may saturate, so queries
//   are rounded to 7 bits (QueryCodeMax() 63): two products of at most 127 * 127 fit in int16.
//   Queries rather than keys: a query row's rounding error spreads over the keys and averages
//   over the observation window's rows, where a key's would move its logit in every row alike.
//
// Each key is quantized on its own, symmetric: s_j = max_d |k_jd| / 127, c_jd = round(k_jd / s_j)
// in [-127, 127]; each query row the same way with QueryCodeMax() M: s_r = max_d |q_rd| / M,
// stored unsigned as round(q_rd / s_r) + QueryBias() (B = M + 1, so the codes lie in [1, 2M + 1]).
// The integer sum then holds sum_d c_rd c_jd + B sum_d c_jd; the second term is precomputed per
// key (the keys' `offsets`) and subtracted, and the scales are applied after the integer sum:
// logit = scale * s_r * s_j * (sum - offset_j). No int32 lane overflows: 255 * 127 * 256 < 2^31
// for head_dim <= 256.
//
// Error: each operand is off by at most half a step (s / 2) per element, so a logit is off by
// at most scale * (sum_d |q_d| s_j + |k_d| s_r) / 2 + the product of the two errors (the AVX2
// kernel's query step is twice VNNI's, and so is its share of the bound); the test
// (tests/kernels/int8_logits_test.cc) holds it against a double reference at both levels, and the
// kept sets of real-model heads differ from the exact ones only near ties (docs/performance.md).
//
// Layouts: queries [rows][head_dim] uint8 row-major with their scales [rows] (times `scale`);
// keys in groups of KeyGroup() keys (16 for VNNI, 8 for AVX2), [RoundUp(n, 32) / KeyGroup()
// groups][head_dim / 4][KeyGroup() keys][4] int8, so that one vector load holds four consecutive
// channels of a group's keys, with per-key scales and offsets [RoundUp(n, 32)] (padding keys zero;
// the kernels read 32 or 16 keys at a time). head_dim must be a multiple of 16 in [16, 256]
// (Usable says so). Pack and multiply with the same Kernel: their layouts differ.
#ifndef KVC_KERNELS_CPU_INT8_LOGITS_H_
#define KVC_KERNELS_CPU_INT8_LOGITS_H_

#include <cstddef>
#include <cstdint>

#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"

namespace kvc::cpu::i8 {

// Whether int8_logits_avx2.cc was compiled with AVX2 (on x86-64 it is); without it its functions
// abort, so Usable() must be checked first.
bool Built();

namespace internal {
// Whether int8_logits.cc was compiled with AVX-512 VNNI (on x86-64 it is).
bool VnniBuilt();
// The VNNI kernels (int8_logits.cc); the entry points below call them from level kAvx512Vnni.
void PackQueriesVnni(const float* q, int rows, int head_dim, float scale, uint8_t* codes,
                     float* scales);
void PackKeysVnni(const void* src, DType t, size_t row_stride, int n, int head_dim, int8_t* codes,
                  float* scales, int32_t* offsets);
void LogitsVnni(const uint8_t* q_codes, const float* q_scales, int rows, const int8_t* k_codes,
                const float* k_scales, const int32_t* k_offsets, int n, int head_dim, float* dst,
                size_t ldc);
}  // namespace internal

// True when the int8 path can run now for this head_dim (the active level is kAvx2 or above,
// kvc/cpu_isa.h).
inline bool Usable(int head_dim) {
  return head_dim >= 16 && head_dim <= 256 && head_dim % 16 == 0 &&
         CpuIsaAtLeast(CpuIsa::kAvx2) && Built();
}

// The two kernels. A caller picks one with ActiveKernel() and passes it to each call, so that
// packing and multiplying agree even if the level's cap changes in between.
enum class Kernel { kAvx2, kVnni };
inline Kernel ActiveKernel() {
  return CpuIsaAtLeast(CpuIsa::kAvx512Vnni) && internal::VnniBuilt() ? Kernel::kVnni
                                                                      : Kernel::kAvx2;
}
inline const char* KernelName(Kernel k) { return k == Kernel::kVnni ? "avx512-vnni" : "avx2"; }
// The kernel's query codes' largest magnitude and bias, and its keys per group.
constexpr int QueryCodeMax(Kernel k) { return k == Kernel::kVnni ? 127 : 63; }
constexpr int QueryBias(Kernel k) { return QueryCodeMax(k) + 1; }
constexpr int KeyGroup(Kernel k) { return k == Kernel::kVnni ? 16 : 8; }
// The keys' codes' largest magnitude (both kernels).
constexpr int kKeyCodeMax = 127;

// A key or query row whose largest magnitude is below this is coded as zero (scale and codes 0,
// so its logits are exactly 0): 127 / max would overflow to infinity for denormal rows, and the
// logits lost are below 1e-30 * sum |other row|.
inline constexpr float kZeroRowMax = 1e-30f;

// How a row with largest magnitude `max_abs` is coded with codes of magnitude <= code_max: codes
// round(x * inv), and `step` (max_abs / code_max) scales them back; both 0 below kZeroRowMax.
struct RowStep {
  float inv, step;
};
inline RowStep StepFor(float max_abs, int code_max) {
  if (!(max_abs >= kZeroRowMax)) return {0.0f, 0.0f};
  const auto c = static_cast<float>(code_max);
  return {c / max_abs, max_abs / c};
}

// Keys (and their scales / offsets) the packed layout holds for n keys.
inline size_t PaddedKeys(int n) { return (static_cast<size_t>(n) + 31) / 32 * 32; }

// q: [rows][head_dim] fp32 -> codes [rows][head_dim] and scales[r] = scale * s_r.
void PackQueries(Kernel kernel, const float* q, int rows, int head_dim, float scale,
                 uint8_t* codes, float* scales);
// Keys straight from the cache: n rows of head_dim elements of type t, row i at
// src + i * row_stride elements -> codes (PaddedKeys(n) * head_dim bytes), scales and
// offsets (PaddedKeys(n) each).
void PackKeys(Kernel kernel, const void* src, DType t, size_t row_stride, int n, int head_dim,
              int8_t* codes, float* scales, int32_t* offsets);
// dst[r * ldc + j] = logit of query row r and key j, r < rows, j < n (nothing else written).
void Logits(Kernel kernel, const uint8_t* q_codes, const float* q_scales, int rows,
            const int8_t* k_codes, const float* k_scales, const int32_t* k_offsets, int n,
            int head_dim, float* dst, size_t ldc);

}  // namespace kvc::cpu::i8

#endif  // KVC_KERNELS_CPU_INT8_LOGITS_H_

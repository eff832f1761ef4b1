// Integer dot products for decode attention over quantized (2/4/8-bit) key and value codes
// (internal to the CPU backend). The arithmetic is defined here once; the portable kernels
// (attention_int.cc) and the vector ones (attention_int_avx2.cc, attention_int_avx512.cc, each
// compiled for its instruction set alone) compute the same integer sums exactly, so every path
// gives the same result up to float rounding of the final scaling.
//
// Keys (per token group, whose per-channel scale is folded into the query first): for query a,
// q its kept channels with 1/sqrt(D) folded in,
//   qs[c]    = q[c] * scale[c]                                   (float, as the exact path)
//   alpha    = max_c |qs[c]| / 127,  qi[c] = round(qs[c] * (127 / max_c |qs[c]|))  (int8)
//   qz       = q . zero  (fma into 16 partial sums by c mod 16, then a fixed pairwise tree)
//   score[j] = alpha * sum_c qi[c] * code[j][c]  +  qz            (int32 sum, then one fma)
// VNNI: vpdpbusd (codes unsigned, query signed); AVX2: vpmaddubsw + vpmaddwd for 2/4-bit codes,
// vpmaddwd on widened codes for 8-bit ones.
//
// Values (2/4-bit codes; 8-bit values stay float): for query a, channel group g, and each block
// of kValueBlock rows counted from the first row of the call,
//   w[j]     = p[j] * scale[j][g]                               (float, p the softmax weight)
//   beta     = max_j w[j] / 255,  wi[j] = round(w[j] / beta)  in [0, 255]            (uint8)
//   acc[c]  += beta * sum_j wi[j] * code[j][c]  +  sum_j p[j] * zero[j][g]
// VNNI: vpdpbusd over four rows at a time (weights unsigned, codes signed); AVX2: vpmaddubsw +
// vpmaddwd. Rounding is to nearest even everywhere (the float environment's default).
//
// Error (bounded per element, see tests/kernels/attention_int_test.cc): a key score moves by at
// most alpha/2 * sum_c code[j][c] (typically ~0.3% of the score's scale); a value weight by at most
// beta/2, i.e. 1/510 of the block's largest weight.
#ifndef KVC_KERNELS_CPU_ATTENTION_INT_H_
#define KVC_KERNELS_CPU_ATTENTION_INT_H_

#include <cstddef>
#include <cstdint>

namespace kvc::cpu::attn::isa {

// Value rows per weight block (beta is per block): int32 sums stay far from overflow.
inline constexpr int kValueBlock = 64;
// Most channel groups per value row the vector kernels take (more: the portable kernel).
inline constexpr int kMaxValueGroups = 16;
// Most key channels the vector kernels take (head_dim's limit, kvc/layer.h).
inline constexpr int kMaxKeyChannels = 256;

// Key scores of rows [j0, j1) of a head's old block against queries qm: per token group (G rows,
// its own per-channel scale and zero), the queries are prepared as above, then every row's score
// is s[a * ss + (j - j0)] = alpha * (qi . code_j) + qz.
struct KeyChunkArgs {
  const uint8_t* codes = nullptr;  // the head's old block: row j at codes + j * row_bytes
  size_t row_bytes = 0;
  int bits = 0, n = 0;           // n <= kMaxKeyChannels
  int64_t group = 0;             // G, rows per token group (may be as large as INT_MAX)
  const float* scale = nullptr;  // [groups, n]
  const float* zero = nullptr;   // [groups, n]
  int j0 = 0, j1 = 0;
  const float* qm = nullptr;  // [nq, n]: kept channels, 1/sqrt(D) folded in
  int nq = 0;
  float* s = nullptr;
  int ss = 0;
};

// Value code rows into float accumulators. The kernels handle every row (no tail left over).
struct ValueArgs {
  const uint8_t* codes = nullptr;  // row j at codes + j * row_bytes
  size_t row_bytes = 0;
  int rows = 0, bits = 0;            // bits 2 or 4
  int n = 0, group = 0, groups = 0;  // channels, channels per group, groups per row
  const float* scale = nullptr;      // [rows, groups]
  const float* zero = nullptr;       // [rows, groups]
  const float* p = nullptr;          // p[a * ps + j]
  int ps = 0, nq = 0;
  float* acc = nullptr;  // acc[a * n + c] += ...
};

// The vector kernels; callers check the instruction set (kvc/cpu_isa.h) and the shapes first:
// AVX2 keys need row_bytes % 16 == 0; values need groups <= 16 (VNNI), or groups of 1, 2, 4 or 8
// and row_bytes % 16 == 0 (AVX2).
void ScoreKeysAvx2(const KeyChunkArgs& a);
void ScoreKeysVnni(const KeyChunkArgs& a);
void AccumulateValuesAvx2(const ValueArgs& a);
void AccumulateValuesVnni(const ValueArgs& a);

}  // namespace kvc::cpu::attn::isa

#endif  // KVC_KERNELS_CPU_ATTENTION_INT_H_

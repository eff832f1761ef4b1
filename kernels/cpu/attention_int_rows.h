// The integer row kernels of the CPU decode attention (internal to kernels/cpu/attention.cc): key
// scores and value accumulation over quantized code rows with integer dot products. Their
// arithmetic, its error and the instruction sets are described in cpu/attention_int.h; the path
// follows kvc/cpu_isa.h, and every path gives the same result up to float rounding.
#ifndef KVC_KERNELS_CPU_ATTENTION_INT_ROWS_H_
#define KVC_KERNELS_CPU_ATTENTION_INT_ROWS_H_

#include "cpu/attention_rows.h"

namespace kvc::cpu::attn {

// Scores of key code rows K (kKeyCodes) [j0, j1) against the queries qm [nq, K.n] (kept channels,
// 1/sqrt(D) folded in): s[a * ss + (j - j0)] ~ qm[a] . dequantized row j, in integer arithmetic
// per token group (cpu/attention_int.h).
void ScoreKeyCodesInt(const Rows& K, int j0, int j1, const float* qm, int nq, float* s, int ss);

// Whether value rows V take the integer path (2- and 4-bit value codes).
bool ValueCodesIntSupported(const Rows& V);
// acc[a * V.n + c] += sum_j p[a * ps + (j - j0)] * value_j[c] over rows [j0, j1), queries a < nq,
// with integer weights per block of rows (cpu/attention_int.h).
void AccumulateValueCodesInt(const Rows& V, int j0, int j1, const float* p, int ps, int nq,
                             float* acc);

}  // namespace kvc::cpu::attn

#endif  // KVC_KERNELS_CPU_ATTENTION_INT_ROWS_H_

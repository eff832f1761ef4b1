// Row kernels of the CPU decode attention (internal to kernels/cpu/attention.cc): scores and
// value accumulation over a block of cached rows in any storage format, for up to any number of
// queries, with AVX2/FMA/F16C paths chosen at run time (kvc/cpu_isa.h) and a portable fallback
// (same math). Quantized rows in integer arithmetic: cpu/attention_int_rows.h.
#ifndef KVC_KERNELS_CPU_ATTENTION_ROWS_H_
#define KVC_KERNELS_CPU_ATTENTION_ROWS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvc/dtype.h"

namespace kvc::cpu::attn {

// A block of rows in one storage format. Dequantized element (row j, kept channel c):
//   kDtype:      the dtype value at base + j * row_bytes
//   kKeyCodes:   code * scale[j / group][c] + zero[j / group][c]   (per-channel token groups)
//   kValueCodes: code * scale[j][c / group] + zero[j][c / group]   (per-token channel groups)
struct Rows {
  enum Kind { kDtype, kKeyCodes, kValueCodes } kind = kDtype;
  DType dtype = DType::kF32;
  const uint8_t* base = nullptr;
  size_t row_bytes = 0;
  int n = 0;                     // elements per row
  const int32_t* idx = nullptr;  // kept channel -> head channel; null = identity (n == D)
  int bits = 0, group = 0;
  const float* scale = nullptr;
  const float* zero = nullptr;
};

// s[a * ss + (j - j0)] = sum_c qm[a * R.n + c] * row_j[c] (+ qz[a] when qz is not null), for rows
// j in [j0, j1) and queries a in [0, nq). Key codes are taken as plain codes (the caller folds
// scale and zero into qm and qz). `row` is scratch for the portable path.
void ScoreRows(const Rows& R, int j0, int j1, const float* qm, const float* qz, int nq, float* s,
               int ss, std::vector<float>* row);
// acc[a * R.n + c] += p[a * ps + (j - j0)] * row_j[c] for rows j in [j0, j1), queries a < nq.
void AccumulateRows(const Rows& R, int j0, int j1, const float* p, int ps, int nq, float* acc,
                    std::vector<float>* row);
// sum_i a[i] * b[i].
float Dot(const float* a, const float* b, int n);

// Whether the vector (AVX2) paths are in use: kvc/cpu_isa.h's level is avx2 or above.
bool UseSimd();

}  // namespace kvc::cpu::attn

#endif  // KVC_KERNELS_CPU_ATTENTION_ROWS_H_

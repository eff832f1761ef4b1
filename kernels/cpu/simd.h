// Small vector kernels for the scoring and channel stages (internal to the CPU backend). Each has
// an AVX2/FMA path (some an AVX-512 one too) chosen at run time (kvc/cpu_isa.h) and a scalar
// fallback; results agree to float rounding.
#ifndef KVC_KERNELS_CPU_SIMD_H_
#define KVC_KERNELS_CPU_SIMD_H_

#include <cstddef>
#include <cstdint>

namespace kvc::simd {

// max(x[0..n)), or -inf when n == 0.
float Max(const float* x, size_t n);
// x[i] = exp(x[i] - m) in place; returns the sum of the new values.
float ExpShiftSum(float* x, size_t n, float m);
// dst[i] = x[i]; where dst is 64-byte aligned the stores are non-temporal (they bypass the
// caches: for data not read again soon). The ranges must not overlap.
void StreamCopy(const float* x, float* dst, size_t n);
// y[i] += a * x[i].
void Axpy(float a, const float* x, float* y, size_t n);
// y[j] += sum_i a[i] * rows[i][j] for i < m, j < n (rows of n floats each): a matrix-vector
// product that reads y once per eight rows instead of once per row.
void AxpyRows(const float* const* rows, const float* a, int m, float* y, size_t n);
// y[i] += x[i] * x[i] (squares accumulate per element).
void AccumulateSquares(const float* x, float* y, size_t n);
// y[i] += |x[i]|.
void AccumulateAbs(const float* x, float* y, size_t n);
// sum of x[i]^2.
float SumSquares(const float* x, size_t n);
// x[j] = (x[j] + CounterGumbel(seed, layer, head, row, col0 + j)) * inv_tau for j in [0, n):
// keyformer's noisy logits for columns [col0, col0 + n) (col0 + n <= 2^32); returns the max of the
// new values (-inf when n == 0). The vector paths (AVX-512DQ, else AVX2) evaluate the counter
// hash and kvc/noise.h's table-driven logarithm operation for operation, so every path's values
// are bit-identical to CounterGumbel's (and to the CUDA backend's).
float AddGumbel(float* x, size_t n, uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                uint32_t col0, float inv_tau);
// Keyformer's softmax numerator at tau = 1 in one pass: x[j] = exp(x[j] + G_j - m) with
// G_j = CounterGumbel(seed, layer, head, row, col0 + j) (col0 + n <= 2^32); returns the sum of the
// new values. Evaluated as exp(x[j] - m) / -log(u_j) (u_j the counter uniform), which needs one
// logarithm (NoiseLog) instead of two. Intended use: m = max(x) (of the noise-free logits), so that
// the row's largest noisy value is not lost to underflow and no value exceeds 2^25 (-log(u_j) >=
// 2^-25): no overflow.
float GumbelExpSum(float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head,
                   uint32_t row, uint32_t col0);

namespace internal {
// The instruction-set-specific paths, for tests: each returns false (doing nothing) when this
// CPU lacks its instruction set, else stores the function's result in *max or *sum.
bool AddGumbelAvx2(float* x, size_t n, uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                   uint32_t col0, float inv_tau, float* max);
bool AddGumbelAvx512(float* x, size_t n, uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                     uint32_t col0, float inv_tau, float* max);
bool GumbelExpSumAvx2(float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head,
                      uint32_t row, uint32_t col0, float* sum);
bool GumbelExpSumAvx512(float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head,
                        uint32_t row, uint32_t col0, float* sum);
// y[i] = log(x[i]) (x[i] positive and normal) with the AVX2 or AVX-512 paths' table-driven
// logarithm.
bool LogAvx2(const float* x, float* y, size_t n);
bool LogAvx512(const float* x, float* y, size_t n);
// The portable paths (kvc/noise.h's NoiseLog, libm expf).
float AddGumbelScalar(float* x, size_t n, uint64_t seed, uint32_t layer, uint32_t head,
                      uint32_t row, uint32_t col0, float inv_tau);
float GumbelExpSumScalar(float* x, size_t n, float m, uint64_t seed, uint32_t layer, uint32_t head,
                         uint32_t row, uint32_t col0);
}  // namespace internal

}  // namespace kvc::simd

#endif  // KVC_KERNELS_CPU_SIMD_H_

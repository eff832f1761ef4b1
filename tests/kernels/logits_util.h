// What the scoring kernels' tests share (amx_logits_test, f32_logits_test): random operands, and
// a logits matrix checked against a double-precision reference.
#ifndef KVC_TESTS_KERNELS_LOGITS_UTIL_H_
#define KVC_TESTS_KERNELS_LOGITS_UTIL_H_

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvc::testing_logits {

// n normal values of standard deviation `scale` from the seed.
std::vector<float> Random(size_t n, uint32_t seed, float scale);

// out[r * ldc + 1 + j] (r < rows, j < n) against scale * sum_d q[r][d] * k[j][d] in double
// (q [rows][d], k [n][d] row-major, the exact values the kernel read): each within the fp32
// summation bound (d + 2) * 2^-24 of scale * sum_d |q_d k_d| (d additions and the scaling, each
// rounding once), and the columns just outside each row's n still -7 (out was filled with -7 and
// the kernel wrote from out + 1). Fails the calling test (gtest ADD_FAILURE) at the first miss.
void ExpectLogitsWithinFp32Rounding(const float* q, const float* k, int rows, int n, int d,
                                    float scale, const float* out, size_t ldc);

}  // namespace kvc::testing_logits

#endif  // KVC_TESTS_KERNELS_LOGITS_UTIL_H_

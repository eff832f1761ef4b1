// Checks shared by the scoring kernels' tests (amx_logits_test, f32_logits_test): a logits
// matrix against a double-precision reference.
#ifndef KVC_TESTS_KERNELS_LOGITS_UTIL_H_
#define KVC_TESTS_KERNELS_LOGITS_UTIL_H_

#include <cstddef>

namespace kvc::testing_logits {

// out[r * ldc + 1 + j] (r < rows, j < n) against scale * sum_d q[r][d] * k[j][d] in double
// (q [rows][d], k [n][d] row-major, the exact values the kernel read): each within the fp32
// summation bound (d + 2) * 2^-24 of scale * sum_d |q_d k_d| (d additions and the scaling, each
// rounding once), and the columns just outside each row's n still -7 (out was filled with -7 and
// the kernel wrote from out + 1). Fails the calling test (gtest ADD_FAILURE) at the first miss.
void ExpectLogitsWithinFp32Rounding(const float* q, const float* k, int rows, int n, int d,
                                    float scale, const float* out, size_t ldc);

}  // namespace kvc::testing_logits

#endif  // KVC_TESTS_KERNELS_LOGITS_UTIL_H_

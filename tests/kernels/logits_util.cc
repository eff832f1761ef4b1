#include "logits_util.h"

#include <cmath>
#include <random>

#include "gtest/gtest.h"

namespace kvc::testing_logits {

std::vector<float> Random(size_t n, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

void ExpectLogitsWithinFp32Rounding(const float* q, const float* k, int rows, int n, int d,
                                    float scale, const float* out, size_t ldc) {
  for (int r = 0; r < rows; ++r) {
    const float* row = out + static_cast<size_t>(r) * ldc;
    if (row[0] != -7.0f || row[ldc - 1] != -7.0f) {
      ADD_FAILURE() << "row " << r << ": a column outside the row's keys was written";
      return;
    }
    for (int j = 0; j < n; ++j) {
      double dot = 0, mag = 0;
      for (int e = 0; e < d; ++e) {
        const double p = static_cast<double>(q[static_cast<size_t>(r) * d + e]) *
                         k[static_cast<size_t>(j) * d + e];
        dot += p;
        mag += std::fabs(p);
      }
      const double bound = std::ldexp(mag * scale * (d + 2), -24) + 1e-30;
      const double err = std::fabs(row[1 + j] - dot * scale);
      if (!(err <= bound)) {
        ADD_FAILURE() << "row " << r << " key " << j << ": off by " << err << ", bound " << bound;
        return;
      }
    }
  }
}

}  // namespace kvc::testing_logits

#include "kvc/noise.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/isa_util.h"
// The engine's vectorized noise (internal header of the CPU backend).
#include "../../kernels/cpu/simd.h"

namespace kvc {
namespace {

TEST(NoiseTest, UniformIsOpenIntervalAndDeterministic) {
  double sum = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const float u = CounterUniform(42, 1, 2, 3, static_cast<uint32_t>(i));
    ASSERT_GT(u, 0.0f);
    ASSERT_LT(u, 1.0f);
    EXPECT_EQ(u, CounterUniform(42, 1, 2, 3, static_cast<uint32_t>(i)));
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 0.005);  // standard error ~0.0006
}

TEST(NoiseTest, EveryCounterFieldChangesTheValue) {
  const float base = CounterUniform(1, 2, 3, 4, 5);
  EXPECT_NE(base, CounterUniform(9, 2, 3, 4, 5));
  EXPECT_NE(base, CounterUniform(1, 9, 3, 4, 5));
  EXPECT_NE(base, CounterUniform(1, 2, 9, 4, 5));
  EXPECT_NE(base, CounterUniform(1, 2, 3, 9, 5));
  EXPECT_NE(base, CounterUniform(1, 2, 3, 4, 9));
  // Swapping row and col must not give the same stream.
  EXPECT_NE(CounterUniform(1, 0, 0, 4, 5), CounterUniform(1, 0, 0, 5, 4));
}

TEST(NoiseTest, GumbelHasTheRightMeanAndVariance) {
  // Gumbel(0, 1): mean = Euler-Mascheroni 0.5772, variance = pi^2 / 6 = 1.645.
  const int n = 400000;
  double sum = 0, sq = 0;
  for (int i = 0; i < n; ++i) {
    const double g =
        CounterGumbel(7, 0, 0, static_cast<uint32_t>(i >> 10), static_cast<uint32_t>(i & 1023));
    ASSERT_TRUE(std::isfinite(g));
    sum += g;
    sq += g * g;
  }
  const double mean = sum / n, var = sq / n - mean * mean;
  EXPECT_NEAR(mean, 0.5772, 0.01);
  EXPECT_NEAR(var, 1.6449, 0.03);
}

TEST(NoiseTest, Mix64IsABijectionOnASample) {
  std::set<uint64_t> seen;
  for (uint64_t i = 0; i < 100000; ++i) seen.insert(Mix64(i));
  EXPECT_EQ(seen.size(), 100000u);
}

// The engine adds keyformer noise with a vector hash + table-driven log; every path must reproduce
// CounterGumbel (the function the CUDA kernels evaluate) bit for bit, tails included (n = 1003),
// and return the max of what it wrote.
void ExpectMatchesCounterGumbel(const std::vector<float>& x, float max) {
  float want_max = -INFINITY;
  for (size_t j = 0; j < x.size(); ++j) {
    const float want = (0.5f + CounterGumbel(77, 3, 5, 11, static_cast<uint32_t>(j))) * 0.5f;
    ASSERT_EQ(x[j], want) << j;
    want_max = std::max(want_max, x[j]);
  }
  EXPECT_EQ(max, want_max);
}

TEST(NoiseTest, VectorGumbelMatchesCounterGumbel) {
  std::vector<float> x(1003, 0.5f);
  ExpectMatchesCounterGumbel(x, simd::AddGumbel(x.data(), x.size(), 77, 3, 5, 11, 0, 0.5f));
  x.assign(1003, 0.5f);
  ExpectMatchesCounterGumbel(
      x, simd::internal::AddGumbelScalar(x.data(), x.size(), 77, 3, 5, 11, 0, 0.5f));
  // Each instruction-set path on its own, where this CPU has it.
  int paths = 0;
  float max = 0;
  x.assign(1003, 0.5f);
  if (simd::internal::AddGumbelAvx2(x.data(), x.size(), 77, 3, 5, 11, 0, 0.5f, &max)) {
    ++paths;
    ExpectMatchesCounterGumbel(x, max);
  }
  x.assign(1003, 0.5f);
  if (simd::internal::AddGumbelAvx512(x.data(), x.size(), 77, 3, 5, 11, 0, 0.5f, &max)) {
    ++paths;
    ExpectMatchesCounterGumbel(x, max);
  }
  if (paths == 0) GTEST_LOG_(INFO) << "no vector path on this CPU; scalar path tested above";
  // Counter values reach the extremes of the 24-bit uniform: results stay finite.
  std::vector<float> y(1 << 16, 0.0f);
  EXPECT_TRUE(std::isfinite(simd::AddGumbel(y.data(), y.size(), 1, 0, 0, 0, 0, 1.0f)));
  for (size_t j = 0; j < y.size(); ++j) ASSERT_TRUE(std::isfinite(y[j])) << j;
  EXPECT_EQ(simd::AddGumbel(y.data(), 0, 1, 0, 0, 0, 0, 1.0f), -INFINITY);
  // A row processed in two parts (columns [0, 500) and [500, 1003)) gives the same values.
  std::vector<float> whole(1003, 0.5f), parts(1003, 0.5f);
  simd::AddGumbel(whole.data(), 1003, 77, 3, 5, 11, 0, 0.5f);
  const float m0 = simd::AddGumbel(parts.data(), 500, 77, 3, 5, 11, 0, 0.5f);
  const float m1 = simd::AddGumbel(parts.data() + 500, 503, 77, 3, 5, 11, 500, 0.5f);
  EXPECT_EQ(parts, whole);
  ExpectMatchesCounterGumbel(parts, std::max(m0, m1));
}

// The AVX2 path carries the 64-bit hash in 32-bit halves and computes the part that depends only
// on the high half once per row (for both values of the carry out of the low half), in blocks of
// 256 columns: it must still equal CounterGumbel for extreme seeds and rows, columns up to
// 2^32 - 1, and lengths on and around the block and vector boundaries.
TEST(NoiseTest, Avx2NoiseMatchesCounterGumbelAcrossKeysColumnsAndBlocks) {
  std::vector<float> x;
  float max = 0;
  if (!simd::internal::AddGumbelAvx2(x.data(), 0, 1, 0, 0, 0, 0, 1.0f, &max)) {
    GTEST_SKIP() << "no AVX2 on this CPU";
  }
  int checked = 0;
  for (uint64_t seed : {uint64_t{0}, uint64_t{1}, ~uint64_t{0}, uint64_t{0x9e3779b97f4a7c15}}) {
    for (uint32_t row : {0u, 1u, 0xffffffffu}) {
      for (size_t n : {size_t{7}, size_t{256}, size_t{257}, size_t{520}}) {
        for (uint32_t col0 : {0u, static_cast<uint32_t>(0xffffffffu - n + 1)}) {
          x.assign(n, 0.25f);
          ASSERT_TRUE(simd::internal::AddGumbelAvx2(x.data(), n, seed, 4, 6, row, col0, 1.0f,
                                                    &max));
          float want_max = -INFINITY;
          for (size_t j = 0; j < n; ++j) {
            const float want =
                0.25f + CounterGumbel(seed, 4, 6, row, col0 + static_cast<uint32_t>(j));
            ASSERT_EQ(x[j], want) << seed << " " << row << " " << n << " " << col0 << " " << j;
            want_max = std::max(want_max, want);
            ++checked;
          }
          EXPECT_EQ(max, want_max);
        }
      }
    }
  }
  EXPECT_EQ(checked, 4 * 3 * 2 * (7 + 256 + 257 + 520));
  // The columns where the carry out of lo(z), z = (key ^ col) + kMixAdd, starts and stops:
  // lo(key ^ col) = 2^32 - lo(kMixAdd) - 1 (no carry, lo(z) = 2^32 - 1), 2^32 - lo(kMixAdd)
  // (carry, lo(z) = 0), 0 and 2^32 - 1, each in a vector with its neighbours.
  const uint64_t seed = 12345;
  const uint32_t key_lo = static_cast<uint32_t>(Mix64(seed ^ Mix64((uint64_t{4} << 32) | 6)));
  const auto add_lo = static_cast<uint32_t>(kMixAdd);
  for (uint32_t t : {0u - add_lo - 1u, 0u - add_lo, 0u, 0xffffffffu}) {
    const uint32_t col = key_lo ^ t;
    const uint32_t col0 = std::min(col >= 3 ? col - 3 : 0u, 0xffffffffu - 10);  // col inside
    x.assign(11, 0.25f);
    ASSERT_TRUE(simd::internal::AddGumbelAvx2(x.data(), 11, seed, 4, 6, 9, col0, 1.0f, &max));
    for (uint32_t j = 0; j < 11; ++j) {
      ASSERT_EQ(x[j], 0.25f + CounterGumbel(seed, 4, 6, 9, col0 + j)) << t << " " << j;
    }
  }
}

// GumbelExpSum(x, m) = exp(x + G - m) elementwise (columns from 9 on), against double precision on
// CounterGumbel's float values; logits spread over [-30, 0] so that the exp's argument range is
// exercised.
void ExpectGumbelExp(const std::vector<float>& x, const std::vector<float>& got, float sum,
                     uint32_t row) {
  const float m = *std::max_element(x.begin(), x.end());
  double want_sum = 0;
  for (size_t j = 0; j < x.size(); ++j) {
    const double g = CounterGumbel(77, 3, 5, row, 9 + static_cast<uint32_t>(j));
    const double want = std::exp(static_cast<double>(x[j]) - m + g);
    want_sum += want;
    ASSERT_NEAR(got[j], want, 2e-6 * want) << j;
  }
  EXPECT_NEAR(sum, want_sum, 1e-5 * want_sum);
}

TEST(NoiseTest, GumbelExpSumMatchesExpOfNoisyLogits) {
  for (size_t n : {size_t{1}, size_t{15}, size_t{1003}, size_t{1020}}) {
    std::vector<float> x(n);
    for (size_t j = 0; j < n; ++j) x[j] = -30.0f + 30.0f * static_cast<float>((j * 37) % n) / n;
    const float m = *std::max_element(x.begin(), x.end());
    const uint32_t row = static_cast<uint32_t>(n);
    std::vector<float> y = x;
    float sum = simd::GumbelExpSum(y.data(), n, m, 77, 3, 5, row, 9);
    ExpectGumbelExp(x, y, sum, row);
    y = x;
    sum = simd::internal::GumbelExpSumScalar(y.data(), n, m, 77, 3, 5, row, 9);
    ExpectGumbelExp(x, y, sum, row);
    y = x;
    if (simd::internal::GumbelExpSumAvx2(y.data(), n, m, 77, 3, 5, row, 9, &sum)) {
      ExpectGumbelExp(x, y, sum, row);
    }
    y = x;
    if (simd::internal::GumbelExpSumAvx512(y.data(), n, m, 77, 3, 5, row, 9, &sum)) {
      ExpectGumbelExp(x, y, sum, row);
    }
  }
  // The noise reaches -log(u) ~ 3e-8 (a factor 2^25): over 64K counters nothing overflows.
  std::vector<float> z(1 << 16, 0.0f);
  EXPECT_TRUE(std::isfinite(simd::GumbelExpSum(z.data(), z.size(), 0.0f, 1, 0, 0, 0, 0)));
  for (size_t j = 0; j < z.size(); ++j) ASSERT_TRUE(std::isfinite(z[j]) && z[j] > 0) << j;
}

// The one 24-bit counter that rounds up to 1 in float (b = 2^24 - 1: seed 1, col 7855647) gives
// the largest float below 1 instead, so its Gumbel noise is finite (-log(1) = 0 would make it inf
// and turn a whole softmax row into NaN; at 128K tokens a layer draws ~8 such counters).
TEST(NoiseTest, UniformNeverReachesOneAndGumbelStaysFinite) {
  uint64_t h = Mix64(1 ^ Mix64(0));
  h = Mix64(h ^ 7855647u);
  ASSERT_EQ(h >> 40, 0xffffffu) << "the test's counter no longer hits the top value";
  EXPECT_EQ(CounterUniform(1, 0, 0, 0, 7855647), 0x1.fffffep-1f);
  EXPECT_TRUE(std::isfinite(CounterGumbel(1, 0, 0, 0, 7855647)));
  // Every path of the engine agrees, around that column (vector lanes and tails).
  for (float inv_tau : {1.0f, 0.5f}) {
    std::vector<float> x(40, 0.0f), y(40, 0.0f), z(40, 0.0f);
    float max = 0;
    simd::internal::AddGumbelScalar(x.data(), x.size(), 1, 0, 0, 0, 7855630, inv_tau);
    if (simd::internal::AddGumbelAvx2(y.data(), y.size(), 1, 0, 0, 0, 7855630, inv_tau, &max)) {
      EXPECT_EQ(x, y);
    }
    if (simd::internal::AddGumbelAvx512(z.data(), z.size(), 1, 0, 0, 0, 7855630, inv_tau, &max)) {
      EXPECT_EQ(x, z);
    }
    for (float v : x) EXPECT_TRUE(std::isfinite(v));
  }
  std::vector<float> e(40, 0.0f);
  EXPECT_TRUE(std::isfinite(simd::GumbelExpSum(e.data(), e.size(), 0.0f, 1, 0, 0, 0, 7855630)));
}

// NoiseLog (the scalar function the CUDA kernels evaluate) against the CPU's AVX-512 and AVX2
// logarithms, bit for bit, over every third 24-bit counter uniform and their negated logs (the two
// arguments Gumbel noise takes), and against libm to its stated accuracy.
TEST(NoiseTest, NoiseLogIsBitIdenticalToTheVectorPathsAndAccurate) {
  std::vector<float> x;
  for (uint32_t b = 0; b < (1u << 24); b += 3) {
    x.push_back(std::min((b + 0.5f) * (1.0f / 16777216.0f), 0x1.fffffep-1f));
  }
  const size_t n_uniform = x.size();
  for (size_t i = 0; i < n_uniform; i += 5) x.push_back(-NoiseLog(x[i]));
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::log(static_cast<double>(x[i]));
    ASSERT_NEAR(NoiseLog(x[i]), want, 2.5e-7 * std::fabs(want) + 1e-30) << x[i];
  }
  std::vector<float> y(x.size());
  if (simd::internal::LogAvx512(x.data(), y.data(), x.size())) {
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], NoiseLog(x[i])) << x[i];
  } else {
    GTEST_LOG_(INFO) << "no AVX-512 on this CPU: its logarithm is not compared";
  }
  if (simd::internal::LogAvx2(x.data(), y.data(), x.size())) {
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], NoiseLog(x[i])) << x[i];
  } else {
    GTEST_LOG_(INFO) << "no AVX2 on this CPU: its logarithm is not compared";
  }
  // The AVX2 path's noise from the same counters (the hash and the log together).
  std::vector<float> g(4099, 0.0f);
  float max = 0;
  if (simd::internal::AddGumbelAvx2(g.data(), g.size(), 5, 1, 2, 3, 0, 1.0f, &max)) {
    for (size_t j = 0; j < g.size(); ++j) {
      ASSERT_EQ(g[j], CounterGumbel(5, 1, 2, 3, static_cast<uint32_t>(j))) << j;
    }
  }
}

// The AVX-512 logarithm: every 24-bit counter uniform (where relative accuracy next to 1 decides
// the noise's accuracy) and a geometric sweep over most of the float range.
TEST(SimdTest, TableLogIsAccurateToAFewUlp) {
  std::vector<float> x;
  for (uint32_t b = 0; b < (1u << 24); b += 7) x.push_back((b + 0.5f) * (1.0f / 16777216.0f));
  for (uint32_t b = (1u << 24) - 4096; b < (1u << 24); ++b) {
    x.push_back((b + 0.5f) * (1.0f / 16777216.0f));
  }
  for (double v = 1e-37; v < 1e38; v *= 1.0001) x.push_back(static_cast<float>(v));
  std::vector<float> y(x.size());
  if (!simd::internal::LogAvx512(x.data(), y.data(), x.size())) {
    GTEST_SKIP() << "no AVX-512 on this CPU";
  }
  for (size_t i = 0; i < x.size(); ++i) {
    const double want = std::log(static_cast<double>(x[i]));
    ASSERT_NEAR(y[i], want, 2.5e-7 * std::fabs(want)) << x[i];
  }
}

TEST(SimdTest, ExpShiftSumMatchesLibm) {
  std::vector<float> x(517);
  for (size_t i = 0; i < x.size(); ++i) x[i] = -80.0f + 0.16f * static_cast<float>(i);
  std::vector<float> y = x;
  const float m = 2.0f;
  const float sum = simd::ExpShiftSum(y.data(), y.size(), m);
  double want_sum = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    // x - m is rounded to float first, as any float softmax does.
    const double want = std::exp(static_cast<double>(x[i] - m));
    want_sum += want;
    ASSERT_NEAR(y[i], want, 3e-7 * want + 1e-37) << x[i];
  }
  EXPECT_NEAR(sum, want_sum, 1e-6 * want_sum);
  EXPECT_EQ(simd::Max(x.data(), x.size()), x.back());
}

// Max and the eight-row matrix-vector product, on every instruction set this CPU has: the max is
// exact, the product within fp32 rounding of a double sum, at lengths that leave every tail.
TEST(SimdTest, MaxAndAxpyRowsOnEveryInstructionSet) {
  std::vector<std::vector<float>> rows(19, std::vector<float>(203));
  for (size_t i = 0; i < rows.size(); ++i) {
    for (size_t j = 0; j < rows[i].size(); ++j) {
      rows[i][j] = std::sin(0.37f * static_cast<float>(i * 211 + j)) * (1.0f + 0.1f * i);
    }
  }
  std::vector<const float*> ptr;
  std::vector<float> a;
  for (size_t i = 0; i < rows.size(); ++i) {
    ptr.push_back(rows[i].data());
    a.push_back(0.5f - 0.07f * static_cast<float>(i));
  }
  for (CpuIsa isa : testing_isa::SupportedIsas()) {
    SCOPED_TRACE(CpuIsaName(isa));
    const testing_isa::ScopedIsaCap cap(isa);
    for (size_t n : {0, 1, 15, 16, 17, 63, 64, 65, 100, 203}) {
      const float* x = rows[3].data();
      EXPECT_EQ(simd::Max(x, n), n == 0 ? -INFINITY : *std::max_element(x, x + n)) << n;
      for (int m : {1, 7, 8, 9, 19}) {
        std::vector<float> y(n, 0.25f);
        simd::AxpyRows(ptr.data(), a.data(), m, y.data(), n);
        for (size_t j = 0; j < n; ++j) {
          double want = 0.25;
          for (int i = 0; i < m; ++i) want += static_cast<double>(a[i]) * rows[i][j];
          ASSERT_NEAR(y[j], want, 1e-5) << "n " << n << " m " << m << " j " << j;
        }
      }
    }
  }
}

}  // namespace
}  // namespace kvc

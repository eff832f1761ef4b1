// The int8 logits kernels (kernels/cpu/int8_logits.h): the packed key layout against a scalar
// packing, and the logits against a double-precision reference of the unrounded operands within
// the header's bound (half a quantization step per element of each operand, plus float rounding)
// for fp32, fp16 and bf16 keys in either layout's row stride, ragged row and key counts, and
// head_dim 16..256, for each kernel: AVX2 (7-bit queries, 8-key groups) and AVX-512 VNNI (8-bit
// queries, 16-key groups), each at its level. A level this CPU lacks skips, naming what it has.
#include "cpu/int8_logits.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/select_util.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"
#include "kernels/isa_util.h"

namespace kvc::cpu {
namespace {

// Each test at each kernel's level: avx2 (the AVX2 kernel, as on an AVX2-only CPU) and
// avx512vnni.
class Int8LogitsTest : public testing_isa::IsaTest {
 protected:
  void SetUp() override {
    IsaTest::SetUp();
    if (IsSkipped()) return;
    ASSERT_TRUE(i8::Usable(16)) << CpuIsaDescription();
    kernel_ = i8::ActiveKernel();
    ASSERT_EQ(kernel_, GetParam() >= CpuIsa::kAvx512Vnni ? i8::Kernel::kVnni : i8::Kernel::kAvx2);
  }
  i8::Kernel kernel_ = i8::Kernel::kAvx2;
};

// The elements as stored in dtype t (raw bytes), and their float values (what the cache holds).
std::vector<uint8_t> Store(DType t, std::vector<float>* v) {
  std::vector<uint8_t> raw(v->size() * DTypeSize(t));
  FromFloat(v->data(), t, v->size(), raw.data());
  ToFloat(raw.data(), t, v->size(), v->data());
  return raw;
}

float MaxAbs(const float* x, int n) {
  float m = 0.0f;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

TEST(Int8LogitsBuildTest, BuiltWithAvx2AndVnniOnX86) {
#if defined(__x86_64__)
  EXPECT_TRUE(i8::Built());
  EXPECT_TRUE(i8::internal::VnniBuilt());
#else
  EXPECT_FALSE(i8::Built());
  EXPECT_FALSE(i8::Usable(16));
#endif
  EXPECT_FALSE(i8::Usable(8));    // not a multiple of 16
  EXPECT_FALSE(i8::Usable(24));
  EXPECT_FALSE(i8::Usable(272));  // above 256: the int32 sums could overflow
}

// Key j's codes: channels 4p..4p+3 at bytes [p * 4G + 4 * (j % G), +4) of its group of G =
// KeyGroup(); the scale is max |k| / 127, the offset QueryBias() * the sum of the codes; padding
// keys are zero. Query codes are round(q / s) + QueryBias() with s = max |q| / QueryCodeMax().
TEST_P(Int8LogitsTest, KeysAndQueriesArePackedAsDocumented) {
  const int n = 37, d = 48;
  std::vector<float> k = testing::RandomValues(static_cast<size_t>(n) * d, 9, 2.0f);
  for (int e = 0; e < d; ++e) k[5 * d + e] = 0.0f;  // an all-zero key
  const std::vector<uint8_t> raw = Store(DType::kF32, &k);
  const size_t keys = i8::PaddedKeys(n);
  ASSERT_EQ(keys, 64u);
  std::vector<int8_t> codes(keys * d, 99);
  std::vector<float> scales(keys, -1.0f);
  std::vector<int32_t> offsets(keys, -1);
  i8::PackKeys(kernel_, raw.data(), DType::kF32, d, n, d, codes.data(), scales.data(),
               offsets.data());
  const int G = i8::KeyGroup(kernel_), bias = i8::QueryBias(kernel_);
  for (int j = 0; j < static_cast<int>(keys); ++j) {
    SCOPED_TRACE(::testing::Message() << "key " << j);
    const float m = j < n ? MaxAbs(k.data() + static_cast<size_t>(j) * d, d) : 0.0f;
    EXPECT_FLOAT_EQ(scales[j], m / 127.0f);
    int32_t sum = 0;
    for (int e = 0; e < d; ++e) {
      const int8_t c =
          codes[static_cast<size_t>(j / G) * G * d + (e / 4) * 4 * G + (j % G) * 4 + e % 4];
      const int want =
          j < n && m > 0.0f
              ? static_cast<int>(std::nearbyint(k[static_cast<size_t>(j) * d + e] * (127.0f / m)))
              : 0;
      ASSERT_EQ(c, want) << "channel " << e;
      sum += c;
    }
    EXPECT_EQ(offsets[j], bias * sum);
  }
  // Queries: a row with an outlier, a zero row.
  const int rows = 3;
  std::vector<float> q = testing::RandomValues(static_cast<size_t>(rows) * d, 4, 1.0f);
  q[7] = -9.0f;
  std::fill(q.begin() + 2 * d, q.end(), 0.0f);
  std::vector<uint8_t> qc(static_cast<size_t>(rows) * d, 0);
  std::vector<float> qs(rows, -1.0f);
  i8::PackQueries(kernel_, q.data(), rows, d, 0.5f, qc.data(), qs.data());
  const int qmax = i8::QueryCodeMax(kernel_);
  for (int r = 0; r < rows; ++r) {
    const float m = MaxAbs(q.data() + static_cast<size_t>(r) * d, d);
    EXPECT_FLOAT_EQ(qs[r], 0.5f * (m / qmax)) << "row " << r;
    for (int e = 0; e < d; ++e) {
      const int code =
          m > 0.0f ? static_cast<int>(std::nearbyint(q[static_cast<size_t>(r) * d + e] *
                                                     (static_cast<float>(qmax) / m)))
                   : 0;
      ASSERT_EQ(qc[static_cast<size_t>(r) * d + e], code + bias) << "row " << r << " ch " << e;
    }
  }
  EXPECT_EQ(qc[7], bias - qmax);  // the outlier at the codes' limit
}

TEST_P(Int8LogitsTest, LogitsMatchDoubleReferenceWithinTheQuantizationBound) {
  struct Case {
    int rows, n, d;
    DType t;
    int stride_heads;  // keys' row stride in head_dims (NHD layouts interleave the heads)
  };
  const Case cases[] = {{1, 1, 16, DType::kF32, 1},     {11, 17, 64, DType::kF16, 1},
                        {12, 32, 64, DType::kBF16, 3},  {13, 33, 128, DType::kF16, 8},
                        {25, 47, 96, DType::kF32, 2},   {128, 1024, 128, DType::kBF16, 1},
                        {37, 300, 256, DType::kF16, 1}, {7, 15, 48, DType::kBF16, 1}};
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.rows << "x" << c.n << " d " << c.d << " "
                                    << DTypeName(c.t) << " stride " << c.stride_heads);
    const size_t stride = static_cast<size_t>(c.d) * c.stride_heads;
    std::vector<float> q = testing::RandomValues(static_cast<size_t>(c.rows) * c.d, 3 + c.n, 1.0f);
    std::vector<float> k =
        testing::RandomValues(static_cast<size_t>(c.n) * stride, 5 + c.rows, 1.5f);
    // Outlier channels, as real keys have: a few channels 20x the rest.
    for (int j = 0; j < c.n; ++j) k[j * stride + 3] *= 20.0f;
    const std::vector<uint8_t> raw = Store(c.t, &k);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    const size_t keys = i8::PaddedKeys(c.n);
    std::vector<uint8_t> qc(static_cast<size_t>(c.rows) * c.d);
    std::vector<float> qs(c.rows);
    std::vector<int8_t> kc(keys * c.d);
    std::vector<float> ks(keys);
    std::vector<int32_t> ko(keys);
    i8::PackQueries(kernel_, q.data(), c.rows, c.d, scale, qc.data(), qs.data());
    i8::PackKeys(kernel_, raw.data(), c.t, stride, c.n, c.d, kc.data(), ks.data(), ko.data());
    const size_t ldc = static_cast<size_t>(c.n) + 2;
    std::vector<float> out(static_cast<size_t>(c.rows) * ldc, -7.0f);
    i8::Logits(kernel_, qc.data(), qs.data(), c.rows, kc.data(), ks.data(), ko.data(), c.n, c.d,
               out.data() + 1, ldc);
    double worst = 0;  // the largest error as a fraction of its bound
    for (int r = 0; r < c.rows; ++r) {
      ASSERT_EQ(out[r * ldc], -7.0f) << "row " << r;
      ASSERT_EQ(out[r * ldc + ldc - 1], -7.0f) << "row " << r;
      const float* qr = q.data() + static_cast<size_t>(r) * c.d;
      const double sq = MaxAbs(qr, c.d) / i8::QueryCodeMax(kernel_);
      for (int j = 0; j < c.n; ++j) {
        const float* kj = k.data() + j * stride;
        const double sk = MaxAbs(kj, c.d) / 127.0;
        double dot = 0, bound = 0;
        for (int e = 0; e < c.d; ++e) {
          dot += static_cast<double>(qr[e]) * kj[e];
          bound += std::fabs(qr[e]) * sk / 2 + std::fabs(kj[e]) * sq / 2 + sq * sk / 4;
        }
        // Float rounding of the scales and of the final products (a few ulps of the sum).
        bound = bound * scale * 1.01 + 1e-5 * std::fabs(dot * scale) + 1e-30;
        const double err = std::fabs(out[r * ldc + 1 + j] - dot * scale);
        ASSERT_LE(err, bound) << "row " << r << " key " << j;
        worst = std::max(worst, err / bound);
      }
    }
    // The bound is a worst case; the errors sit well inside it (rounding errors cancel).
    EXPECT_LT(worst, 0.5);
  }
}

// An all-zero key (or query row) has scale 0: its logits are exactly 0, never NaN. So have rows
// whose largest magnitude is below 1e-30 (denormals: 127 / max would overflow to inf).
TEST_P(Int8LogitsTest, ZeroRowsGiveZeroLogits) {
  const int rows = 4, n = 6, d = 32;
  std::vector<float> q = testing::RandomValues(static_cast<size_t>(rows) * d, 1, 1.0f);
  std::vector<float> k = testing::RandomValues(static_cast<size_t>(n) * d, 2, 1.0f);
  std::fill(q.begin() + d, q.begin() + 2 * d, 0.0f);  // row 1
  std::fill(k.begin() + 2 * d, k.begin() + 3 * d, 0.0f);  // key 2
  for (int e = 0; e < d; ++e) {
    q[3 * d + e] = (e % 2 ? -1 : 1) * 1e-40f * (e + 1);  // row 3: denormals
    k[4 * d + e] = (e % 3 ? 1 : -1) * 1e-41f * (e + 1);  // key 4: denormals
  }
  const std::vector<uint8_t> raw = Store(DType::kF32, &k);
  const size_t keys = i8::PaddedKeys(n);
  std::vector<uint8_t> qc(static_cast<size_t>(rows) * d);
  std::vector<float> qs(rows), ks(keys), out(static_cast<size_t>(rows) * n, -1.0f);
  std::vector<int8_t> kc(keys * d);
  std::vector<int32_t> ko(keys);
  i8::PackQueries(kernel_, q.data(), rows, d, 0.25f, qc.data(), qs.data());
  i8::PackKeys(kernel_, raw.data(), DType::kF32, d, n, d, kc.data(), ks.data(), ko.data());
  i8::Logits(kernel_, qc.data(), qs.data(), rows, kc.data(), ks.data(), ko.data(), n, d,
             out.data(), n);
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < n; ++j) {
      if (r == 1 || r == 3 || j == 2 || j == 4) {
        EXPECT_EQ(out[r * n + j], 0.0f) << r << "," << j;
      } else {
        EXPECT_NE(out[r * n + j], 0.0f) << r << "," << j;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, Int8LogitsTest,
                         ::testing::Values(CpuIsa::kAvx2, CpuIsa::kAvx512Vnni),
                         testing_isa::IsaName);

}  // namespace
}  // namespace kvc::cpu

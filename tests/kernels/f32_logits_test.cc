// The fp32 logits kernels (kernels/cpu/f32_logits.h), AVX2 and AVX-512, each level this CPU has:
// the packed key and query layouts against the documented index formulas, and the logits against
// a double-precision reference within fp32 summation rounding for fp16, bf16 and fp32 keys a
// stride apart (as in an NHD cache), ragged row and key counts (every remainder of the row blocks
// and of the key groups) and head_dim 16..256. Levels the CPU lacks skip, naming what it has.
#include "cpu/f32_logits.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/isa_util.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"
#include "logits_util.h"

namespace kvc::cpu {
namespace {

// The kernels' levels: AVX2 and AVX-512 (above AVX-512 the same kernels run).
class F32LogitsTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override {
    if (!testing_isa::Supported(GetParam())) {
      GTEST_SKIP() << "this CPU lacks " << CpuIsaName(GetParam()) << " (it has "
                   << CpuFeatureList() << ")";
    }
    previous_ = SetCpuIsaCap(GetParam());
    ASSERT_TRUE(f32::Usable(16));
  }
  void TearDown() override { SetCpuIsaCap(previous_); }

 private:
  CpuIsa previous_ = kBestCpuIsa;
};

using testing_logits::Random;

// `count` values of type t at a stride of `stride` elements (the gaps hold other values), and
// the floats they hold.
struct Rows {
  std::vector<uint8_t> raw;
  std::vector<float> values;  // [count][d], the exact values of the stored elements
};
Rows MakeRows(DType t, int count, int d, size_t stride, uint32_t seed) {
  const size_t esize = DTypeSize(t);
  std::vector<float> all = Random(static_cast<size_t>(count) * stride, seed, 1.5f);
  Rows r;
  r.raw.resize(all.size() * esize);
  FromFloat(all.data(), t, all.size(), r.raw.data());
  std::vector<float> back(all.size());
  ToFloat(r.raw.data(), t, all.size(), back.data());
  r.values.resize(static_cast<size_t>(count) * d);
  for (int i = 0; i < count; ++i) {
    for (int e = 0; e < d; ++e) r.values[static_cast<size_t>(i) * d + e] = back[i * stride + e];
  }
  return r;
}

#if defined(__x86_64__)
TEST(F32LogitsBuildTest, BuiltOnX86) { EXPECT_TRUE(f32::Built()); }
#endif

TEST_P(F32LogitsTest, TileAndRowBlockFollowTheLevel) {
  const bool avx512 = GetParam() == CpuIsa::kAvx512;
  EXPECT_EQ(f32::KeyTile(), avx512 ? 16 : 8);
  EXPECT_EQ(f32::RowBlock(), avx512 ? 12 : 6);
}

// With tile width T and row block R: key j, channel e sits at tile j / T, element e * T + j % T;
// padding keys up to 32 are zero. Query row r of block b = r / R (width w: R, or the rows left in
// the last block) sits at b * R * d + e * w + r % R.
TEST_P(F32LogitsTest, PackedLayoutsFollowTheirFormulas) {
  const int T = f32::KeyTile(), R = f32::RowBlock();
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    const int n = 37, d = 48;
    const size_t stride = 3 * d;
    const Rows keys = MakeRows(t, n, d, stride, 11);
    std::vector<float> packed(f32::PackedKeyElems(n, d), -1.0f);
    ASSERT_EQ(packed.size(), static_cast<size_t>(64) * d);
    f32::PackKeys(keys.raw.data(), t, stride, n, d, packed.data());
    for (int j = 0; j < 64; ++j) {
      for (int e = 0; e < d; ++e) {
        const float want = j < n ? keys.values[static_cast<size_t>(j) * d + e] : 0.0f;
        ASSERT_EQ(packed[(static_cast<size_t>(j / T) * d + e) * T + j % T], want)
            << "key " << j << " channel " << e;
      }
    }
  }
  const int rows = 29, d = 32;
  const std::vector<float> q = Random(static_cast<size_t>(rows) * d, 5, 1.0f);
  std::vector<float> qp(q.size(), -1.0f);
  f32::PackQueries(q.data(), rows, d, qp.data());
  for (int r = 0; r < rows; ++r) {
    const int b = r / R, w = b < rows / R ? R : rows % R;
    for (int e = 0; e < d; ++e) {
      ASSERT_EQ(qp[static_cast<size_t>(b) * R * d + e * w + r % R], q[r * d + e])
          << "row " << r << " channel " << e;
    }
  }
}

// Each logit within the fp32 summation bound of the double reference (logits_util.h), and nothing
// written outside the rows' n columns.
TEST_P(F32LogitsTest, LogitsMatchDoubleReference) {
  struct Case {
    int rows, n, d;
  };
  const Case cases[] = {{1, 1, 16},   {11, 17, 64},     {12, 32, 64},   {13, 33, 128},
                        {25, 47, 96}, {128, 1024, 128}, {37, 300, 256}, {7, 15, 32},
                        {24, 64, 16}, {35, 31, 80},     {5, 9, 48},     {6, 16, 32}};
  for (DType t : {DType::kF16, DType::kF32, DType::kBF16}) {
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message() << DTypeName(t) << " " << c.rows << "x" << c.n << " d "
                                      << c.d);
      const std::vector<float> q = Random(static_cast<size_t>(c.rows) * c.d, 3 + c.n, 1.0f);
      const size_t stride = 2 * static_cast<size_t>(c.d);  // another head's row in between
      const Rows keys = MakeRows(t, c.n, c.d, stride, 5 + c.rows);
      const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
      std::vector<float> kp(f32::PackedKeyElems(c.n, c.d)), qp(q.size());
      f32::PackKeys(keys.raw.data(), t, stride, c.n, c.d, kp.data());
      f32::PackQueries(q.data(), c.rows, c.d, qp.data());
      const size_t ldc = static_cast<size_t>(c.n) + 2;
      std::vector<float> out(static_cast<size_t>(c.rows) * ldc, -7.0f);
      f32::Logits(qp.data(), c.rows, kp.data(), c.n, c.d, scale, out.data() + 1, ldc);
      testing_logits::ExpectLogitsWithinFp32Rounding(q.data(), keys.values.data(), c.rows, c.n,
                                                     c.d, scale, out.data(), ldc);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Levels, F32LogitsTest, ::testing::Values(CpuIsa::kAvx2, CpuIsa::kAvx512),
                         testing_isa::IsaName);

}  // namespace
}  // namespace kvc::cpu

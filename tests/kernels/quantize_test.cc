// The quantizer is internal to kernels/ (kernels/core/quantize.h); it is tested directly here.
#include "../kernels/core/quantize.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/isa_util.h"
#include "kernels/pack_util.h"
#include "kvc/convert.h"
#include "kvc/dtype.h"

namespace kvc::quant {
namespace {

std::vector<float> Random(size_t n, uint32_t seed, float amp) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> dist(-amp, amp);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

// |x - dequant(x)| <= scale / 2 (+ float rounding) for every element, keys per channel over
// groups of g tokens (last group partial) and values per token over groups of g channels.
TEST(QuantizeTest, ErrorWithinHalfStep) {
  for (int bits : {2, 4, 8}) {
    for (int g : {1, 5, 32}) {
      const int m = 45, t = 37;  // partial groups on both axes
      const std::vector<float> x = Random(static_cast<size_t>(m) * t, bits * 100 + g, 3.0f);
      SCOPED_TRACE(::testing::Message() << "bits " << bits << " g " << g);
      const size_t rb = CodeRowBytes(t, bits);
      std::vector<uint8_t> codes(m * rb);
      std::vector<float> row(t);
      // Keys.
      std::vector<float> ks(NumGroups(m, g) * t), kz(ks.size());
      QuantizeKeys(x.data(), m, t, bits, g, ks.data(), kz.data(), codes.data());
      for (int j = 0; j < m; ++j) {
        DequantizeKeyRow(ks.data(), kz.data(), codes.data(), j, t, bits, g, row.data());
        for (int c = 0; c < t; ++c) {
          const float scale = ks[(j / g) * t + c];
          ASSERT_LE(std::fabs(row[c] - x[j * t + c]), scale / 2 + 1e-5f) << j << " " << c;
        }
      }
      // Values.
      std::vector<float> vs(m * NumGroups(t, g)), vz(vs.size());
      QuantizeValues(x.data(), m, t, bits, g, vs.data(), vz.data(), codes.data());
      for (int j = 0; j < m; ++j) {
        DequantizeValueRow(vs.data(), vz.data(), codes.data(), j, t, bits, g, row.data());
        for (int c = 0; c < t; ++c) {
          const float scale = vs[j * NumGroups(t, g) + c / g];
          ASSERT_LE(std::fabs(row[c] - x[j * t + c]), scale / 2 + 1e-5f) << j << " " << c;
        }
      }
    }
  }
}

// scale = (max - min) / (2^bits - 1), zero = min; min maps to code 0 and max to the top code.
TEST(QuantizeTest, ScaleZeroAndExtremes) {
  const std::vector<float> x = {-1.0f, 2.0f, 0.5f, 0.25f};  // one token, 4 channels
  std::vector<float> s(1), z(1);
  std::vector<uint8_t> codes(1);
  QuantizeValues(x.data(), 1, 4, 2, 4, s.data(), z.data(), codes.data());
  EXPECT_FLOAT_EQ(s[0], 1.0f);
  EXPECT_EQ(z[0], -1.0f);
  // codes: 0, 3, round(1.5) = 2, round(1.25) = 1 -> 0b01'10'11'00
  EXPECT_EQ(codes[0], 0b01101100);
  EXPECT_EQ(CodeAt(codes.data(), 0, 2), 0u);
  EXPECT_EQ(CodeAt(codes.data(), 1, 2), 3u);
  EXPECT_EQ(CodeAt(codes.data(), 2, 2), 2u);
  EXPECT_EQ(CodeAt(codes.data(), 3, 2), 1u);
}

// Packing: element 0 in the lowest bits, rows byte-aligned, padding bits zero.
TEST(QuantizeTest, PackingLayout) {
  // 2 tokens x 3 channels, 4 bits, values chosen to hit codes 0..15 exactly per channel group.
  const std::vector<float> x = {0.0f, 15.0f, 7.0f, 15.0f, 0.0f, 8.0f};
  std::vector<float> s(3), z(3);
  std::vector<uint8_t> codes(2 * CodeRowBytes(3, 4));
  ASSERT_EQ(CodeRowBytes(3, 4), 2u);
  QuantizeKeys(x.data(), 2, 3, 4, 2, s.data(), z.data(), codes.data());
  // Channel scales: (15-0)/15 = 1, 1, (8-7)/15.
  EXPECT_FLOAT_EQ(s[0], 1.0f);
  EXPECT_FLOAT_EQ(s[1], 1.0f);
  EXPECT_EQ(z[2], 7.0f);
  // Token 0 codes: 0, 15, 0 -> bytes 0xf0, 0x00; token 1: 15, 0, 15 -> 0x0f, 0x0f.
  EXPECT_EQ(codes[0], 0xf0);
  EXPECT_EQ(codes[1], 0x00);
  EXPECT_EQ(codes[2], 0x0f);
  EXPECT_EQ(codes[3], 0x0f);
  EXPECT_EQ(CodeRowBytes(5, 2), 2u);
  EXPECT_EQ(CodeRowBytes(8, 8), 8u);
  EXPECT_EQ(NumGroups(33, 32), 2);
  EXPECT_EQ(NumGroups(0, 32), 0);
}

// A constant group has scale 0: every code is 0 and the value comes back exactly.
TEST(QuantizeTest, ConstantGroupIsExact) {
  const std::vector<float> x(4 * 8, 1.2345f);
  std::vector<float> s(8), z(8), row(8);
  std::vector<uint8_t> codes(4 * 4);
  QuantizeKeys(x.data(), 4, 8, 4, 4, s.data(), z.data(), codes.data());
  for (uint8_t c : codes) EXPECT_EQ(c, 0);
  for (int j = 0; j < 4; ++j) {
    DequantizeKeyRow(s.data(), z.data(), codes.data(), j, 8, 4, 4, row.data());
    for (float v : row) EXPECT_EQ(v, 1.2345f);
  }
}

// Non-finite input never yields an out-of-range code (codes stay within 2^bits - 1 bits).
TEST(QuantizeTest, NonFiniteInputStaysInRange) {
  std::vector<float> x = Random(16 * 8, 1, 1.0f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[20] = std::numeric_limits<float>::infinity();
  std::vector<float> s(2 * 8), z(2 * 8);
  std::vector<uint8_t> codes(16 * CodeRowBytes(8, 2));
  QuantizeKeys(x.data(), 16, 8, 2, 8, s.data(), z.data(), codes.data());
  std::vector<float> unpacked(8);
  for (int j = 0; j < 16; ++j) {
    UnpackCodes(codes.data() + j * CodeRowBytes(8, 2), 8, 2, unpacked.data());
    for (float c : unpacked) {
      EXPECT_GE(c, 0.0f);
      EXPECT_LE(c, 3.0f);
    }
  }
}

// Value groups' scale and zero are the sequential fold lo = x < lo ? x : lo (hi likewise) from the
// group's first element, bit for bit: NaN after the first element is skipped, a NaN first element
// propagates, and among +0/-0 the first one seen wins. Pins any faster (e.g. lane-parallel)
// min/max to the fold for every group length and those edge cases.
TEST(QuantizeTest, ValueGroupExtremesFollowTheSequentialFold) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::mt19937 rng(12);
  for (int n = 1; n <= 70; ++n) {
    for (int kind = 0; kind < 6; ++kind) {
      std::vector<float> x = Random(n, 100 * n + kind, 3.0f);
      if (kind == 1) x[rng() % n] = nan;  // NaN somewhere
      if (kind == 2) x[0] = nan;          // NaN first
      if (kind == 3)
        for (float& v : x) v = std::fabs(v);                     // min > 0 ...
      if (kind == 3) x[rng() % n] = (rng() % 2) ? 0.0f : -0.0f;  // ... or exactly one zero
      if (kind == 4) {                                           // +0 and -0 both minimal
        for (float& v : x) v = std::fabs(v) + 1.0f;
        x[n > 1 ? 1 : 0] = -0.0f;  // -0 first (not at 0, so in another lane than index 8)
        x[std::min(8, n - 1)] = 0.0f;
      }
      if (kind == 5)
        for (float& v : x) v = -std::fabs(v) - 1.0f;  // all negative, max < 0
      float lo = x[0], hi = x[0];
      for (int i = 1; i < n; ++i) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
      }
      float scale = 0, zero = 0;
      std::vector<uint8_t> codes(CodeRowBytes(n, 8));
      QuantizeValues(x.data(), 1, n, 8, n, &scale, &zero, codes.data());
      const float want_scale = (hi - lo) / 255.0f;
      EXPECT_EQ(std::memcmp(&zero, &lo, sizeof(float)), 0) << "n " << n << " kind " << kind;
      EXPECT_EQ(std::memcmp(&scale, &want_scale, sizeof(float)), 0)
          << "n " << n << " kind " << kind;
    }
  }
}

// Every width and length, on the vector path (32 codes at a time, then the scalar tail) and
// capped at the portable one.
TEST(QuantizeTest, UnpackMatchesCodeAt) {
  std::mt19937 rng(4);
  for (const CpuIsa cap : {kBestCpuIsa, CpuIsa::kPortable}) {
    const testing_isa::ScopedIsaCap scoped(cap);
    for (int bits : {2, 4, 8}) {
      for (int n : {7, 29, 32, 64, 77, 128, 131}) {
        std::vector<uint8_t> row(CodeRowBytes(n, bits));
        for (uint8_t& b : row) b = static_cast<uint8_t>(rng());
        std::vector<float> out(n + 1, -1.0f);
        UnpackCodes(row.data(), n, bits, out.data());
        for (int i = 0; i < n; ++i) {
          ASSERT_EQ(out[i], static_cast<float>(CodeAt(row.data(), i, bits)))
              << "bits " << bits << " n " << n << " i " << i << " " << CpuIsaName(cap);
        }
        EXPECT_EQ(out[n], -1.0f) << "wrote past n";
      }
    }
  }
}

// A dequantized element is float(code) * scale, rounded, then + zero, rounded: on the AVX2 path
// (32 codes at a time, no fused multiply-add) as on the portable one, bit for bit, keys (a scale
// per channel and group of rows) and values (a scale per row and group of channels).
TEST(QuantizeTest, DequantizedRowsAreMultiplyThenAdd) {
  std::mt19937 rng(9);
  std::normal_distribution<float> gauss(0.0f, 3.0f);
  for (const CpuIsa cap : {kBestCpuIsa, CpuIsa::kPortable}) {
    const testing_isa::ScopedIsaCap scoped(cap);
    for (int bits : {2, 4, 8}) {
      for (const auto& [t, g] : {std::pair{128, 32}, {77, 16}, {40, 8}}) {
        const int rows = 2 * g + 3;
        std::vector<uint8_t> codes(rows * CodeRowBytes(t, bits));
        for (uint8_t& b : codes) b = static_cast<uint8_t>(rng());
        std::vector<float> ks(NumGroups(rows, g) * t), kz(ks.size()), vs(rows * NumGroups(t, g)),
            vz(vs.size()), row(t);
        for (auto* v : {&ks, &kz, &vs, &vz}) {
          for (float& x : *v) x = gauss(rng);
        }
        for (int j = 0; j < rows; ++j) {
          const uint8_t* r = codes.data() + j * CodeRowBytes(t, bits);
          DequantizeKeyRow(ks.data(), kz.data(), codes.data(), j, t, bits, g, row.data());
          for (int c = 0; c < t; ++c) {
            const float prod = static_cast<float>(CodeAt(r, c, bits)) * ks[(j / g) * t + c];
            const float want = prod + kz[(j / g) * t + c];
            ASSERT_EQ(std::memcmp(&row[c], &want, 4), 0)
                << "keys bits " << bits << " t " << t << " " << CpuIsaName(cap);
          }
          DequantizeValueRow(vs.data(), vz.data(), codes.data(), j, t, bits, g, row.data());
          for (int c = 0; c < t; ++c) {
            const size_t gi = static_cast<size_t>(j) * NumGroups(t, g) + c / g;
            const float prod = static_cast<float>(CodeAt(r, c, bits)) * vs[gi];
            const float want = prod + vz[gi];
            ASSERT_EQ(std::memcmp(&row[c], &want, 4), 0)
                << "values bits " << bits << " t " << t << " " << CpuIsaName(cap);
          }
        }
      }
    }
  }
}

// A head's rows dequantized and rounded in one call (the fused kernels where t % 32 == 0 and a
// value group is a multiple of 8; the row path otherwise) are the row path's floats rounded by
// FromFloat, bit for bit: every dtype and width, on each build. Scales span subnormal to
// overflowing results in fp16 and bf16; a NaN need only stay NaN.
TEST(QuantizeTest, DequantizedHeadsAreTheRowsRounded) {
  std::mt19937 rng(11);
  std::normal_distribution<float> gauss(0.0f, 1.0f);
  std::uniform_int_distribution<int> exponent(-30, 20);
  int fused_shapes = 0;
  for (const CpuIsa cap : {kBestCpuIsa, CpuIsa::kAvx2, CpuIsa::kPortable}) {
    const testing_isa::ScopedIsaCap scoped(cap);
    for (const DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (int bits : {2, 4, 8}) {
        for (const auto& [t, g] : {std::pair{128, 32}, {64, 64}, {96, 12}, {40, 8}}) {
          SCOPED_TRACE(testing::Message() << DTypeName(dt) << " bits " << bits << " t " << t
                                          << " g " << g << " " << CpuIsaName(cap));
          fused_shapes += t % 32 == 0 && g % 8 == 0;
          const int rows = 2 * g + 5;
          std::vector<uint8_t> codes(rows * CodeRowBytes(t, bits));
          for (uint8_t& b : codes) b = static_cast<uint8_t>(rng());
          std::vector<float> ks(NumGroups(rows, g) * t), kz(ks.size()),
              vs(rows * NumGroups(t, g)), vz(vs.size()), row(t);
          for (auto* v : {&ks, &kz, &vs, &vz}) {
            for (float& x : *v) x = std::ldexp(gauss(rng), exponent(rng));
          }
          const size_t esize = DTypeSize(dt), n = static_cast<size_t>(rows) * t;
          std::vector<uint8_t> got(n * esize), want(n * esize);
          for (const bool keys : {true, false}) {
            if (keys) {
              DequantizeKeysTo(ks.data(), kz.data(), codes.data(), rows, t, bits, g, dt,
                               got.data());
            } else {
              DequantizeValuesTo(vs.data(), vz.data(), codes.data(), rows, t, bits, g, dt,
                                 got.data());
            }
            for (int j = 0; j < rows; ++j) {
              if (keys) {
                DequantizeKeyRow(ks.data(), kz.data(), codes.data(), j, t, bits, g, row.data());
              } else {
                DequantizeValueRow(vs.data(), vz.data(), codes.data(), j, t, bits, g, row.data());
              }
              internal::FromFloatScalar(row.data(), dt, t, want.data() + j * t * esize);
            }
            EXPECT_EQ(testing_pack::ElementsDiffering(got.data(), want.data(), dt, n), 0u)
                << (keys ? "keys" : "values");
          }
        }
      }
    }
  }
  EXPECT_EQ(fused_shapes, 3 * 3 * 3 * 2);
}

}  // namespace
}  // namespace kvc::quant

// Scalar conversions of kvc/dtype.h and the bulk converters of kvc/convert.h.
#include "kvc/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "gtest/gtest.h"
#include "kvc/convert.h"

namespace kvc {
namespace {

uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}
float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

TEST(HalfTest, EveryHalfRoundTripsThroughFloat) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = HalfToFloat(static_cast<uint16_t>(h));
    const bool nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0;
    if (nan) {
      EXPECT_TRUE(std::isnan(f)) << h;
      EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(f))));
    } else {
      EXPECT_EQ(FloatToHalf(f), h) << h;
    }
  }
}

TEST(HalfTest, KnownValuesSubnormalsAndInf) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(-2.0f), 0xc000);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);  // largest finite
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // halfway to 65536 rounds to even -> Inf
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(FloatToHalf(-std::numeric_limits<float>::infinity()), 0xfc00);
  EXPECT_EQ(HalfToFloat(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(HalfToFloat(0x03ff), std::ldexp(1023.0f, -24));
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // exactly half of 2^-24: even -> 0
  EXPECT_EQ(FloatToHalf(std::ldexp(1.5f, -25)), 0x0001);  // above half rounds up
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulps: tie to even (2)
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(HalfTest, RoundsToNearestEven) {
  // 1 + 2^-11 is exactly between 1 (0x3c00, even) and 1 + 2^-10 (0x3c01): rounds to 0x3c00.
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3 * 2^-11 is between 0x3c01 (odd) and 0x3c02 (even): rounds to 0x3c02.
  EXPECT_EQ(FloatToHalf(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Slightly above the tie rounds up.
  EXPECT_EQ(FloatToHalf(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
}

TEST(BFloat16Test, RoundTripAndRounding) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const float f = BFloat16ToFloat(static_cast<uint16_t>(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(f))));
    } else {
      EXPECT_EQ(FloatToBFloat16(f), b) << b;
    }
  }
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f808000u)), 0x3f80);  // tie, even stays
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f818000u)), 0x3f82);  // tie, odd rounds up
  EXPECT_EQ(FloatToBFloat16(FromBits(0x3f808001u)), 0x3f81);  // above tie
  EXPECT_EQ(FloatToBFloat16(FromBits(0x7f7fffffu)), 0x7f80);  // max float rounds to Inf
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00000001u)), 0x0000);  // tiny subnormal -> 0
  EXPECT_EQ(FloatToBFloat16(FromBits(0x00018000u)), 0x0002);  // subnormal tie to even
  // A signalling NaN whose payload sits only in the low bits must not become Inf.
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(FromBits(0x7f800001u)))));
}

TEST(DTypeTest, NamesAndParsing) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) EXPECT_EQ(*ParseDType(DTypeName(t)), t);
  EXPECT_EQ(*ParseDType("float16"), DType::kF16);
  EXPECT_FALSE(ParseDType("f8").ok());
  EXPECT_EQ(*ParseLayout("nhd"), Layout::kNHD);
  EXPECT_FALSE(ParseLayout("HDN").ok());
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
}

// Inputs covering normals, subnormals of both formats, ties, overflow, Inf and NaN; odd length so
// the vector loops' scalar tails run too.
std::vector<float> TrickyFloats() {
  std::vector<float> v;
  for (uint32_t i = 0; i < 20011; ++i) {
    uint32_t b = i * 2654435761u;  // spread over all bit patterns
    v.push_back(FromBits(b));
  }
  for (float f : {0.0f, -0.0f, 1.0f, 65504.0f, 65520.0f, 1e-8f, -1e-8f, 5.96e-8f,
                  std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min(), FromBits(0x3f808000u),
                  FromBits(0x3f818000u), 1.0f + std::ldexp(1.0f, -11)}) {
    v.push_back(f);
  }
  return v;
}

TEST(ConvertTest, BulkMatchesScalarBitForBit) {
  const std::vector<float> in = TrickyFloats();
  for (DType t : {DType::kF16, DType::kBF16, DType::kF32}) {
    std::vector<uint8_t> fast(in.size() * DTypeSize(t)), slow(fast.size());
    FromFloat(in.data(), t, in.size(), fast.data());
    internal::FromFloatScalar(in.data(), t, in.size(), slow.data());
    std::vector<float> back_fast(in.size()), back_slow(in.size());
    ToFloat(fast.data(), t, in.size(), back_fast.data());
    internal::ToFloatScalar(slow.data(), t, in.size(), back_slow.data());
    for (size_t i = 0; i < in.size(); ++i) {
      if (std::isnan(in[i])) {
        EXPECT_TRUE(std::isnan(back_fast[i])) << DTypeName(t) << " " << i;
        continue;
      }
      ASSERT_EQ(Bits(back_fast[i]), Bits(back_slow[i])) << DTypeName(t) << " in=" << in[i];
      ASSERT_EQ(Bits(back_fast[i]), Bits(LoadAsFloat(slow.data(), t, i)));
    }
  }
}

TEST(ConvertTest, ToFloatIsExactForEveryHalfAndBFloat16) {
  std::vector<uint16_t> all(0x10000);
  for (uint32_t i = 0; i < all.size(); ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> out(all.size());
  ToFloat(all.data(), DType::kF16, all.size(), out.data());
  for (uint32_t i = 0; i < all.size(); ++i) {
    const float want = HalfToFloat(all[i]);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(out[i]));
    } else {
      ASSERT_EQ(Bits(out[i]), Bits(want)) << i;
    }
  }
  ToFloat(all.data(), DType::kBF16, all.size(), out.data());
  for (uint32_t i = 0; i < all.size(); ++i) ASSERT_EQ(Bits(out[i]), i << 16);
}

TEST(ConvertTest, RowsToFloatReadsStridedRows) {
  // 3 rows of 5 elements taken from a buffer with row stride 8 (e.g. one head of an NHD tensor).
  std::vector<uint16_t> src(3 * 8);
  for (size_t i = 0; i < src.size(); ++i) src[i] = FloatToHalf(static_cast<float>(i));
  std::vector<float> dst(15, -1.0f);
  RowsToFloat(src.data(), DType::kF16, 8, 3, 5, dst.data());
  for (int r = 0; r < 3; ++r) {
    for (int c = 0; c < 5; ++c) EXPECT_EQ(dst[r * 5 + c], static_cast<float>(r * 8 + c));
  }
}

}  // namespace
}  // namespace kvc

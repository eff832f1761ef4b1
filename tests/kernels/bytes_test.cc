#include "kvc/bytes.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace kvc {
namespace {

TEST(ByteVectorTest, ToByteVectorCopiesEveryByte) {
  std::vector<uint8_t> src(1000);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 7 + 3);
  const ByteVector copy = ToByteVector(src);
  ASSERT_EQ(copy.size(), src.size());
  EXPECT_TRUE(std::equal(copy.begin(), copy.end(), src.begin()));
  EXPECT_TRUE(ToByteVector({}).empty());
}

// Only the no-value resize skips initialisation; everything that is given values still uses them,
// and growing keeps the bytes already there.
TEST(ByteVectorTest, ExplicitValuesAndExistingBytesAreKept) {
  ByteVector v(5, 0xab);
  EXPECT_EQ(v, ByteVector({0xab, 0xab, 0xab, 0xab, 0xab}));
  v.resize(8, 0x11);
  EXPECT_EQ(v, ByteVector({0xab, 0xab, 0xab, 0xab, 0xab, 0x11, 0x11, 0x11}));
  v[0] = 1;
  v.resize(1 << 20);  // reallocates; the first 8 bytes move with it
  EXPECT_EQ(ByteVector(v.begin(), v.begin() + 8),
            ByteVector({1, 0xab, 0xab, 0xab, 0xab, 0x11, 0x11, 0x11}));
  v.assign(3, 0);
  EXPECT_EQ(v, ByteVector({0, 0, 0}));
}

TEST(ByteVectorTest, MoveKeepsTheBuffer) {
  ByteVector a(64);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<uint8_t>(i);
  const uint8_t* data = a.data();
  ByteVector b = std::move(a);
  EXPECT_EQ(b.data(), data);
  ByteVector c;
  c = std::move(b);  // the allocators compare equal, so move assignment steals the buffer
  EXPECT_EQ(c.data(), data);
  EXPECT_EQ(c[63], 63);
}

}  // namespace
}  // namespace kvc

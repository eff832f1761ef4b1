// kvc/checked_math.h against 128-bit references, and a property test of ValidateShape over random
// huge shapes: a shape either is rejected or every element count the engine derives from it is
// exact and within kMaxLayerElements; a count past 64 bits is reported naming its factors.
#include "kvc/checked_math.h"

#include <cstdint>
#include <limits>
#include <random>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/layer.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using u128 = unsigned __int128;

constexpr u128 kU64Max = std::numeric_limits<uint64_t>::max();

// Mostly log-uniform values in [0, 2^bits] so that small, large and boundary values all occur.
uint64_t RandomValue(std::mt19937_64& rng, int bits) {
  switch (rng() % 8) {
    case 0:
      return 0;
    case 1:
      return uint64_t{1} << (rng() % bits);
    case 2:
      return (uint64_t{1} << (rng() % bits)) - 1;
    default: {
      const int b = static_cast<int>(rng() % (bits + 1));
      return b == 64 ? rng() : rng() & ((uint64_t{1} << b) - 1);
    }
  }
}

TEST(CheckedMathTest, MulAndAddMatchA128BitReference) {
  std::mt19937_64 rng(20261201);
  for (int i = 0; i < 100000; ++i) {
    const uint64_t a = RandomValue(rng, 64), b = RandomValue(rng, 64);
    const u128 product = static_cast<u128>(a) * b, sum = static_cast<u128>(a) + b;
    const std::optional<uint64_t> mul = CheckedMul(a, b), add = CheckedAdd(a, b);
    ASSERT_EQ(mul.has_value(), product <= kU64Max) << a << " * " << b;
    if (mul) {
      ASSERT_EQ(*mul, static_cast<uint64_t>(product));
    }
    ASSERT_EQ(add.has_value(), sum <= kU64Max) << a << " + " << b;
    if (add) {
      ASSERT_EQ(*add, static_cast<uint64_t>(sum));
    }
    uint64_t acc = RandomValue(rng, 64);
    const uint64_t before = acc;
    const u128 want = static_cast<u128>(before) + product;
    const bool ok = CheckedMulAdd(a, b, &acc);
    ASSERT_EQ(ok, product <= kU64Max && want <= kU64Max);
    ASSERT_EQ(acc, ok ? static_cast<uint64_t>(want) : before);  // unchanged on overflow
  }
  EXPECT_EQ(CheckedMul(UINT64_MAX, 1), UINT64_MAX);
  EXPECT_FALSE(CheckedMul(uint64_t{1} << 32, uint64_t{1} << 32));
  EXPECT_FALSE(CheckedAdd(UINT64_MAX, 1));
}

TEST(CheckedMathTest, ProductOfManyFactors) {
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100000; ++i) {
    const uint64_t a = RandomValue(rng, 32), b = RandomValue(rng, 32), c = RandomValue(rng, 32),
                   d = RandomValue(rng, 9);
    // The exact product of four factors below 2^32 fits in 128 bits.
    const u128 want = static_cast<u128>(a) * b * c * d;
    const std::optional<uint64_t> got = CheckedProduct({a, b, c, d});
    ASSERT_EQ(got.has_value(), want <= kU64Max) << a << "*" << b << "*" << c << "*" << d;
    if (got) {
      ASSERT_EQ(*got, static_cast<uint64_t>(want));
    }
    absl::StatusOr<uint64_t> named = CheckedProduct("f", {{"a", a}, {"b", b}, {"c", c}, {"d", d}});
    ASSERT_EQ(named.ok(), want <= kU64Max);
    if (named.ok()) {
      ASSERT_EQ(*named, static_cast<uint64_t>(want));
    } else {
      ASSERT_EQ(named.status().code(), absl::StatusCode::kInvalidArgument);
      ASSERT_EQ(named.status().message(),
                absl::StrCat("f: a*b*c*d = ", a, "*", b, "*", c, "*", d, " overflows 64 bits"));
    }
  }
  // A zero factor makes the product 0 even after an overflowing prefix.
  EXPECT_EQ(CheckedProduct({UINT64_MAX, 2, 0}), 0u);
  EXPECT_EQ(CheckedProduct({}), 1u);
}

TEST(CheckedMathTest, MessageNamesTheProduct) {
  absl::StatusOr<uint64_t> p = CheckedProduct(
      "header.shape", {{"num_kv_heads", 901467965}, {"seq_len", 213156309}, {"head_dim", 96}});
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(p.status().message(),
            "header.shape: num_kv_heads*seq_len*head_dim = 901467965*213156309*96 overflows 64 "
            "bits");
}

// Random shapes with every dimension up to 2^30 (head_dim in [8, 307], so that some fail its
// range check): ValidateShape accepts exactly the shapes whose exact counts are within the limit,
// and reports a count past 64 bits naming its factors.
TEST(ValidateShapePropertyTest, RandomHugeShapesAreRejectedOrFitExactly) {
  std::mt19937_64 rng(42);
  int accepted = 0, overflowed = 0;
  for (int i = 0; i < 50000; ++i) {
    // Every other shape is made of dimensions near 2^30, whose products mostly pass 2^64.
    const bool huge = i % 2 == 1;
    auto dim = [&rng, huge] {
      return static_cast<int>(huge ? (1u << 30) - rng() % (1u << 28)
                                   : std::max<uint64_t>(1, RandomValue(rng, 30)));
    };
    LayerShape s;
    s.num_kv_heads = dim();
    const uint64_t group = std::max<uint64_t>(1, RandomValue(rng, 30));
    const u128 q_heads = static_cast<u128>(s.num_kv_heads) * group;
    s.num_q_heads = q_heads <= (1u << 30) ? static_cast<int>(q_heads) : s.num_kv_heads;
    s.seq_len = dim();
    s.head_dim = kMinHeadDim + static_cast<int>(rng() % 300);  // some above kMaxHeadDim
    s.obs_window = static_cast<int>(rng() % (static_cast<uint64_t>(s.seq_len) + 1));
    const u128 kv = static_cast<u128>(s.num_kv_heads) * s.seq_len * s.head_dim;
    const u128 q = static_cast<u128>(s.num_q_heads) * s.obs_window * s.head_dim;
    const absl::Status st = ValidateShape(s);
    const bool dims_ok = s.head_dim <= kMaxHeadDim;
    const bool should_pass = dims_ok && kv <= kMaxLayerElements && q <= kMaxLayerElements;
    ASSERT_EQ(st.ok(), should_pass)
        << st << " for Hkv " << s.num_kv_heads << " Hq " << s.num_q_heads << " S " << s.seq_len
        << " D " << s.head_dim << " W " << s.obs_window;
    if (st.ok()) {
      ++accepted;
      // Everything the engine derives from an accepted shape is far from 64 bits: the largest
      // tensor in bytes, the whole compact blob at fp32 with headers and per-head metadata.
      const u128 per_head = 64 + 4 * static_cast<u128>(s.seq_len) + 8 * s.head_dim;
      ASSERT_LT(kv * 4 + s.num_kv_heads * per_head, static_cast<u128>(1) << 40);
    } else if (dims_ok && kv > kU64Max) {
      ++overflowed;
      ASSERT_THAT(std::string(st.message()),
                  HasSubstr(absl::StrCat("shape: num_kv_heads*seq_len*head_dim = ", s.num_kv_heads,
                                         "*", s.seq_len, "*", s.head_dim, " overflows 64 bits")));
    } else if (dims_ok && kv > kMaxLayerElements) {
      ASSERT_THAT(std::string(st.message()), HasSubstr("K has"));
    } else if (dims_ok && q > kU64Max) {
      ++overflowed;
      ASSERT_THAT(
          std::string(st.message()),
          HasSubstr(absl::StrCat("shape: num_q_heads*obs_window*head_dim = ", s.num_q_heads, "*",
                                 s.obs_window, "*", s.head_dim, " overflows 64 bits")));
    } else if (dims_ok) {
      ASSERT_THAT(std::string(st.message()), HasSubstr("Q_obs has"));
    }
  }
  // The generator covers both sides.
  EXPECT_GT(accepted, 1000);
  EXPECT_GT(overflowed, 10000);
}

}  // namespace
}  // namespace kvc

// The AMX logits kernel (kernels/cpu/amx_logits.h): the packed key layout against a scalar
// packing, and the logits against a double-precision reference within the stated bound
// (2^-16 of sum_d |q_d k_d| * scale) for fp16, bf16 and fp32 keys, ragged row and key counts, and
// head_dim 32..256. On a CPU without AMX every test skips, naming what the CPU has. DotLogits (the
// AVX-512 BF16 path for bf16 layers) against the same reference, within fp32 summation rounding,
// where the CPU has AVX-512 BF16.
#include "cpu/amx_logits.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>


#include "gtest/gtest.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"
#include "logits_util.h"

namespace kvc::cpu {
namespace {

#define SKIP_WITHOUT_AMX()                                                                   \
  do {                                                                                       \
    if (!amx::Usable(32)) {                                                                  \
      GTEST_SKIP() << "no AMX path here: the kernels run at " << CpuIsaDescription() << " (" \
                   << CpuFeatureList() << ")";                                               \
    }                                                                                        \
  } while (0)

using testing_logits::Random;

// Rounds every element to the given key dtype (the values a converted fp16 / bf16 cache holds).
void RoundTo(DType t, std::vector<float>* v) {
  if (t == DType::kF32) return;
  const size_t esize = DTypeSize(t);
  std::vector<uint8_t> raw(v->size() * esize);
  FromFloat(v->data(), t, v->size(), raw.data());
  ToFloat(raw.data(), t, v->size(), v->data());
}

// The AMX build is selected by the compiler's macros, which GCC and clang spell differently; a
// build without it must not be what an x86-64 compiler produces (clang builds once lacked it and
// aborted on CPUs with AMX; now such a build would quietly score without AMX).
TEST(AmxLogitsTest, BuiltWithAmxOnX86) {
#if defined(__x86_64__)
  EXPECT_TRUE(amx::Built());
#else
  EXPECT_FALSE(amx::Built());
  EXPECT_FALSE(amx::Usable(32));
#endif
}

// (PackKeys needs AVX-512 BF16 only: the AVX-512 BF16 path packs keys too.) fp32 keys with their
// lo parts; fp16 keys (one transpose of the raw pairs, then the split); bf16 keys both through the
// copy that skips the conversion (no lo) and split (lo all zero). Rows sit a stride apart with
// other heads' values between them, as in an NHD cache.
TEST(AmxLogitsTest, KeysArePackedPairInterleavedPerTile) {
  if (!amx::DotUsable(32)) {
    GTEST_SKIP() << "no AVX-512 BF16 here: the kernels run at " << CpuIsaDescription() << " ("
                 << CpuFeatureList() << ")";
  }
  const std::pair<DType, bool> cases[] = {
      {DType::kF32, true}, {DType::kF16, true}, {DType::kBF16, false}, {DType::kBF16, true}};
  for (const auto& [t, with_lo] : cases) {
    SCOPED_TRACE(std::string(DTypeName(t)) + (with_lo ? " with lo" : " without lo"));
    const int n = 37, d = 64, stride = d + 32;
    std::vector<float> k = Random(static_cast<size_t>(n) * stride, 1, 1.0f);
    if (t == DType::kF16) {
      // Values that fp16 holds exactly, down to its subnormals, whose lo parts are not zero.
      for (size_t i = 0; i < k.size(); i += 7) k[i] *= 1e-5f;
    }
    RoundTo(t, &k);
    std::vector<uint8_t> raw(k.size() * DTypeSize(t));
    FromFloat(k.data(), t, k.size(), raw.data());
    const size_t elems = amx::PackedKeyElems(n, d);
    ASSERT_EQ(elems, size_t{64} * d);
    std::vector<uint16_t> hi(elems, 0xffff), lo(elems, with_lo ? 0xffff : 0);
    amx::PackKeys(raw.data(), t, stride, n, d, hi.data(), with_lo ? lo.data() : nullptr);
    const int blocks = d / 32;
    int lo_nonzero = 0;
    for (int kt = 0; kt < 4; ++kt) {
      for (int db = 0; db < blocks; ++db) {
        for (int p = 0; p < 16; ++p) {
          for (int i = 0; i < 16; ++i) {
            for (int e = 0; e < 2; ++e) {
              const int key = kt * 16 + i, dim = db * 32 + 2 * p + e;
              const size_t at = (static_cast<size_t>(kt) * blocks + db) * 512 + p * 32 + i * 2 + e;
              const float x = key < n ? k[static_cast<size_t>(key) * stride + dim] : 0.0f;
              const uint16_t want_hi = FloatToBFloat16(x);
              float back;
              const uint32_t bits = static_cast<uint32_t>(want_hi) << 16;
              std::memcpy(&back, &bits, 4);
              ASSERT_EQ(hi[at], want_hi) << "key " << key << " dim " << dim;
              ASSERT_EQ(lo[at], FloatToBFloat16(x - back)) << "key " << key << " dim " << dim;
              lo_nonzero += lo[at] != 0;
            }
          }
        }
      }
    }
    // fp32 and fp16 keys need their lo parts; bf16 keys have none.
    if (t == DType::kBF16) {
      EXPECT_EQ(lo_nonzero, 0);
    } else {
      EXPECT_GT(lo_nonzero, n * d / 2);
    }
  }
}

TEST(AmxLogitsTest, LogitsMatchDoubleReferenceWithinTheStatedBound) {
  SKIP_WITHOUT_AMX();
  struct Case {
    int rows, n, d;
    DType keys;
  };
  const Case cases[] = {{1, 1, 32, DType::kF16},     {16, 16, 64, DType::kF16},
                        {33, 47, 64, DType::kF16},   {128, 1024, 128, DType::kF16},
                        {70, 1000, 128, DType::kBF16}, {5, 300, 256, DType::kF32},
                        {128, 129, 96, DType::kBF16}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.rows << "x" << c.n << " d " << c.d << " "
                                    << DTypeName(c.keys));
    std::vector<float> q = Random(static_cast<size_t>(c.rows) * c.d, 7 + c.n, 1.0f);
    std::vector<float> k = Random(static_cast<size_t>(c.n) * c.d, 9 + c.rows, 1.5f);
    RoundTo(c.keys, &k);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    std::vector<uint16_t> qp(2 * amx::PackedQueryElems(c.rows, c.d));
    std::vector<uint16_t> kp(2 * amx::PackedKeyElems(c.n, c.d));
    uint16_t* q_lo = qp.data() + amx::PackedQueryElems(c.rows, c.d);
    uint16_t* k_lo =
        c.keys == DType::kBF16 ? nullptr : kp.data() + amx::PackedKeyElems(c.n, c.d);
    amx::PackQueries(q.data(), c.rows, c.d, scale, qp.data(), q_lo);
    // Keys in their dtype, as the cache holds them (exact: k was rounded to it).
    std::vector<uint8_t> raw(k.size() * DTypeSize(c.keys));
    FromFloat(k.data(), c.keys, k.size(), raw.data());
    amx::PackKeys(raw.data(), c.keys, c.d, c.n, c.d, kp.data(), k_lo);
    // A guard column on each side of every row: the kernel writes [0, n) of each row only.
    const size_t ldc = static_cast<size_t>(c.n) + 2;
    std::vector<float> out(static_cast<size_t>(c.rows) * ldc, -7.0f);
    amx::Logits(qp.data(), q_lo, c.rows, kp.data(), k_lo, c.n, c.d, out.data() + 1, ldc);
    double worst = 0;
    int single_over = 0;  // logits that one bf16 part per operand would get outside the bound
    for (int r = 0; r < c.rows; ++r) {
      EXPECT_EQ(out[r * ldc], -7.0f);
      EXPECT_EQ(out[r * ldc + ldc - 1], -7.0f);
      for (int j = 0; j < c.n; ++j) {
        double dot = 0, mag = 0, single = 0;
        for (int e = 0; e < c.d; ++e) {
          const float qe = q[static_cast<size_t>(r) * c.d + e];
          const float ke = k[static_cast<size_t>(j) * c.d + e];
          const double p = static_cast<double>(qe) * ke;
          dot += p;
          mag += std::fabs(p);
          single += static_cast<double>(BFloat16ToFloat(FloatToBFloat16(qe * scale))) *
                    BFloat16ToFloat(FloatToBFloat16(ke));
        }
        const double want = dot * scale, bound = std::ldexp(mag * scale, -16) + 1e-6;
        const double err = std::fabs(out[r * ldc + 1 + j] - want);
        ASSERT_LE(err, bound) << "row " << r << " key " << j;
        worst = std::max(worst, err / bound);
        if (std::fabs(single - want) > bound) ++single_over;
      }
    }
    // The bound is not vacuous: plain bf16 products (no lo parts) break it on most logits.
    if (c.rows * c.n >= 256) {
      EXPECT_GT(single_over, c.rows * c.n / 4);
    }
    EXPECT_LE(worst, 1.0);
  }
}

// The AVX-512 BF16 path (bf16 queries and keys, exact products): the fp32 sum of exact products
// differs from the double reference by the rounding of D additions and the final scale, bounded
// by (D + 2) * 2^-24 * sum_d |q_d k_d| * scale. Ragged row counts exercise every row block
// (1..12) and ragged key counts the masked tail of a 32-key group.
TEST(AmxLogitsTest, DotLogitsOfBf16ValuesMatchDoubleReference) {
  if (!amx::DotUsable(32)) {
    GTEST_SKIP() << "no AVX-512 BF16 path here: the kernels run at " << CpuIsaDescription()
                 << " (" << CpuFeatureList() << ")";
  }
  struct Case {
    int rows, n, d;
  };
  const Case cases[] = {{1, 1, 32},   {11, 17, 64},   {12, 32, 64},    {13, 33, 128},
                        {25, 47, 96}, {128, 1024, 128}, {37, 300, 256}, {7, 15, 32}};
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.rows << "x" << c.n << " d " << c.d);
    std::vector<float> q = Random(static_cast<size_t>(c.rows) * c.d, 3 + c.n, 1.0f);
    std::vector<float> k = Random(static_cast<size_t>(c.n) * c.d, 5 + c.rows, 1.5f);
    RoundTo(DType::kBF16, &q);
    RoundTo(DType::kBF16, &k);
    const float scale = 1.0f / std::sqrt(static_cast<float>(c.d));
    std::vector<uint16_t> qb(q.size()), kb(k.size());
    FromFloat(q.data(), DType::kBF16, q.size(), qb.data());
    FromFloat(k.data(), DType::kBF16, k.size(), kb.data());
    std::vector<uint16_t> kp(amx::PackedKeyElems(c.n, c.d), 0xffff);
    amx::PackKeys(kb.data(), DType::kBF16, c.d, c.n, c.d, kp.data(), nullptr);
    const size_t ldc = static_cast<size_t>(c.n) + 2;
    std::vector<float> out(static_cast<size_t>(c.rows) * ldc, -7.0f);
    amx::DotLogits(qb.data(), c.rows, kp.data(), c.n, c.d, scale, out.data() + 1, ldc);
    testing_logits::ExpectLogitsWithinFp32Rounding(q.data(), k.data(), c.rows, c.n, c.d, scale,
                                                   out.data(), ldc);
  }
}

}  // namespace
}  // namespace kvc::cpu

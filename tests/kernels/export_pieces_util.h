// Checks kvc::DenseExporter's contract (kvc/compact.h) on one layer: written piece by piece, each
// piece finishes the prefix of K and of V that KeyBytesAfter / ValueBytesAfter name, equal to
// the one-shot export's bytes, and no later piece writes those bytes again.
#ifndef KVC_TESTS_KERNELS_EXPORT_PIECES_UTIL_H_
#define KVC_TESTS_KERNELS_EXPORT_PIECES_UTIL_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "gtest/gtest.h"
#include "kvc/compact.h"

namespace kvc::testing_pack {

// `want` is the one-shot export of the same layer. Each range a piece finishes is compared with
// `want`, then overwritten with a marker that must still be there once every piece is written.
inline void ExpectPiecesFinishPrefixes(DenseExporter ex, const DenseLayer& want) {
  DenseLayer& out = *ex.layer();
  ASSERT_EQ(out.k.size(), want.k.size());
  ASSERT_EQ(out.v.size(), want.v.size());
  ASSERT_EQ(out.positions.size(), want.positions.size());
  EXPECT_EQ(out.n_kept, want.n_kept);
  EXPECT_EQ(out.counts, want.counts);
  constexpr uint8_t kFinished = 0xcd;
  uint64_t k_done = 0, v_done = 0;
  for (int n = 1; ex.WriteNext(); ++n) {
    ASSERT_EQ(ex.written(), n);
    const uint64_t k_end = ex.KeyBytesAfter(n), v_end = ex.ValueBytesAfter(n);
    ASSERT_GE(k_end, k_done);
    ASSERT_GE(v_end, v_done);
    ASSERT_LE(k_end, out.k.size());
    ASSERT_LE(v_end, out.v.size());
    EXPECT_EQ(std::memcmp(out.k.data() + k_done, want.k.data() + k_done, k_end - k_done), 0)
        << "keys finished by piece " << n;
    EXPECT_EQ(std::memcmp(out.v.data() + v_done, want.v.data() + v_done, v_end - v_done), 0)
        << "values finished by piece " << n;
    std::memset(out.k.data() + k_done, kFinished, k_end - k_done);
    std::memset(out.v.data() + v_done, kFinished, v_end - v_done);
    k_done = k_end;
    v_done = v_end;
  }
  EXPECT_EQ(ex.written(), ex.pieces());
  EXPECT_FALSE(ex.WriteNext());
  EXPECT_EQ(k_done, out.k.size());
  EXPECT_EQ(v_done, out.v.size());
  const auto rewritten = [&](const ByteVector& b) {
    return std::count_if(b.begin(), b.end(), [](uint8_t x) { return x != kFinished; });
  };
  EXPECT_EQ(rewritten(out.k), 0) << "key bytes written again after their piece";
  EXPECT_EQ(rewritten(out.v), 0) << "value bytes written again after their piece";
  EXPECT_EQ(out.positions, want.positions);
}

}  // namespace kvc::testing_pack

#endif  // KVC_TESTS_KERNELS_EXPORT_PIECES_UTIL_H_

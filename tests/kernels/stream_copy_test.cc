// StreamCopy (kvc/stream_copy.h) must copy exactly what memcpy copies and touch nothing else, for
// every length around its thresholds and every alignment of source and destination: the partial
// lines at either end take ordinary stores, the whole lines in between non-temporal ones.
#include "kvc/stream_copy.h"

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace kvc {
namespace {

TEST(StreamCopyTest, EqualsMemcpyForEveryLengthAndAlignment) {
  std::mt19937 rng(11);
  std::vector<uint8_t> src(300000);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  std::vector<size_t> lengths = {0, 1, 63, 64, 65, kMinStreamBytes - 1, kMinStreamBytes,
                                 kMinStreamBytes + 1, kMinStreamBytes + 63, 65536, 65536 + 17,
                                 262144 + 5};
  for (int i = 0; i < 20; ++i) lengths.push_back(rng() % 200000);
  std::vector<uint8_t> dst(src.size() + 256), want(dst.size());
  for (size_t n : lengths) {
    for (size_t src_off : {0, 1, 13, 64}) {
      for (size_t dst_off : {0, 7, 32, 63}) {
        if (src_off + n > src.size() || dst_off + n + 64 > dst.size()) continue;
        std::fill(dst.begin(), dst.end(), uint8_t{0xA5});
        std::fill(want.begin(), want.end(), uint8_t{0xA5});
        std::memcpy(want.data() + dst_off, src.data() + src_off, n);
        StreamCopy(dst.data() + dst_off, src.data() + src_off, n);
        ASSERT_EQ(dst, want) << "n=" << n << " src_off=" << src_off << " dst_off=" << dst_off;
      }
    }
  }
}

}  // namespace
}  // namespace kvc

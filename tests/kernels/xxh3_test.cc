// kvc::Xxh3 and each of its instruction-set builds against libxxhash's XXH3_64bits_withSeed:
// every length from 0 to past XXH3's short/medium/long boundaries and its stripe and block sizes,
// odd alignments, and several seeds, including the 64 KiB blocks kvcd hashes.
#include "kvc/xxh3.h"

#include <xxhash.h>

#include <algorithm>

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvc/cpu_isa.h"

namespace kvc {
namespace {

std::vector<uint8_t> RandomBytes(size_t n) {
  std::vector<uint8_t> b(n);
  std::mt19937_64 rng(42);
  for (auto& x : b) x = static_cast<uint8_t>(rng());
  return b;
}

std::vector<size_t> Lengths() {
  std::vector<size_t> n;
  for (size_t i = 0; i <= 300; ++i) n.push_back(i);  // 0-16, 17-128, 129-240, long from 241
  for (size_t i :
       {511, 512, 513, 1023, 1024, 1025, 4095, 4096, 4097, 65535, 65536, 65537, 1000003}) {
    n.push_back(i);
  }
  return n;
}

constexpr uint64_t kSeeds[] = {0, 1, (uint64_t{7} << 32) + 3, ~uint64_t{0}};

TEST(Xxh3Test, EqualsLibxxhashForEveryLengthAlignmentAndSeed) {
  const std::vector<uint8_t> data = RandomBytes((1 << 20) + 64);
  for (size_t n : Lengths()) {
    for (size_t align : {0, 1, 7, 33}) {
      for (uint64_t seed : kSeeds) {
        const uint8_t* p = data.data() + align;
        ASSERT_EQ(Xxh3(p, n, seed), XXH3_64bits_withSeed(p, n, seed))
            << "n=" << n << " align=" << align << " seed=" << seed;
      }
    }
  }
}

TEST(Xxh3Test, EachBuildEqualsLibxxhash) {
  const std::vector<uint8_t> data = RandomBytes((1 << 20) + 64);
  bool avx2 = false, avx512 = false;
  for (size_t n : Lengths()) {
    for (uint64_t seed : kSeeds) {
      const uint8_t* p = data.data() + 5;
      const uint64_t want = XXH3_64bits_withSeed(p, n, seed);
      ASSERT_EQ(internal::Xxh3Baseline(p, n, seed), want) << "n=" << n;
      uint64_t got = 0;
      if (internal::Xxh3Avx2(p, n, seed, &got)) {
        avx2 = true;
        ASSERT_EQ(got, want) << "AVX2 n=" << n << " seed=" << seed;
      }
      if (internal::Xxh3Avx512(p, n, seed, &got)) {
        avx512 = true;
        ASSERT_EQ(got, want) << "AVX-512 n=" << n << " seed=" << seed;
      }
    }
  }
  if (!avx2) std::printf("note: no AVX2 on this CPU; that build was not exercised\n");
  if (!avx512) std::printf("note: no AVX-512F on this CPU; that build was not exercised\n");
}

// Xxh3Stream fed in pieces equals the one-shot hash of the whole, for every split tried (pieces
// of 1 byte to past XXH3's internal 256-byte buffer and 1 KiB stripes block, at odd offsets), on
// each build the CPU has (capped in turn), including the 64 KiB blocks kvcd hashes as they arrive.
TEST(Xxh3Test, StreamEqualsOneShotForEverySplitAndBuild) {
  const std::vector<uint8_t> data = RandomBytes((1 << 18) + 64);
  std::mt19937 rng(3);
  const CpuIsa saved = CpuIsaCap();
  for (CpuIsa cap : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    SetCpuIsaCap(cap);
    for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{240}, size_t{241}, size_t{4097},
                     size_t{65536}, size_t{65536 + 3}, size_t{1} << 18}) {
      for (uint64_t seed : kSeeds) {
        for (size_t max_piece : {size_t{1}, size_t{100}, size_t{300}, size_t{5000},
                                 size_t{70000}}) {
          if (max_piece == 1 && n > 5000) continue;  // byte by byte only on the short inputs
          const uint8_t* p = data.data() + 3;
          Xxh3Stream stream;
          stream.Reset(seed);
          for (size_t at = 0; at < n;) {
            const size_t take = std::min<size_t>(n - at, 1 + rng() % max_piece);
            stream.Update(p + at, take);
            at += take;
          }
          ASSERT_EQ(stream.Digest(), XXH3_64bits_withSeed(p, n, seed))
              << "cap=" << CpuIsaName(cap) << " n=" << n << " seed=" << seed
              << " pieces up to " << max_piece;
        }
      }
    }
  }
  SetCpuIsaCap(saved);
}

TEST(Xxh3Test, ChangesWithAnyFlippedBit) {
  std::vector<uint8_t> data = RandomBytes(65536);
  const uint64_t h = Xxh3(data.data(), data.size(), 9);
  for (size_t byte : {size_t{0}, size_t{4095}, size_t{65535}}) {
    data[byte] ^= 0x10;
    EXPECT_NE(Xxh3(data.data(), data.size(), 9), h) << "byte " << byte;
    data[byte] ^= 0x10;
  }
  EXPECT_EQ(Xxh3(data.data(), data.size(), 9), h);
}

}  // namespace
}  // namespace kvc

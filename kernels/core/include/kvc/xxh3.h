// XXH3-64 on the widest vector unit this CPU has. The output is XXH3's, the same as
// XXH3_64bits_withSeed from libxxhash for every input and seed; only the speed differs. Debian's
// libxxhash is built for baseline x86-64 (SSE2, ~20 GB/s here); the AVX2 and AVX-512 builds of
// the same code run about 3x and 4x faster on data in cache, which matters because kvcd hashes
// every byte it stores and every byte it serves.
#ifndef KVC_XXH3_H_
#define KVC_XXH3_H_

#include <cstddef>
#include <cstdint>

namespace kvc {

uint64_t Xxh3(const void* data, size_t size, uint64_t seed);

// XXH3-64 of data that arrives in pieces: Reset(seed), then Update with each piece in order, then
// Digest() equals Xxh3(all pieces concatenated, seed) for any split. It lets a receiver hash bytes
// from the buffer they arrived in, while they are in cache, when its hash blocks do not line up
// with the pieces. Each stream keeps to the build its Reset picked. Thread-compatible.
class Xxh3Stream {
 public:
  Xxh3Stream() = default;
  Xxh3Stream(const Xxh3Stream&) = delete;
  Xxh3Stream& operator=(const Xxh3Stream&) = delete;

  void Reset(uint64_t seed);
  void Update(const void* data, size_t size);
  uint64_t Digest() const;

  static constexpr size_t kStateBytes = 640;  // >= sizeof(XXH3_state_t), checked in xxh3.cc

 private:
  enum class Build : uint8_t { kBaseline, kAvx2, kAvx512 };
  // Zeroed: XXH3's reset reads the previous seed and secret pointer (XXH3_INITSTATE's zeros).
  alignas(64) unsigned char state_[kStateBytes] = {};
  Build build_ = Build::kBaseline;
};

namespace internal {
// The instruction-set builds, for tests: false (and nothing done) when this CPU or build lacks
// the instruction set, else *hash is set.
bool Xxh3Avx2(const void* data, size_t size, uint64_t seed, uint64_t* hash);
bool Xxh3Avx512(const void* data, size_t size, uint64_t seed, uint64_t* hash);
uint64_t Xxh3Baseline(const void* data, size_t size, uint64_t seed);
}  // namespace internal

}  // namespace kvc

#endif  // KVC_XXH3_H_

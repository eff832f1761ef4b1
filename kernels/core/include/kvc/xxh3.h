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

namespace internal {
// The instruction-set builds, for tests: false (and nothing done) when this CPU or build lacks
// the instruction set, else *hash is set.
bool Xxh3Avx2(const void* data, size_t size, uint64_t seed, uint64_t* hash);
bool Xxh3Avx512(const void* data, size_t size, uint64_t seed, uint64_t* hash);
uint64_t Xxh3Baseline(const void* data, size_t size, uint64_t seed);
}  // namespace internal

}  // namespace kvc

#endif  // KVC_XXH3_H_

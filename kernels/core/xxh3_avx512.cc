// XXH3 built for AVX-512: only this file gets the instruction-set flag (kernels/CMakeLists.txt).
#include "core/xxh3_isa.h"

#if defined(__AVX512F__)
#define XXH_INLINE_ALL  // static copies in this file only, compiled for its target
#include <xxhash.h>
#endif

namespace kvc::internal {

#if defined(__AVX512F__)
bool Xxh3Avx512Built() { return true; }
uint64_t Xxh3Avx512Unchecked(const void* data, size_t size, uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}
void Xxh3Avx512Reset(void* state, uint64_t seed) {
  (void)XXH3_64bits_reset_withSeed(static_cast<XXH3_state_t*>(state), seed);
}
void Xxh3Avx512Update(void* state, const void* data, size_t size) {
  (void)XXH3_64bits_update(static_cast<XXH3_state_t*>(state), data, size);
}
uint64_t Xxh3Avx512Digest(const void* state) {
  return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state));
}
#else
bool Xxh3Avx512Built() { return false; }
uint64_t Xxh3Avx512Unchecked(const void*, size_t, uint64_t) { return 0; }
void Xxh3Avx512Reset(void*, uint64_t) {}
void Xxh3Avx512Update(void*, const void*, size_t) {}
uint64_t Xxh3Avx512Digest(const void*) { return 0; }
#endif

}  // namespace kvc::internal

// The baseline build of XXH3 (what the compiler targets by default: SSE2 on x86-64), the CPU
// checks, and the run-time choice among the builds.
#include "kvc/xxh3.h"

#include "core/xxh3_isa.h"
#include "kvc/cpu_isa.h"

#define XXH_INLINE_ALL  // static copies in this file only, compiled for its target
#include <xxhash.h>

namespace kvc {
namespace internal {
namespace {

// The cap (kvc/cpu_isa.h) applies to the hash too, although every build gives the same hash.
bool Avx2Usable() { return Xxh3Avx2Built() && CpuIsaAtLeast(CpuIsa::kAvx2); }

bool Avx512Usable() { return Xxh3Avx512Built() && CpuIsaAtLeast(CpuIsa::kAvx512); }

}  // namespace

uint64_t Xxh3Baseline(const void* data, size_t size, uint64_t seed) {
  return XXH3_64bits_withSeed(data, size, seed);
}

bool Xxh3Avx2(const void* data, size_t size, uint64_t seed, uint64_t* hash) {
  if (!Avx2Usable()) return false;
  *hash = Xxh3Avx2Unchecked(data, size, seed);
  return true;
}

bool Xxh3Avx512(const void* data, size_t size, uint64_t seed, uint64_t* hash) {
  if (!Avx512Usable()) return false;
  *hash = Xxh3Avx512Unchecked(data, size, seed);
  return true;
}

}  // namespace internal

uint64_t Xxh3(const void* data, size_t size, uint64_t seed) {
  if (internal::Avx512Usable()) return internal::Xxh3Avx512Unchecked(data, size, seed);
  if (internal::Avx2Usable()) return internal::Xxh3Avx2Unchecked(data, size, seed);
  return internal::Xxh3Baseline(data, size, seed);
}

}  // namespace kvc

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

static_assert(sizeof(XXH3_state_t) <= Xxh3Stream::kStateBytes && alignof(XXH3_state_t) <= 64);

void Xxh3Stream::Reset(uint64_t seed) {
  if (internal::Avx512Usable()) {
    build_ = Build::kAvx512;
    internal::Xxh3Avx512Reset(state_, seed);
  } else if (internal::Avx2Usable()) {
    build_ = Build::kAvx2;
    internal::Xxh3Avx2Reset(state_, seed);
  } else {
    build_ = Build::kBaseline;
    (void)XXH3_64bits_reset_withSeed(reinterpret_cast<XXH3_state_t*>(state_), seed);
  }
}

void Xxh3Stream::Update(const void* data, size_t size) {
  switch (build_) {
    case Build::kAvx512:
      return internal::Xxh3Avx512Update(state_, data, size);
    case Build::kAvx2:
      return internal::Xxh3Avx2Update(state_, data, size);
    case Build::kBaseline:
      (void)XXH3_64bits_update(reinterpret_cast<XXH3_state_t*>(state_), data, size);
      return;
  }
}

uint64_t Xxh3Stream::Digest() const {
  switch (build_) {
    case Build::kAvx512:
      return internal::Xxh3Avx512Digest(state_);
    case Build::kAvx2:
      return internal::Xxh3Avx2Digest(state_);
    case Build::kBaseline:
      break;
  }
  return XXH3_64bits_digest(reinterpret_cast<const XXH3_state_t*>(state_));
}

uint64_t Xxh3(const void* data, size_t size, uint64_t seed) {
  if (internal::Avx512Usable()) return internal::Xxh3Avx512Unchecked(data, size, seed);
  if (internal::Avx2Usable()) return internal::Xxh3Avx2Unchecked(data, size, seed);
  return internal::Xxh3Baseline(data, size, seed);
}

}  // namespace kvc

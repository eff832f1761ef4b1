// The baseline build of XXH3 (what the compiler targets by default: SSE2 on x86-64), the CPU
// checks, and the run-time choice among the builds.
#include "kvc/xxh3.h"

#include "core/xxh3_isa.h"

#define XXH_INLINE_ALL  // static copies in this file only, compiled for its target
#include <xxhash.h>

namespace kvc {
namespace internal {
namespace {

bool CpuHasAvx2() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

bool CpuHasAvx512() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

bool Avx2Usable() {
  static const bool usable = Xxh3Avx2Built() && CpuHasAvx2();
  return usable;
}

bool Avx512Usable() {
  static const bool usable = Xxh3Avx512Built() && CpuHasAvx512();
  return usable;
}

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
  using Fn = uint64_t (*)(const void*, size_t, uint64_t);
  static const Fn fn = internal::Avx512Usable() ? internal::Xxh3Avx512Unchecked
                       : internal::Avx2Usable() ? internal::Xxh3Avx2Unchecked
                                                : internal::Xxh3Baseline;
  return fn(data, size, seed);
}

}  // namespace kvc

// The instruction-set builds of XXH3 (xxh3_avx2.cc, xxh3_avx512.cc). Each file alone is compiled
// with its instruction set enabled, so nothing in it may run before the CPU was checked (the
// checks live in xxh3.cc, compiled for the baseline).
#ifndef KVC_KERNELS_CORE_XXH3_ISA_H_
#define KVC_KERNELS_CORE_XXH3_ISA_H_

#include <cstddef>
#include <cstdint>

namespace kvc::internal {

// False where the compiler could not build that instruction set (another architecture).
bool Xxh3Avx2Built();
bool Xxh3Avx512Built();
// Require a CPU with the instruction set and a build that has it.
uint64_t Xxh3Avx2Unchecked(const void* data, size_t size, uint64_t seed);
uint64_t Xxh3Avx512Unchecked(const void* data, size_t size, uint64_t seed);

}  // namespace kvc::internal

#endif  // KVC_KERNELS_CORE_XXH3_ISA_H_

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
// The streaming form on `state`, an XXH3_state_t (Xxh3Stream's storage, checked in xxh3.cc):
// every call on one state must go to the same build.
void Xxh3Avx2Reset(void* state, uint64_t seed);
void Xxh3Avx2Update(void* state, const void* data, size_t size);
uint64_t Xxh3Avx2Digest(const void* state);
void Xxh3Avx512Reset(void* state, uint64_t seed);
void Xxh3Avx512Update(void* state, const void* data, size_t size);
uint64_t Xxh3Avx512Digest(const void* state);

}  // namespace kvc::internal

#endif  // KVC_KERNELS_CORE_XXH3_ISA_H_

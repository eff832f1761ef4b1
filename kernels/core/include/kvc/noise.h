// Counter-based random numbers shared by the CPU and CUDA backends, so that the same seed selects
// the same tokens on either device: each value is a pure function of (seed, layer, head, row, col).
#ifndef KVC_NOISE_H_
#define KVC_NOISE_H_

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__)
#define KVC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVC_HOST_DEVICE inline
#endif

namespace kvc {

// splitmix64 finalizer: a bijective mix with good avalanche.
KVC_HOST_DEVICE uint64_t Mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in the open interval (0, 1), from 24 random bits (exactly representable in float).
KVC_HOST_DEVICE float CounterUniform(uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                                     uint32_t col) {
  uint64_t h = Mix64(seed ^ Mix64((uint64_t{layer} << 32) | head));
  h = Mix64(h ^ ((uint64_t{row} << 32) | col));
  return (static_cast<float>(h >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// Standard Gumbel(0, 1) sample: -log(-log(u)).
KVC_HOST_DEVICE float CounterGumbel(uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                                    uint32_t col) {
  const float u = CounterUniform(seed, layer, head, row, col);
  return -logf(-logf(u));
}

}  // namespace kvc

#endif  // KVC_NOISE_H_

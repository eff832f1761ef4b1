// Counter-based random numbers shared by the CPU and CUDA backends: each value is a pure function
// of (seed, layer, head, row, col), evaluated with the same IEEE single-precision operations on
// every device, so that the same seed gives bit-identical noise on the CPU (scalar, AVX2 and
// AVX-512 paths) and on the GPU. What the backends then compute from the noise (softmax, column
// sums) is rounded differently on each device, so kept sets agree except where scores are within
// float rounding of each other (see docs/gpu.md).
//
// Every function here is usable on the host and, compiled by nvcc, on the device. The arithmetic
// is written with explicitly rounded operations (Fma, Mul, Add) so that no compiler contracts or
// reorders it on either side.
#ifndef KVC_NOISE_H_
#define KVC_NOISE_H_

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVC_HOST_DEVICE inline
#endif

// The logarithm's table (NoiseLog below): entry i covers mantissas m in [1 + i/32, 1 + (i+1)/32)
// for i < 16 and [0.5 + i/64, 0.5 + (i+1)/64) above; kNoiseInvC[i] is 1/c for c the interval's
// midpoint (c = 1 for entries 0 and 31, so that logs next to 1 keep their relative accuracy), and
// kNoiseLogC[i] = -log(kNoiseInvC[i]) of that float, rounded to float.
#define KVC_NOISE_INV_C                                                                           \
  {                                                                                               \
    1.000000000e+00f, 9.552238584e-01f, 9.275362492e-01f, 9.014084339e-01f, 8.767123222e-01f,     \
        8.533333540e-01f, 8.311688304e-01f, 8.101266026e-01f, 7.901234627e-01f, 7.710843086e-01f, \
        7.529411912e-01f, 7.356321812e-01f, 7.191011310e-01f, 7.032967210e-01f, 6.881720424e-01f, \
        6.736842394e-01f, 1.319587588e+00f, 1.292929292e+00f, 1.267326713e+00f, 1.242718458e+00f, \
        1.219047666e+00f, 1.196261644e+00f, 1.174311876e+00f, 1.153153181e+00f, 1.132743359e+00f, \
        1.113043427e+00f, 1.094017148e+00f, 1.075630307e+00f, 1.057851195e+00f, 1.040650368e+00f, \
        1.024000049e+00f, 1.000000000e+00f                                                        \
  }
#define KVC_NOISE_LOG_C                                                                           \
  {                                                                                               \
    0.0f, 4.580955952e-02f, 7.522340119e-02f, 1.037968099e-01f, 1.315763593e-01f,                 \
        1.586050093e-01f, 1.849223375e-01f, 2.105647475e-01f, 2.355660647e-01f, 2.599575520e-01f, \
        2.837681472e-01f, 3.070250452e-01f, 3.297532797e-01f, 3.519763947e-01f, 3.737164140e-01f, \
        3.949937522e-01f, -2.773192525e-01f, -2.569104135e-01f, -2.369097322e-01f,                \
        -2.173012793e-01f, -1.980699450e-01f, -1.792013943e-01f, -1.606823355e-01f,               \
        -1.425000876e-01f, -1.246424392e-01f, -1.070980877e-01f, -8.985637873e-02f,               \
        -7.290682197e-02f, -5.623967573e-02f, -3.984587267e-02f, -2.371657453e-02f, 0.0f          \
  }

namespace kvc {

// The tables for host code (the CPU's vector paths load them too).
alignas(128) inline constexpr float kNoiseInvC[32] = KVC_NOISE_INV_C;
alignas(128) inline constexpr float kNoiseLogC[32] = KVC_NOISE_LOG_C;

namespace noise_internal {

#if defined(__CUDACC__)
// The device's copy: 128 bytes each, one L1 line, so a warp's gather of any entries is one load.
static __device__ const float kInvCDevice[32] __attribute__((aligned(128))) = KVC_NOISE_INV_C;
static __device__ const float kLogCDevice[32] __attribute__((aligned(128))) = KVC_NOISE_LOG_C;
#endif

KVC_HOST_DEVICE uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

KVC_HOST_DEVICE float BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// One rounding each; never contracted or reordered.
KVC_HOST_DEVICE float Fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

KVC_HOST_DEVICE float Mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

KVC_HOST_DEVICE float Add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

KVC_HOST_DEVICE float InvC(uint32_t i) {
#if defined(__CUDA_ARCH__)
  return kInvCDevice[i];
#else
  return kNoiseInvC[i];
#endif
}

KVC_HOST_DEVICE float LogC(uint32_t i) {
#if defined(__CUDA_ARCH__)
  return kLogCDevice[i];
#else
  return kNoiseLogC[i];
#endif
}

}  // namespace noise_internal

// Mix64's constants (the CPU's vector paths evaluate it with them too).
inline constexpr uint64_t kMixAdd = 0x9e3779b97f4a7c15ull;
inline constexpr uint64_t kMixMul1 = 0xbf58476d1ce4e5b9ull;
inline constexpr uint64_t kMixMul2 = 0x94d049bb133111ebull;

// splitmix64 finalizer: a bijective mix with good avalanche.
KVC_HOST_DEVICE uint64_t Mix64(uint64_t x) {
  x += kMixAdd;
  x = (x ^ (x >> 30)) * kMixMul1;
  x = (x ^ (x >> 27)) * kMixMul2;
  return x ^ (x >> 31);
}

// The largest float below 1.
inline constexpr float kBelowOne = 0.99999994f;  // 1 - 2^-24

// Uniform in (0, 1), from 24 random bits b: (b + 0.5) * 2^-24, rounded to float, except that the
// one value that rounds up to 1 (b = 2^24 - 1) becomes 1 - 2^-24, so that -log(u) is never 0.
KVC_HOST_DEVICE float CounterUniform(uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                                     uint32_t col) {
  using namespace noise_internal;
  uint64_t h = Mix64(seed ^ Mix64((uint64_t{layer} << 32) | head));
  h = Mix64(h ^ ((uint64_t{row} << 32) | col));
  const float u = Mul(Add(static_cast<float>(h >> 40), 0.5f), 1.0f / 16777216.0f);
  return u < kBelowOne ? u : kBelowOne;
}

// Natural logarithm of a positive normal float, table-driven: x = m * 2^e with m in [0.75, 1.5),
// the top five mantissa bits pick c ~ m from 32 entries, and
//   log x = e log 2 - log(1/c) + log1p(m/c - 1),
// where |m/c - 1| <= 1/32 and a degree-5 series gives log1p; within ~2.5e-7 relative of log.
// The CPU's AVX2 and AVX-512 paths (kernels/cpu/simd_noise.cc) evaluate exactly these operations.
KVC_HOST_DEVICE float NoiseLog(float x) {
  using namespace noise_internal;
  const uint32_t xi = FloatBits(x);
  const uint32_t mant = xi & 0x007fffffu;
  const bool big = mant >= 0x00400000u;  // 1.f >= 1.5: halve the mantissa, raise the exponent
  const float m = BitsFloat(mant | (big ? 0x3f000000u : 0x3f800000u));
  const float e = static_cast<float>(static_cast<int32_t>(xi >> 23) - 127 + (big ? 1 : 0));
  const uint32_t idx = (mant >> 18) & 31u;
  const float r = Fma(m, InvC(idx), -1.0f);
  float p = Fma(0.2f, r, -0.25f);
  p = Fma(p, r, 1.0f / 3.0f);
  p = Fma(p, r, -0.5f);
  const float log1p = Fma(p, Mul(r, r), r);
  // e * log 2 in two parts (the first exact for |e| < 2^14) so that the sum rounds once.
  const float hi = Fma(e, 0.693359375f, LogC(idx));
  return Add(hi, Fma(e, -2.12194440e-4f, log1p));
}

// Standard Gumbel(0, 1) sample: -log(-log(u)).
KVC_HOST_DEVICE float CounterGumbel(uint64_t seed, uint32_t layer, uint32_t head, uint32_t row,
                                    uint32_t col) {
  const float u = CounterUniform(seed, layer, head, row, col);
  return -NoiseLog(-NoiseLog(u));
}

}  // namespace kvc

#endif  // KVC_NOISE_H_

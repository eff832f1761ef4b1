// Device kernels against host references, exactly: the counter-based noise of kvc/noise.h
// evaluated on the device is bit-identical to the host's (and so to every CPU path, which
// tests/kernels/noise_test.cc compares with the host function), and the multi-block top-k keeps
// exactly the positions a host sort keeps, whatever the segment size (ties, NaN, -0, infinities,
// protected ranges, k from 1 to S).
// Without a visible CUDA device main() prints the reason and exits 77 (ctest: skipped).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/kernels.h"
#include "gpu_util.h"
#include "gpu_dev.h"
#include "gtest/gtest.h"
#include "kvc/noise.h"
#include "noise_kernel.h"
// The CPU engine's vectorized noise (internal header of the CPU backend).
#include "cpu/simd.h"

namespace kvc {
namespace {

using gpu_testing::Dev;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

TEST(DeviceNoise, GumbelAndUniformAreBitIdenticalToTheHost) {
  // Columns around the one counter whose uniform rounds up to 1 (seed 1, col 7855647), and a
  // long row elsewhere.
  struct Row {
    uint64_t seed;
    uint32_t layer, head, row, col0;
    int n;
  };
  for (const Row& r : {Row{1, 0, 0, 0, 7855647 - 1000, 2000}, Row{77, 3, 5, 11, 0, 1 << 20},
                       Row{9, 31, 7, 4095, 4000000000u, 1 << 16}}) {
    Dev<float> u(r.n), g(r.n);
    ASSERT_EQ(gpu_testing::DeviceNoise(r.seed, r.layer, r.head, r.row, r.col0, r.n, u.p, g.p),
              cudaSuccess);
    const std::vector<float> du = u.Get(r.n), dg = g.Get(r.n);
    // The CPU engine's own path on this machine (AVX-512, AVX2 or scalar), x = 0, tau = 1.
    std::vector<float> cpu(r.n, 0.0f);
    simd::AddGumbel(cpu.data(), cpu.size(), r.seed, r.layer, r.head, r.row, r.col0, 1.0f);
    for (int j = 0; j < r.n; ++j) {
      const uint32_t col = r.col0 + static_cast<uint32_t>(j);
      ASSERT_EQ(Bits(du[j]), Bits(CounterUniform(r.seed, r.layer, r.head, r.row, col))) << col;
      ASSERT_EQ(Bits(dg[j]), Bits(CounterGumbel(r.seed, r.layer, r.head, r.row, col))) << col;
      ASSERT_EQ(Bits(dg[j]), Bits(cpu[j])) << "cpu path, column " << col;
      ASSERT_TRUE(std::isfinite(dg[j])) << col;
    }
  }
}

TEST(DeviceNoise, LogarithmIsBitIdenticalToTheHost) {
  std::vector<float> x;
  for (uint32_t b = 0; b < (1u << 24); b += 5) {
    x.push_back(std::min((b + 0.5f) * (1.0f / 16777216.0f), kBelowOne));
  }
  const size_t n_uniform = x.size();
  for (size_t i = 0; i < n_uniform; i += 3) x.push_back(-NoiseLog(x[i]));
  for (double v = 1e-37; v < 1e38; v *= 1.001) x.push_back(static_cast<float>(v));
  Dev<float> dx(x.data(), x.size()), dy(x.size());
  ASSERT_EQ(gpu_testing::DeviceNoiseLog(dx.p, static_cast<int>(x.size()), dy.p), cudaSuccess);
  const std::vector<float> y = dy.Get(x.size());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(Bits(y[i]), Bits(NoiseLog(x[i]))) << x[i];
}

// ---- top-k ----

uint32_t HostKey(float f) {  // OrderedKey of cuda_common.cuh
  if (std::isnan(f)) return 0u;
  if (f == 0.0f) f = 0.0f;
  const uint32_t u = Bits(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

std::vector<int32_t> HostTopK(const float* row, int s, int k, int sink_end, int recent_begin) {
  std::vector<int32_t> idx(s);
  std::iota(idx.begin(), idx.end(), 0);
  auto key = [&](int j) -> uint64_t {
    const bool prot = j < sink_end || j >= recent_begin;
    return prot ? 0x100000000ull : HostKey(row[j]);
  };
  std::stable_sort(idx.begin(), idx.end(), [&](int a, int b) { return key(a) > key(b); });
  idx.resize(k);
  std::sort(idx.begin(), idx.end());
  return idx;
}

struct TopKCase {
  int rows, s, k, sink_end, recent_begin;
  int distinct;  // 0: continuous scores; else scores take this many values (ties)
};

void RunTopK(const TopKCase& c, int segment) {
  SCOPED_TRACE(absl::StrCat("rows ", c.rows, " S ", c.s, " k ", c.k, " sinks ", c.sink_end,
                            " recent from ", c.recent_begin, " distinct ", c.distinct, " segment ",
                            segment));
  std::mt19937_64 rng(c.s * 31 + c.k);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> scores(static_cast<size_t>(c.rows) * c.s);
  for (size_t i = 0; i < scores.size(); ++i) {
    const float x = u(rng);
    scores[i] = c.distinct > 0 ? std::floor((x + 1.0f) * 0.5f * c.distinct) : x;
  }
  // Specials in every row: NaN, both zeros, both infinities, the largest finite values.
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            0.0f,
                            -0.0f,
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::max(),
                            -std::numeric_limits<float>::max()};
  for (int r = 0; r < c.rows; ++r) {
    for (int i = 0; i < 7 && i < c.s; ++i) {
      scores[static_cast<size_t>(r) * c.s + (static_cast<size_t>(i) * 7919 + r) % c.s] =
          specials[i];
    }
  }
  Dev<float> ds(scores.data(), scores.size());
  Dev<int32_t> out(static_cast<size_t>(c.rows) * c.k);
  Dev<uint8_t> scratch(cuda::TopKScratchBytes(c.rows, c.s, segment));
  ASSERT_EQ(cuda::LaunchTopKPositions(ds.p, c.rows, c.s, c.k, c.sink_end, c.recent_begin, scratch.p,
                                      out.p, nullptr, segment),
            cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int32_t> got = out.Get(static_cast<size_t>(c.rows) * c.k);
  for (int r = 0; r < c.rows; ++r) {
    const std::vector<int32_t> want = HostTopK(scores.data() + static_cast<size_t>(r) * c.s, c.s,
                                               c.k, c.sink_end, c.recent_begin);
    const std::vector<int32_t> row(got.begin() + static_cast<size_t>(r) * c.k,
                                   got.begin() + static_cast<size_t>(r + 1) * c.k);
    ASSERT_EQ(row, want) << "row " << r;
  }
}

TEST(TopK, MatchesAHostSortForEverySegmentSize) {
  const TopKCase cases[] = {
      {1, 1, 1, 0, 1, 0},              // one key
      {3, 1000, 1, 0, 1000, 0},        // k = 1
      {3, 1000, 1000, 0, 1000, 0},     // keep all
      {2, 5000, 1250, 4, 4968, 0},     // sinks and a recent window
      {8, 32768, 8192, 0, 32736, 0},   // Llama-3 at 32K, snapkv's protected window
      {2, 20000, 7000, 0, 20000, 3},   // three distinct scores: ties across segments
      {2, 20000, 19990, 0, 20000, 1},  // all tied
      {3, 9999, 300, 100, 9000, 50},   // k below the protected count's complement
      {1, 131072, 32768, 0, 131040, 0}};
  for (const TopKCase& c : cases) {
    for (int segment : {256, 1024, 0}) RunTopK(c, segment);
  }
}

TEST(TopK, RejectsBadArguments) {
  Dev<float> s(16);
  Dev<int32_t> out(16);
  Dev<uint8_t> scratch(cuda::TopKScratchBytes(1, 16));
  EXPECT_EQ(cuda::LaunchTopKPositions(s.p, 1, 16, 0, 0, 16, scratch.p, out.p, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchTopKPositions(s.p, 1, 16, 17, 0, 16, scratch.p, out.p, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchTopKPositions(s.p, 1, 16, 4, 0, 16, nullptr, out.p, nullptr),
            cudaErrorInvalidValue);
  EXPECT_EQ(cuda::LaunchTopKPositions(s.p, 1, 16, 4, 0, 16, scratch.p, out.p, nullptr, 100),
            cudaErrorInvalidValue);  // not a multiple of 256
}

}  // namespace
}  // namespace kvc

int main(int argc, char** argv) { return kvc::gpu_testing::RunGpuTests(argc, argv); }

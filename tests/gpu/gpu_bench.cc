// GPU benchmark: device-to-device memcpy bandwidth measured in the same run, next to the CUDA
// backend's per-stage throughput and per-layer latency on a Llama-3-8B-shaped layer (8 KV heads,
// 32 query heads, head_dim 128, 32K tokens, fp16, W = 32). Stage times come from CUDA events
// (CompressTimings); "wall" also includes host staging and the host<->device copies.
// Usage: kvc_gpu_bench [--seq_len=N] [--iters=N]. Exits 77 without a CUDA device.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "kvc/backend.h"
#include "kvc/gpu_memory.h"

namespace kvc {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Bytes copied per second by cudaMemcpyAsync device-to-device (each byte is read and written).
double MemcpyGBps(size_t bytes, int iters) {
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return 0;
  cudaMemset(a, 1, bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e0);
  for (int i = 0; i < iters; ++i) cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return static_cast<double>(bytes) * iters / (ms * 1e-3) / 1e9;
}

struct Config {
  const char* name;
  CompressionSpec spec;
};

int Run(int seq_len, int iters) {
  std::string why;
  cudaDeviceProp prop = {};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s (sm_%d%d), %.1f GiB\n", prop.name, prop.major, prop.minor,
              prop.totalGlobalMem / 1073741824.0);
  const double copy = MemcpyGBps(size_t{1} << 30, 10);
  std::printf("d2d memcpy: %.1f GB/s copied (%.1f GB/s read+write)\n", copy, 2 * copy);

  const LayerShape shape{8, 32, seq_len, 128, 32};
  const gpu_testing::Layer layer = gpu_testing::RandomLayer(shape, DType::kF16, Layout::kHND, 42);
  auto backend = CreateCudaBackend({});
  if (!backend.ok()) {
    std::printf("error: %s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  std::printf("backend: %s\n", (*backend)->description().c_str());
  const double kv_bytes = 2.0 * shape.num_kv_heads * seq_len * shape.head_dim * 2;
  const double k_bytes = kv_bytes / 2;

  std::vector<Config> configs;
  auto add = [&](const char* name, EvictionPolicy p, double ratio, ChannelPolicy cp, int bits) {
    Config c{name, {}};
    c.spec.eviction.policy = p;
    c.spec.eviction.keep_ratio = ratio;
    c.spec.channels.key_policy = cp;
    c.spec.channels.key_lambda = cp == ChannelPolicy::kNone ? 0.0 : 0.5;
    c.spec.quant.bits = bits;
    configs.push_back(c);
  };
  add("streaming 10%", EvictionPolicy::kStreaming, 0.1, ChannelPolicy::kNone, 0);
  add("snapkv 10%", EvictionPolicy::kSnapKV, 0.1, ChannelPolicy::kNone, 0);
  add("snapkv 25% + think 0.5 + 4-bit", EvictionPolicy::kSnapKV, 0.25, ChannelPolicy::kThink, 4);
  add("h2o 10%", EvictionPolicy::kH2O, 0.1, ChannelPolicy::kNone, 0);
  add("keyformer 10%", EvictionPolicy::kKeyformer, 0.1, ChannelPolicy::kNone, 0);
  add("knorm 10%", EvictionPolicy::kKNorm, 0.1, ChannelPolicy::kNone, 0);

  std::printf("layer: Hkv 8, Hq 32, D 128, S %d, fp16, W 32; K+V %.1f MiB; median of %d\n", seq_len,
              kv_bytes / 1048576.0, iters);
  std::printf("%-32s %9s %9s %9s %9s %9s %9s %10s %10s\n", "config", "score_ms", "select_ms",
              "pack_ms", "quant_ms", "device_ms", "wall_ms", "score_GB/s", "pack_GB/s");
  for (const Config& c : configs) {
    std::vector<double> sc, se, pa, qu, to, wall;
    size_t blob = 0;
    for (int i = 0; i < iters + 2; ++i) {
      CompressTimings t;
      const auto w0 = std::chrono::steady_clock::now();
      absl::StatusOr<CompactLayer> r = (*backend)->Compress(layer.input(), c.spec, &t);
      const double wl =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
      if (!r.ok()) {
        std::printf("%s: %s\n", c.name, std::string(r.status().message()).c_str());
        return 1;
      }
      blob = r->bytes.size();
      if (i < 2) continue;  // warm-up: pool growth, pinned staging growth
      sc.push_back(t.score);
      se.push_back(t.select);
      pa.push_back(t.pack);
      qu.push_back(t.quantize);
      to.push_back(t.total);
      wall.push_back(wl);
    }
    // Score reads K (and the small Q_obs); pack reads the kept rows and writes the blob.
    const double score_gbs = Median(sc) > 0 ? k_bytes / Median(sc) / 1e9 : 0;
    const double pack_gbs = Median(pa) > 0 ? 2.0 * blob / Median(pa) / 1e9 : 0;
    std::printf("%-32s %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %10.1f %10.1f\n", c.name,
                Median(sc) * 1e3, Median(se) * 1e3, Median(pa) * 1e3, Median(qu) * 1e3,
                Median(to) * 1e3, Median(wall) * 1e3, score_gbs, pack_gbs);
  }
  std::printf("device memory held by the backend pool: %.1f MiB\n",
              GpuMemoryUsedBytes() / 1048576.0);
  return 0;
}

}  // namespace
}  // namespace kvc

int main(int argc, char** argv) {
  int seq_len = 32768, iters = 10;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--seq_len=", 10) == 0) seq_len = std::atoi(argv[i] + 10);
    if (std::strncmp(argv[i], "--iters=", 8) == 0) iters = std::atoi(argv[i] + 8);
  }
  if (seq_len < 64 || iters < 1) {
    std::fprintf(stderr, "--seq_len must be >= 64 and --iters >= 1\n");
    return 2;
  }
  if (!kvc::gpu_testing::DeviceOrSkipMessage()) return kvc::gpu_testing::kSkipExitCode;
  return kvc::Run(seq_len, iters);
}

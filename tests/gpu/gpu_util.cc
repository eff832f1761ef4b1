#include "gpu_util.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>
#include <thread>

#include "kvc/backend.h"
#include "kvc/convert.h"
#include "kvc/noise.h"

namespace kvc::gpu_testing {

bool DeviceOrSkipMessage() {
  std::string why;
  if (CudaDeviceAvailable(&why)) return true;
  std::printf("SKIPPED: no CUDA device: %s\n", why.c_str());
  std::fflush(stdout);
  return false;
}

int DeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

LayerInput Layer::input() const {
  LayerInput in;
  in.shape = shape;
  in.dtype = dtype;
  in.layout = layout;
  in.layer_index = layer_index;
  in.k = k.data();
  in.v = v.data();
  in.q_obs = shape.obs_window > 0 ? q.data() : nullptr;
  return in;
}

namespace {

// Runs fn(begin, end) over [0, n) on all cores.
template <typename Fn>
void ParallelRange(size_t n, Fn fn) {
  const size_t threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 64);
  const size_t per = (n + threads - 1) / threads;
  std::vector<std::thread> pool;
  for (size_t t = 0; t < threads && t * per < n; ++t) {
    pool.emplace_back([&, t] { fn(t * per, std::min(n, (t + 1) * per)); });
  }
  for (std::thread& th : pool) th.join();
}

// Element i of tensor `which` in HND order: (u1 + u2 + u3) * 0.8 with u uniform in [-1, 1), three
// 21-bit fields of one counter hash (kvc/noise.h's Mix64), so that a 128K-token layer takes
// about a second on a 16-core host.
float Gaussianish(uint64_t seed, uint32_t which, size_t i) {
  const uint64_t h = Mix64(Mix64(seed * 3 + which) ^ Mix64(i));
  float sum = 0.0f;
  for (int r = 0; r < 3; ++r) {
    sum += static_cast<float>((h >> (21 * r)) & 0x1fffffu) * (2.0f / 2097152.0f) - 1.0f;
  }
  return sum * 0.8f;
}

// A [heads, tokens, D] tensor (values from `value(index in HND order)`) stored in `layout`.
template <typename ValueFn>
void Fill(int heads, int tokens, int d, DType dtype, Layout layout, ValueFn value,
          std::vector<uint8_t>* out) {
  const size_t n = static_cast<size_t>(heads) * tokens * d;
  out->assign(n * DTypeSize(dtype), 0);
  const size_t rows = static_cast<size_t>(heads) * tokens;
  const size_t es = DTypeSize(dtype);
  ParallelRange(rows, [&](size_t r0, size_t r1) {
    std::vector<float> row(d);
    for (size_t r = r0; r < r1; ++r) {
      const int h = static_cast<int>(r / tokens), t = static_cast<int>(r % tokens);
      const size_t dst = ElementOffset(layout, heads, tokens, d, h, t, 0);
      for (int c = 0; c < d; ++c) row[c] = value(r * d + c);
      FromFloat(row.data(), dtype, d, out->data() + dst * es);
    }
  });
}

}  // namespace

Layer RandomLayer(const LayerShape& shape, DType dtype, Layout layout, uint64_t seed,
                  int layer_index) {
  std::mt19937_64 rng(seed);
  Layer l;
  l.shape = shape;
  l.dtype = dtype;
  l.layout = layout;
  l.layer_index = layer_index;
  const int d = shape.head_dim;
  std::vector<int> perm(d);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  Fill(
      shape.num_kv_heads, shape.seq_len, d, dtype, layout,
      [&](size_t i) { return Gaussianish(seed, 0, i) * (1.0f + 3.0f * perm[i % d] / d); }, &l.k);
  Fill(
      shape.num_kv_heads, shape.seq_len, d, dtype, layout,
      [&](size_t i) { return Gaussianish(seed, 1, i); }, &l.v);
  Fill(
      shape.num_q_heads, shape.obs_window, d, dtype, layout,
      [&](size_t i) { return Gaussianish(seed, 2, i); }, &l.q);
  return l;
}

DeviceLayer::DeviceLayer(const Layer& layer, int device) : layer_(layer) {
  auto copy = [&](const std::vector<uint8_t>& src, void** dst) {
    if (!error_.empty() || src.empty()) return;
    cudaError_t e = cudaSetDevice(device);
    if (e == cudaSuccess) e = cudaMalloc(dst, src.size());
    if (e == cudaSuccess) e = cudaMemcpy(*dst, src.data(), src.size(), cudaMemcpyHostToDevice);
    if (e != cudaSuccess) error_ = cudaGetErrorString(e);
  };
  copy(layer.k, &k_);
  copy(layer.v, &v_);
  copy(layer.q, &q_);
}

DeviceLayer::~DeviceLayer() {
  cudaFree(k_);
  cudaFree(v_);
  cudaFree(q_);
}

LayerInput DeviceLayer::input() const {
  LayerInput in = layer_.input();
  in.k = k_;
  in.v = v_;
  in.q_obs = layer_.shape.obs_window > 0 ? q_ : nullptr;
  in.memory = MemorySpace::kDevice;
  return in;
}

}  // namespace kvc::gpu_testing

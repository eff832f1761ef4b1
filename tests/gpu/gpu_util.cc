#include "gpu_util.h"

#include <algorithm>
#include <cstdio>
#include <numeric>
#include <random>

#include "kvc/backend.h"

namespace kvc::gpu_testing {

bool DeviceOrSkipMessage() {
  std::string why;
  if (CudaDeviceAvailable(&why)) return true;
  std::printf("SKIPPED: no CUDA device: %s\n", why.c_str());
  std::fflush(stdout);
  return false;
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

// Fills a [heads, tokens, D] tensor given in HND order into `out` with the requested layout.
void Store(const std::vector<float>& hnd, int heads, int tokens, int d, DType dtype, Layout layout,
           std::vector<uint8_t>* out) {
  out->assign(hnd.size() * DTypeSize(dtype), 0);
  for (int h = 0; h < heads; ++h) {
    for (int t = 0; t < tokens; ++t) {
      for (int c = 0; c < d; ++c) {
        const float x = hnd[(static_cast<size_t>(h) * tokens + t) * d + c];
        StoreFromFloat(out->data(), dtype, ElementOffset(layout, heads, tokens, d, h, t, c), x);
      }
    }
  }
}

std::vector<float> Gaussianish(size_t n, std::mt19937_64* rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> x(n);
  for (float& v : x) v = (u(*rng) + u(*rng) + u(*rng)) * 0.8f;
  return x;
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
  std::vector<float> k =
      Gaussianish(static_cast<size_t>(shape.num_kv_heads) * shape.seq_len * d, &rng);
  for (size_t i = 0; i < k.size(); ++i) k[i] *= 1.0f + 3.0f * perm[i % d] / d;
  const std::vector<float> v =
      Gaussianish(static_cast<size_t>(shape.num_kv_heads) * shape.seq_len * d, &rng);
  const std::vector<float> q =
      Gaussianish(static_cast<size_t>(shape.num_q_heads) * shape.obs_window * d, &rng);
  Store(k, shape.num_kv_heads, shape.seq_len, d, dtype, layout, &l.k);
  Store(v, shape.num_kv_heads, shape.seq_len, d, dtype, layout, &l.v);
  Store(q, shape.num_q_heads, shape.obs_window, d, dtype, layout, &l.q);
  return l;
}

}  // namespace kvc::gpu_testing

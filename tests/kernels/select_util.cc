#include "kernels/select_util.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "kvc/noise.h"

namespace kvc::testing {
namespace {

// Writes an HND float tensor [heads, tokens, D] into bytes of the given dtype and layout.
std::vector<uint8_t> Encode(const std::vector<float>& hnd, int heads, int tokens, int D, DType t,
                            Layout layout) {
  std::vector<uint8_t> out(hnd.size() * DTypeSize(t));
  for (int h = 0; h < heads; ++h) {
    for (int s = 0; s < tokens; ++s) {
      for (int c = 0; c < D; ++c) {
        const float x = hnd[(static_cast<size_t>(h) * tokens + s) * D + c];
        StoreFromFloat(out.data(), t, ElementOffset(layout, heads, tokens, D, h, s, c), x);
      }
    }
  }
  return out;
}

float Load(const TestLayer& l, const std::vector<uint8_t>& buf, int heads, int tokens, int h, int s,
           int c) {
  return LoadAsFloat(buf.data(), l.dtype,
                     ElementOffset(l.layout, heads, tokens, l.shape.head_dim, h, s, c));
}

}  // namespace

LayerInput TestLayer::input() const {
  LayerInput in;
  in.shape = shape;
  in.dtype = dtype;
  in.layout = layout;
  in.layer_index = layer_index;
  in.k = k.data();
  in.v = v.data();
  in.q_obs = q.empty() ? nullptr : q.data();
  return in;
}

TestLayer MakeLayer(const LayerShape& shape, const std::vector<float>& k_hnd,
                    const std::vector<float>& v_hnd, const std::vector<float>& q_hnd, DType dtype,
                    Layout layout) {
  TestLayer l;
  l.shape = shape;
  l.dtype = dtype;
  l.layout = layout;
  l.k = Encode(k_hnd, shape.num_kv_heads, shape.seq_len, shape.head_dim, dtype, layout);
  l.v = Encode(v_hnd, shape.num_kv_heads, shape.seq_len, shape.head_dim, dtype, layout);
  l.q = Encode(q_hnd, shape.num_q_heads, shape.obs_window, shape.head_dim, dtype, layout);
  return l;
}

std::vector<float> RandomValues(size_t n, uint64_t seed, float scale) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    float s = 0;
    for (uint32_t j = 0; j < 4; ++j) {
      s += CounterUniform(seed, 7, j, static_cast<uint32_t>(i >> 32), static_cast<uint32_t>(i));
    }
    v[i] = (s - 2.0f) * 1.7f * scale;
  }
  return v;
}

TestLayer RandomLayer(const LayerShape& shape, uint64_t seed, DType dtype, Layout layout) {
  const size_t kv = static_cast<size_t>(shape.num_kv_heads) * shape.seq_len * shape.head_dim;
  const size_t q = static_cast<size_t>(shape.num_q_heads) * shape.obs_window * shape.head_dim;
  return MakeLayer(shape, RandomValues(kv, seed), RandomValues(kv, seed + 1),
                   RandomValues(q, seed + 2), dtype, layout);
}

std::vector<int32_t> HeadPositions(const TokenSelection& sel, int h) {
  const int32_t* first = sel.head(h);
  return std::vector<int32_t>(first, first + sel.count(h));
}

std::vector<int32_t> HeadKeyChannels(const ChannelSelection& sel, int h) {
  auto first = sel.key_idx.begin() + static_cast<ptrdiff_t>(h) * sel.key_channels;
  return std::vector<int32_t>(first, first + sel.key_channels);
}

std::vector<int32_t> HeadValueChannels(const ChannelSelection& sel, int h) {
  auto first = sel.value_idx.begin() + static_cast<ptrdiff_t>(h) * sel.value_channels;
  return std::vector<int32_t>(first, first + sel.value_channels);
}

std::vector<double> ReferenceAttentionScores(const TestLayer& l, const EvictionSpec& spec,
                                             const float* q_stats) {
  const LayerShape& sh = l.shape;
  const int S = sh.seq_len, D = sh.head_dim, W = sh.obs_window, g = sh.group_size();
  const int H = sh.num_kv_heads, Hq = sh.num_q_heads;
  const bool kvzip = spec.policy == EvictionPolicy::kKVzip;
  // The keys row t of a query head sees.
  auto keys_of = [&](int t) {
    std::vector<int> keys;
    if (kvzip && !spec.pass_rows.empty()) {
      int p = 0;
      for (int first = 0; t >= first + spec.pass_rows[p]; first += spec.pass_rows[p++]) {
      }
      const int lo = p * spec.pass_tokens, hi = std::min(S, lo + spec.pass_tokens);
      for (int j = 0; j < std::min(lo, spec.sink_tokens); ++j) keys.push_back(j);
      for (int j = lo; j < hi; ++j) keys.push_back(j);
      return keys;
    }
    // kvzip's rows come after the context and see every key; the others are causal.
    const int len = kvzip ? S : S - W + t + 1;
    for (int j = 0; j < len; ++j) keys.push_back(j);
    return keys;
  };
  std::vector<double> out(static_cast<size_t>(H) * S, 0.0);
  // kvzip with top_rows > 1: every probability each token gets, its score the mean of the
  // largest top_rows of them (absent ones zeros).
  const bool top = kvzip && spec.top_rows > 1;
  std::vector<std::vector<double>> probs(top ? static_cast<size_t>(H) * S : 0);
  std::vector<double> a(S);
  for (int qh = 0; qh < Hq; ++qh) {
    const int h = qh / g;
    for (int t = 0; t < W; ++t) {
      const std::vector<int> keys = keys_of(t);
      double mx = -INFINITY;
      for (int j : keys) {
        double dot = 0;
        for (int c = 0; c < D; ++c) {
          dot += static_cast<double>(Load(l, l.q, Hq, W, qh, t, c)) * Load(l, l.k, H, S, h, j, c);
        }
        a[j] = dot / std::sqrt(static_cast<double>(D));
        if (spec.policy == EvictionPolicy::kKeyformer) {
          a[j] = (a[j] + CounterGumbel(spec.seed, l.layer_index, qh, t, j)) / spec.tau;
        }
        mx = std::max(mx, a[j]);
      }
      const double lse = kvzip && q_stats != nullptr
                             ? static_cast<double>(q_stats[static_cast<size_t>(qh) * W + t])
                             : -INFINITY;
      mx = std::max(mx, lse);
      double sum = std::exp(lse - mx);
      for (int j : keys) sum += std::exp(a[j] - mx);
      for (int j : keys) {
        const double p = std::exp(a[j] - mx) / sum;
        double& o = out[static_cast<size_t>(h) * S + j];
        if (top) probs[static_cast<size_t>(h) * S + j].push_back(p);
        o = kvzip ? std::max(o, p) : o + p / g;
      }
    }
  }
  for (size_t i = 0; i < probs.size(); ++i) {
    std::vector<double>& v = probs[i];
    std::sort(v.begin(), v.end(), std::greater<double>());
    double sum = 0;
    for (size_t r = 0; r < v.size() && r < static_cast<size_t>(spec.top_rows); ++r) sum += v[r];
    out[i] = sum / spec.top_rows;
  }
  return out;
}

}  // namespace kvc::testing

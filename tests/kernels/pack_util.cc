#include "kernels/pack_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

namespace kvc::testing_pack {

LayerInput PackLayerData::input() const {
  LayerInput in;
  in.shape = shape;
  in.dtype = dtype;
  in.layout = layout;
  in.k = k.data();
  in.v = v.data();
  return in;
}

float PackLayerData::K(int h, int t, int c) const {
  return kf[(static_cast<size_t>(h) * shape.seq_len + t) * shape.head_dim + c];
}

float PackLayerData::V(int h, int t, int c) const {
  return vf[(static_cast<size_t>(h) * shape.seq_len + t) * shape.head_dim + c];
}

std::vector<float> UniformFloats(size_t n, float amp, std::mt19937* rng) {
  std::uniform_real_distribution<float> dist(-amp, amp);
  std::vector<float> out(n);
  for (float& x : out) x = dist(*rng);
  return out;
}

PackLayerData MakePackLayer(int hkv, int seq_len, int head_dim, DType dtype, Layout layout,
                            uint32_t seed, float amp) {
  PackLayerData l;
  l.shape.num_kv_heads = hkv;
  l.shape.num_q_heads = hkv;
  l.shape.seq_len = seq_len;
  l.shape.head_dim = head_dim;
  l.dtype = dtype;
  l.layout = layout;
  std::mt19937 rng(seed);
  const size_t n = static_cast<size_t>(hkv) * seq_len * head_dim;
  l.kf = UniformFloats(n, amp, &rng);
  l.vf = UniformFloats(n, amp, &rng);
  const size_t elem = DTypeSize(dtype);
  l.k.resize(n * elem);
  l.v.resize(n * elem);
  for (int h = 0; h < hkv; ++h) {
    for (int t = 0; t < seq_len; ++t) {
      for (int c = 0; c < head_dim; ++c) {
        const size_t src = (static_cast<size_t>(h) * seq_len + t) * head_dim + c;
        const size_t dst = ElementOffset(layout, hkv, seq_len, head_dim, h, t, c);
        StoreFromFloat(l.k.data(), dtype, dst, l.kf[src]);
        StoreFromFloat(l.v.data(), dtype, dst, l.vf[src]);
        l.kf[src] = LoadAsFloat(l.k.data(), dtype, dst);  // the exact stored value
        l.vf[src] = LoadAsFloat(l.v.data(), dtype, dst);
      }
    }
  }
  return l;
}

namespace {
std::vector<int32_t> RandomSubset(int n, int k, std::mt19937* rng) {
  std::vector<int32_t> all(n);
  std::iota(all.begin(), all.end(), 0);
  std::shuffle(all.begin(), all.end(), *rng);
  all.resize(k);
  std::sort(all.begin(), all.end());
  return all;
}
}  // namespace

TokenSelection RandomTokens(int hkv, int seq_len, int budget, std::mt19937* rng) {
  TokenSelection sel;
  sel.num_kv_heads = hkv;
  sel.budget = budget;
  for (int h = 0; h < hkv; ++h) {
    const std::vector<int32_t> p = RandomSubset(seq_len, budget, rng);
    sel.positions.insert(sel.positions.end(), p.begin(), p.end());
  }
  return sel;
}

ChannelSelection RandomChannels(int hkv, int head_dim, int tk, int tv, std::mt19937* rng) {
  ChannelSelection sel;
  sel.key_channels = tk;
  sel.value_channels = tv;
  for (int h = 0; h < hkv; ++h) {
    const std::vector<int32_t> k = RandomSubset(head_dim, tk, rng);
    const std::vector<int32_t> v = RandomSubset(head_dim, tv, rng);
    sel.key_idx.insert(sel.key_idx.end(), k.begin(), k.end());
    sel.value_idx.insert(sel.value_idx.end(), v.begin(), v.end());
  }
  return sel;
}

void ExpectedHeadRows(const PackLayerData& layer, const TokenSelection& tokens,
                      const ChannelSelection& channels, int h, int n_recent,
                      std::vector<float>* keys, std::vector<float>* values) {
  const int d = layer.shape.head_dim, n = tokens.count(h), m = n - n_recent;
  keys->assign(static_cast<size_t>(n) * d, 0.0f);
  values->assign(static_cast<size_t>(n) * d, 0.0f);
  for (int j = 0; j < n; ++j) {
    const int t = tokens.head(h)[j];
    float* kr = keys->data() + static_cast<size_t>(j) * d;
    float* vr = values->data() + static_cast<size_t>(j) * d;
    if (j >= m) {
      for (int c = 0; c < d; ++c) {
        kr[c] = layer.K(h, t, c);
        vr[c] = layer.V(h, t, c);
      }
      continue;
    }
    for (int i = 0; i < channels.key_channels; ++i) {
      const int c = channels.key_idx[static_cast<size_t>(h) * channels.key_channels + i];
      kr[c] = layer.K(h, t, c);
    }
    for (int i = 0; i < channels.value_channels; ++i) {
      const int c = channels.value_idx[static_cast<size_t>(h) * channels.value_channels + i];
      vr[c] = layer.V(h, t, c);
    }
  }
}

std::vector<float> ReferenceAttention(const std::vector<std::vector<float>>& keys,
                                      const std::vector<std::vector<float>>& values, int head_dim,
                                      int num_q_heads, int n_q, const std::vector<float>& q,
                                      int n_new, const std::vector<float>& k_new,
                                      const std::vector<float>& v_new) {
  const int hkv = static_cast<int>(keys.size());
  const int g = num_q_heads / hkv;
  const int d = head_dim;
  std::vector<float> out(static_cast<size_t>(num_q_heads) * n_q * d);
  for (int qh = 0; qh < num_q_heads; ++qh) {
    const int h = qh / g;
    const int n_cache = static_cast<int>(keys[h].size() / d);
    for (int i = 0; i < n_q; ++i) {
      const float* qv = q.data() + (static_cast<size_t>(qh) * n_q + i) * d;
      std::vector<double> s;
      std::vector<const float*> vrows;
      for (int j = 0; j < n_cache; ++j) {
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double{qv[c]} * keys[h][static_cast<size_t>(j) * d + c];
        s.push_back(dot / std::sqrt(static_cast<double>(d)));
        vrows.push_back(values[h].data() + static_cast<size_t>(j) * d);
      }
      for (int j = 0; j <= n_new - n_q + i; ++j) {
        const float* kr = k_new.data() + (static_cast<size_t>(h) * n_new + j) * d;
        double dot = 0;
        for (int c = 0; c < d; ++c) dot += double{qv[c]} * kr[c];
        s.push_back(dot / std::sqrt(static_cast<double>(d)));
        vrows.push_back(v_new.data() + (static_cast<size_t>(h) * n_new + j) * d);
      }
      const double mx = *std::max_element(s.begin(), s.end());
      double sum = 0;
      for (double& x : s) sum += (x = std::exp(x - mx));
      for (int c = 0; c < d; ++c) {
        double acc = 0;
        for (size_t j = 0; j < s.size(); ++j) acc += s[j] / sum * vrows[j][c];
        out[(static_cast<size_t>(qh) * n_q + i) * d + c] = static_cast<float>(acc);
      }
    }
  }
  return out;
}

size_t ElementsDiffering(const uint8_t* a, const uint8_t* b, DType dt, size_t n) {
  const size_t e = DTypeSize(dt);
  size_t differ = 0;
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i * e, b + i * e, e) == 0) continue;
    differ += !(std::isnan(LoadAsFloat(a, dt, i)) && std::isnan(LoadAsFloat(b, dt, i)));
  }
  return differ;
}

std::vector<uint8_t> ConcatHeads(const std::vector<std::vector<uint8_t>>& blobs) {
  const size_t n = blobs.size();
  const size_t begin = sizeof(LayerHeader) + n * sizeof(HeadDesc);
  std::vector<uint8_t> out(begin);
  LayerHeader header;
  std::memcpy(&header, blobs[0].data(), sizeof(header));
  header.num_kv_heads = static_cast<int32_t>(n);
  std::memcpy(out.data(), &header, sizeof(header));
  for (size_t h = 0; h < n; ++h) {
    HeadDesc desc;
    std::memcpy(&desc, blobs[h].data() + sizeof(LayerHeader), sizeof(desc));
    const uint8_t* section = blobs[h].data() + desc.offset;
    desc.offset = out.size();
    std::memcpy(out.data() + sizeof(LayerHeader) + h * sizeof(HeadDesc), &desc, sizeof(desc));
    out.insert(out.end(), section, section + desc.size);
  }
  return out;
}

}  // namespace kvc::testing_pack

#include "kvc/model/kv_cache.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvc/status_macros.h"

namespace kvc::model {

FullKvCache::FullKvCache(const LlamaConfig& config, int capacity)
    : config_(config), capacity_(capacity) {
  const size_t per_layer = static_cast<size_t>(config.n_kv_heads) * capacity * config.head_dim();
  k_.assign(config.n_layers, std::vector<float>(per_layer));
  v_.assign(config.n_layers, std::vector<float>(per_layer));
  scores_.resize(capacity);
}

absl::StatusOr<std::unique_ptr<FullKvCache>> FullKvCache::Create(const LlamaConfig& config,
                                                                 int capacity) {
  RETURN_IF_ERROR(ValidateConfig(config));
  if (capacity < 1) {
    return absl::InvalidArgumentError(absl::StrCat("capacity: ", capacity, " must be >= 1"));
  }
  return std::unique_ptr<FullKvCache>(new FullKvCache(config, capacity));
}

absl::StatusOr<std::unique_ptr<FullKvCache>> FullKvCache::FromPrefix(
    const LlamaConfig& config, const std::vector<LayerProjections>& layers, int pass_len,
    int prefix_len, int capacity) {
  if (static_cast<int>(layers.size()) != config.n_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers: ", layers.size(), " given, the model has ", config.n_layers));
  }
  if (prefix_len < 0 || prefix_len > pass_len || prefix_len > capacity) {
    return absl::InvalidArgumentError(absl::StrCat("prefix_len: ", prefix_len,
                                                   " is outside [0, min(pass length ", pass_len,
                                                   ", capacity ", capacity, ")]"));
  }
  const int hd = config.head_dim();
  const size_t expected = static_cast<size_t>(config.n_kv_heads) * pass_len * hd;
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].k.size() != expected || layers[l].v.size() != expected) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", l, "].k/v: ", layers[l].k.size(),
                                                     "/", layers[l].v.size(), " floats, expected ",
                                                     expected));
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<FullKvCache> cache, Create(config, capacity));
  for (int l = 0; l < config.n_layers; ++l) {
    for (int h = 0; h < config.n_kv_heads; ++h) {
      const size_t src = static_cast<size_t>(h) * pass_len * hd;
      const size_t dst = static_cast<size_t>(h) * capacity * hd;
      const size_t n = static_cast<size_t>(prefix_len) * hd;
      std::memcpy(&cache->k_[l][dst], &layers[l].k[src], n * sizeof(float));
      std::memcpy(&cache->v_[l][dst], &layers[l].v[src], n * sizeof(float));
    }
  }
  cache->len_ = prefix_len;
  return cache;
}

absl::Status FullKvCache::AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                                          float* out) {
  if (layer < 0 || layer >= config_.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is out of range"));
  }
  if (len_ >= capacity_) {
    return absl::ResourceExhaustedError(absl::StrCat("cache is full (", capacity_, " tokens)"));
  }
  const int hd = config_.head_dim();
  const int g = config_.group_size();
  const int n = len_ + 1;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int h = 0; h < config_.n_kv_heads; ++h) {
    float* kh = &k_[layer][static_cast<size_t>(h) * capacity_ * hd];
    float* vh = &v_[layer][static_cast<size_t>(h) * capacity_ * hd];
    std::memcpy(kh + static_cast<size_t>(len_) * hd, k + h * hd, hd * sizeof(float));
    std::memcpy(vh + static_cast<size_t>(len_) * hd, v + h * hd, hd * sizeof(float));
    for (int qh = h * g; qh < (h + 1) * g; ++qh) {
      const float* qv = q + qh * hd;
      float max_score = -INFINITY;
      for (int t = 0; t < n; ++t) {
        float dot = 0;
        for (int c = 0; c < hd; ++c) dot += qv[c] * kh[static_cast<size_t>(t) * hd + c];
        scores_[t] = dot * scale;
        max_score = std::max(max_score, scores_[t]);
      }
      float sum = 0;
      for (int t = 0; t < n; ++t) {
        scores_[t] = std::exp(scores_[t] - max_score);
        sum += scores_[t];
      }
      float* o = out + qh * hd;
      std::fill(o, o + hd, 0.0f);
      for (int t = 0; t < n; ++t) {
        const float w = scores_[t] / sum;
        for (int c = 0; c < hd; ++c) o[c] += w * vh[static_cast<size_t>(t) * hd + c];
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvc::model

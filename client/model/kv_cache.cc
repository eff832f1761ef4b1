#include "kvc/model/kv_cache.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvc/status_macros.h"
#include "ops.h"

namespace kvc::model {

FullKvCache::FullKvCache(const LlamaConfig& config, int capacity)
    : config_(config), capacity_(capacity) {
  const size_t per_layer = static_cast<size_t>(config.n_kv_heads) * capacity * config.head_dim();
  k_.assign(config.n_layers, std::vector<float>(per_layer));
  v_.assign(config.n_layers, std::vector<float>(per_layer));
  scores_.resize(static_cast<size_t>(config.group_size()) * capacity);
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
    // The group's g query heads at once: scores [g, n] = scale * Q K^T, softmax, out = P V.
    const float* qg = q + static_cast<size_t>(h) * g * hd;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, g, n, hd, scale, qg, hd, kh, hd, 0.0f,
                scores_.data(), n);
    for (int r = 0; r < g; ++r) internal::SoftmaxInPlace(&scores_[static_cast<size_t>(r) * n], n);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, g, hd, n, 1.0f, scores_.data(), n, vh,
                hd, 0.0f, out + static_cast<size_t>(h) * g * hd, hd);
  }
  return absl::OkStatus();
}

}  // namespace kvc::model

#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvc/attention.h"
#include "kvc/model/kv_cache.h"
#include "kvc/status_macros.h"

namespace kvc::model {

absl::StatusOr<std::unique_ptr<CompactKvCache>> CompactKvCache::Create(
    const LlamaConfig& config, std::vector<CompactLayer> layers, Backend* backend, int max_new) {
  RETURN_IF_ERROR(ValidateConfig(config));
  if (static_cast<int>(layers.size()) != config.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers: ", layers.size(), " blobs given, the model has ", config.n_layers, " layers"));
  }
  if (max_new < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_new: ", max_new, " must be >= 1"));
  }
  std::unique_ptr<CompactKvCache> cache(new CompactKvCache(config, backend, max_new));
  cache->blobs_ = std::move(layers);
  for (int l = 0; l < config.n_layers; ++l) {
    absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(cache->blobs_[l].bytes);
    if (!view.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", l, "]: ", view.status().message()));
    }
    const std::string where = absl::StrCat("layers[", l, "]");
    if (view->num_kv_heads() != config.n_kv_heads || view->head_dim() != config.head_dim()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": blob has ", view->num_kv_heads(), " KV heads of dim ", view->head_dim(),
          ", the model has ", config.n_kv_heads, " of dim ", config.head_dim()));
    }
    if (view->header().layer_index != l) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": blob is for layer_index ", view->header().layer_index));
    }
    if (view->dtype() != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": blob dtype ",
                                                     std::string(DTypeName(view->dtype())),
                                                     ", the reference model needs f32"));
    }
    if (l > 0 && view->seq_len() != cache->views_[0].seq_len()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": seq_len ", view->seq_len(),
                                                     " differs from layer 0's ",
                                                     cache->views_[0].seq_len()));
    }
    cache->views_.push_back(*view);
  }
  cache->seq_len_ = cache->views_[0].seq_len();
  const size_t tail = static_cast<size_t>(config.n_kv_heads) * max_new * config.head_dim();
  cache->new_k_.assign(config.n_layers, std::vector<float>(tail));
  cache->new_v_.assign(config.n_layers, std::vector<float>(tail));
  cache->tail_k_.resize(tail);
  cache->tail_v_.resize(tail);
  return cache;
}

absl::Status CompactKvCache::AppendAndAttend(int layer, const float* q, const float* k,
                                             const float* v, float* out) {
  if (layer < 0 || layer >= config_.n_layers) {
    return absl::InvalidArgumentError(absl::StrCat("layer: ", layer, " is out of range"));
  }
  if (n_new_ >= max_new_) {
    return absl::ResourceExhaustedError(absl::StrCat("cache is full (", max_new_, " new tokens)"));
  }
  const int hd = config_.head_dim();
  const int n = n_new_ + 1;
  for (int h = 0; h < config_.n_kv_heads; ++h) {
    const size_t base = static_cast<size_t>(h) * max_new_ * hd;
    std::memcpy(&new_k_[layer][base + static_cast<size_t>(n_new_) * hd], k + h * hd,
                hd * sizeof(float));
    std::memcpy(&new_v_[layer][base + static_cast<size_t>(n_new_) * hd], v + h * hd,
                hd * sizeof(float));
    // Repack to the [n_kv_heads, n, head_dim] layout DecodeQuery expects.
    std::memcpy(&tail_k_[static_cast<size_t>(h) * n * hd], &new_k_[layer][base],
                static_cast<size_t>(n) * hd * sizeof(float));
    std::memcpy(&tail_v_[static_cast<size_t>(h) * n * hd], &new_v_[layer][base],
                static_cast<size_t>(n) * hd * sizeof(float));
  }
  DecodeQuery query;
  query.num_q_heads = config_.n_heads;
  query.n_q = 1;
  query.q = q;
  query.n_new = n;
  query.k_new = tail_k_.data();
  query.v_new = tail_v_.data();
  if (backend_ != nullptr) return backend_->Attend(views_[layer], query, out);
  return PackedAttentionCpu(views_[layer], query, out);
}

}  // namespace kvc::model

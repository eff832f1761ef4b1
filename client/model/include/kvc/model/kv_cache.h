// KV caches the reference transformer decodes against: a dense full cache, and a compact cache
// (kvc/compact.h blobs from the compression engine plus an uncompressed tail of new tokens) whose
// attention runs on the packed bytes through kvc::Backend::Attend or kvc::PackedAttentionCpu.
// Caches are not thread-safe; use one per decoding sequence.
#ifndef KVC_MODEL_KV_CACHE_H_
#define KVC_MODEL_KV_CACHE_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/model/checkpoint.h"

namespace kvc::model {

// One layer's post-RoPE projections for every position of a sequence, in the engine's HND layout
// (what a prefill node pushes): q [n_heads, S, head_dim], k and v [n_kv_heads, S, head_dim].
struct LayerProjections {
  std::vector<float> q, k, v;
};

class KvCache {
 public:
  virtual ~KvCache() = default;

  // RoPE position of the token being decoded.
  virtual int position() const = 0;
  // Whether one more token fits (checked before a decode step touches the cache).
  virtual bool CanAppend() const = 0;
  // Appends the current token's post-RoPE key and value of `layer` ([n_kv_heads, head_dim] each)
  // and writes into `out` ([n_heads, head_dim]) the attention of `q` ([n_heads, head_dim]) over
  // every cached token of the layer and the new one. Called for layers 0..L-1 in order, once per
  // token, then Advance().
  virtual absl::Status AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                                       float* out) = 0;
  // Commits the token: position() grows by one.
  virtual void Advance() = 0;
};

// Dense cache [n_layers][n_kv_heads][capacity][head_dim], exact softmax attention in fp32.
class FullKvCache : public KvCache {
 public:
  // Empty cache for up to `capacity` tokens (1 <= capacity; INVALID_ARGUMENT otherwise).
  static absl::StatusOr<std::unique_ptr<FullKvCache>> Create(const LlamaConfig& config,
                                                             int capacity);
  // Cache holding the first `prefix_len` tokens of a forward pass (layers' k/v, HND), ready to
  // decode position prefix_len. Checks the layer count and that prefix_len <= the pass's length.
  static absl::StatusOr<std::unique_ptr<FullKvCache>> FromPrefix(
      const LlamaConfig& config, const std::vector<LayerProjections>& layers, int pass_len,
      int prefix_len, int capacity);

  int position() const override { return len_; }
  bool CanAppend() const override { return len_ < capacity_; }
  absl::Status AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                               float* out) override;
  void Advance() override { ++len_; }

 private:
  FullKvCache(const LlamaConfig& config, int capacity);
  LlamaConfig config_;
  int capacity_;
  int len_ = 0;
  std::vector<std::vector<float>> k_, v_;  // per layer [n_kv_heads, capacity, head_dim]
  std::vector<float> scores_;
};

// One compact blob per layer (as produced by Backend::Compress or served by kvcd) plus the tokens
// decoded since. New tokens' RoPE positions continue at the blobs' seq_len.
class CompactKvCache : public KvCache {
 public:
  // Parses every blob and checks it against the model: one blob per layer, matching num_kv_heads,
  // head_dim and layer order, fp32 full-precision blocks, one seq_len across layers.
  // `backend` (not owned, may be null: then kvc::PackedAttentionCpu) must outlive the cache.
  // `max_new` bounds the tokens that may be appended (>= 1).
  static absl::StatusOr<std::unique_ptr<CompactKvCache>> Create(const LlamaConfig& config,
                                                                std::vector<CompactLayer> layers,
                                                                Backend* backend, int max_new);

  int position() const override { return seq_len_ + n_new_; }
  bool CanAppend() const override { return n_new_ < max_new_; }
  absl::Status AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                               float* out) override;
  void Advance() override { ++n_new_; }

  const CompactLayerView& view(int layer) const { return views_[layer]; }

 private:
  CompactKvCache(const LlamaConfig& config, Backend* backend, int max_new)
      : config_(config), backend_(backend), max_new_(max_new) {}
  LlamaConfig config_;
  Backend* backend_;
  int max_new_;
  int seq_len_ = 0;
  int n_new_ = 0;
  std::vector<CompactLayer> blobs_;
  std::vector<CompactLayerView> views_;
  // Per layer, new tokens' keys/values [n_kv_heads, max_new, head_dim]; the DecodeQuery wants
  // [n_kv_heads, n_new, head_dim] contiguous, assembled in tail_k_/tail_v_ per call.
  std::vector<std::vector<float>> new_k_, new_v_;
  std::vector<float> tail_k_, tail_v_;
};

}  // namespace kvc::model

#endif  // KVC_MODEL_KV_CACHE_H_

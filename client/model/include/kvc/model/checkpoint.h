// Loader for llama2.c "legacy" checkpoints: a header of seven int32 (dim, hidden_dim, n_layers,
// n_heads, n_kv_heads, vocab_size, seq_len), then fp32 tensors, all stored [out, in] row-major:
//   token embedding [vocab, dim]; attention RMSNorm [layers, dim]; wq [layers, dim, dim];
//   wk [layers, kv_dim, dim]; wv [layers, kv_dim, dim]; wo [layers, dim, dim];
//   FFN RMSNorm [layers, dim]; w1 [layers, hidden, dim]; w2 [layers, dim, hidden];
//   w3 [layers, hidden, dim]; final RMSNorm [dim]; two legacy RoPE tables [seq_len, head_dim/2]
//   (ignored: RoPE is computed); classifier [vocab, dim] only when vocab_size < 0 (otherwise the
//   classifier is the token embedding).
// kv_dim = dim * n_kv_heads / n_heads, head_dim = dim / n_heads. All integers little-endian.
#ifndef KVC_MODEL_CHECKPOINT_H_
#define KVC_MODEL_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvc::model {

struct LlamaConfig {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;             // always positive here; see shared_classifier
  int seq_len = 0;                // training context length
  bool shared_classifier = true;  // header's vocab_size was positive

  int head_dim() const { return n_heads > 0 ? dim / n_heads : 0; }
  int kv_dim() const { return n_heads > 0 ? dim / n_heads * n_kv_heads : 0; }
  int group_size() const { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }
};

// Checks what the transformer relies on: every size positive, dim divisible by n_heads, an even
// head_dim (RoPE rotates channel pairs), n_heads a multiple of n_kv_heads. The message names the
// field, e.g. "n_heads: 8 is not a multiple of n_kv_heads 3". head_dim outside the compression
// engine's limits is accepted: the model itself does not care.
absl::Status ValidateConfig(const LlamaConfig& config);

// Number of fp32 values a checkpoint with this (valid) config holds after the header, including the
// legacy RoPE tables. Fails (naming the config) if the count does not fit in 64 bits.
absl::StatusOr<uint64_t> CheckpointFloatCount(const LlamaConfig& config);

// The weights of one model, read into memory. Immutable after Load; safe to share across threads.
class Checkpoint {
 public:
  // Reads and validates the file. Errors (nothing is kept on error):
  //   NOT_FOUND / INTERNAL when the file cannot be opened or read;
  //   INVALID_ARGUMENT when the file is shorter than the header, the header is inconsistent
  //   (ValidateConfig), or the file size differs from what the header implies (message gives both
  //   sizes: truncated files and trailing bytes are both rejected).
  static absl::StatusOr<Checkpoint> Load(const std::string& path);

  Checkpoint(Checkpoint&&) = default;
  Checkpoint& operator=(Checkpoint&&) = default;
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const LlamaConfig& config() const { return config_; }

  const float* token_embedding() const { return at(embedding_); }  // [vocab, dim]
  const float* attn_norm(int layer) const { return at(attn_norm_, layer, config_.dim); }
  const float* wq(int layer) const { return at(wq_, layer, Sq(config_.dim)); }
  const float* wk(int layer) const { return at(wk_, layer, KvSize()); }
  const float* wv(int layer) const { return at(wv_, layer, KvSize()); }
  const float* wo(int layer) const { return at(wo_, layer, Sq(config_.dim)); }
  const float* ffn_norm(int layer) const { return at(ffn_norm_, layer, config_.dim); }
  const float* w1(int layer) const { return at(w1_, layer, FfnSize()); }  // [hidden, dim]
  const float* w2(int layer) const { return at(w2_, layer, FfnSize()); }  // [dim, hidden]
  const float* w3(int layer) const { return at(w3_, layer, FfnSize()); }  // [hidden, dim]
  const float* final_norm() const { return at(final_norm_); }             // [dim]
  const float* classifier() const { return at(classifier_); }             // [vocab, dim]

 private:
  Checkpoint() = default;
  static size_t Sq(int n) { return static_cast<size_t>(n) * n; }
  size_t KvSize() const { return static_cast<size_t>(config_.kv_dim()) * config_.dim; }
  size_t FfnSize() const { return static_cast<size_t>(config_.hidden_dim) * config_.dim; }
  const float* at(size_t offset) const { return data_.data() + offset; }
  const float* at(size_t offset, int layer, size_t stride) const {
    return data_.data() + offset + static_cast<size_t>(layer) * stride;
  }

  LlamaConfig config_;
  std::vector<float> data_;  // everything after the header
  size_t embedding_ = 0, attn_norm_ = 0, wq_ = 0, wk_ = 0, wv_ = 0, wo_ = 0, ffn_norm_ = 0, w1_ = 0,
         w2_ = 0, w3_ = 0, final_norm_ = 0, classifier_ = 0;
};

}  // namespace kvc::model

#endif  // KVC_MODEL_CHECKPOINT_H_

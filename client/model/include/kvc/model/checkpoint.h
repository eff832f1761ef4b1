// Model weights for the reference transformer, from two formats:
//
// llama2.c "legacy" checkpoints (one file): a header of seven int32 (dim, hidden_dim, n_layers,
// n_heads, n_kv_heads, vocab_size, seq_len), then fp32 tensors, all stored [out, in] row-major:
//   token embedding [vocab, dim]; attention RMSNorm [layers, dim]; wq [layers, dim, dim];
//   wk [layers, kv_dim, dim]; wv [layers, kv_dim, dim]; wo [layers, dim, dim];
//   FFN RMSNorm [layers, dim]; w1 [layers, hidden, dim]; w2 [layers, dim, hidden];
//   w3 [layers, hidden, dim]; final RMSNorm [dim]; two legacy RoPE tables [seq_len, head_dim/2]
//   (ignored: RoPE is computed); classifier [vocab, dim] only when vocab_size < 0 (otherwise the
//   classifier is the token embedding).
// kv_dim = dim * n_kv_heads / n_heads, head_dim = dim / n_heads. All integers little-endian. The
// format does not carry RoPE or RMSNorm settings: they are llama2.c's (theta 10000, pairs (2i,
// 2i+1), eps 1e-5, BOS token 1).
//
// Hugging Face Llama checkpoints (a directory): config.json plus model.safetensors, or shards
// listed by model.safetensors.index.json. See LoadHuggingFace for what is read and refused.
#ifndef KVC_MODEL_CHECKPOINT_H_
#define KVC_MODEL_CHECKPOINT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvc/rope.h"

namespace kvc::model {

// Which channels RoPE pairs: (2i, 2i+1) as llama2.c and Meta's checkpoints, or (i, i + head_dim/2)
// as Hugging Face Llama and GPT-NeoX.
enum class RopePairs { kInterleaved, kHalfSplit };

// How the rotary frequencies are rescaled for long contexts (Hugging Face's rope_type).
enum class RopeScaling {
  kNone,    // "default": inv_freq_i = theta^(-2i/head_dim)
  kLinear,  // "linear": inv_freq_i / factor (position interpolation)
  kLlama3,  // "llama3": Llama 3.1's piecewise rescaling of the low frequencies
};

struct RopeConfig {
  double theta = 10000.0;
  RopePairs pairs = RopePairs::kInterleaved;
  RopeScaling scaling = RopeScaling::kNone;
  double factor = 1.0;                // linear and llama3; >= 1
  double low_freq_factor = 1.0;       // llama3
  double high_freq_factor = 4.0;      // llama3; > low_freq_factor
  int original_max_positions = 8192;  // llama3: original_max_position_embeddings
};

struct LlamaConfig {
  int dim = 0;
  int hidden_dim = 0;
  int n_layers = 0;
  int n_heads = 0;
  int n_kv_heads = 0;
  int vocab_size = 0;             // always positive here; see shared_classifier
  int seq_len = 0;                // longest sequence accepted (max_position_embeddings)
  bool shared_classifier = true;  // the classifier is the token embedding
  int explicit_head_dim = 0;      // 0: dim / n_heads (llama2.c); else config.json's head_dim
  float rms_norm_eps = 1e-5f;
  RopeConfig rope;
  int32_t bos_token = 1;  // token the tools sample from; -1 when the model declares none

  int head_dim() const {
    if (explicit_head_dim > 0) return explicit_head_dim;
    return n_heads > 0 ? dim / n_heads : 0;
  }
  int q_dim() const { return head_dim() * n_heads; }      // width of the query projection
  int kv_dim() const { return head_dim() * n_kv_heads; }  // width of the key/value projections
  int group_size() const { return n_kv_heads > 0 ? n_heads / n_kv_heads : 0; }
};

// Checks what the transformer relies on: every size positive, dim divisible by n_heads (unless an
// explicit head_dim is given), an even head_dim (RoPE rotates channel pairs), n_heads a multiple
// of n_kv_heads, rms_norm_eps positive and finite, a valid RoPE (theta positive and finite,
// factors >= 1, llama3's high_freq_factor > low_freq_factor and original_max_positions >= 1). The
// message names the field, e.g. "n_heads: 8 is not a multiple of n_kv_heads 3". head_dim outside
// the compression engine's limits is accepted: the model itself does not care.
absl::Status ValidateConfig(const LlamaConfig& config);

// Per rotary pair i in [0, head_dim/2): the angle per position, with the config's scaling
// applied. Pair i of a head at position p turns by p * result[i].
std::vector<double> RopeInverseFrequencies(const RopeConfig& rope, int head_dim);

// The model's RoPE as the compression engine's RopeParams (kvc/rope.h: theta, pairs, linear
// factor), for the policies that rotate keys or queries. INVALID_ARGUMENT when the engine cannot
// express it (llama3 scaling).
absl::StatusOr<RopeParams> EngineRope(const LlamaConfig& config);

// Number of fp32 values a llama2.c checkpoint with this (valid) config holds after the header,
// including the legacy RoPE tables. Fails (naming the config) if the count does not fit in 64
// bits.
absl::StatusOr<uint64_t> CheckpointFloatCount(const LlamaConfig& config);

// The weights of one model, in fp32, in memory. Immutable after loading; safe to share across
// threads.
class Checkpoint {
 public:
  // A directory is read as a Hugging Face checkpoint (LoadHuggingFace), anything else as a
  // llama2.c file (LoadLlama2c).
  static absl::StatusOr<Checkpoint> Load(const std::string& path);

  // Reads and validates a llama2.c file. Errors (nothing is kept on error):
  //   NOT_FOUND / INTERNAL when the file cannot be opened or read;
  //   INVALID_ARGUMENT when the file is shorter than the header, the header is inconsistent
  //   (ValidateConfig), or the file size differs from what the header implies (message gives both
  //   sizes: truncated files and trailing bytes are both rejected).
  static absl::StatusOr<Checkpoint> LoadLlama2c(const std::string& path);

  // Reads a Hugging Face LlamaForCausalLM directory: config.json, then model.safetensors or the
  // shards named by model.safetensors.index.json ("weight_map"). Tensors may be F32, BF16 or F16
  // and are converted to fp32. config.json supplies hidden_size, intermediate_size,
  // num_hidden_layers, num_attention_heads, vocab_size (required); num_key_value_heads (default:
  // num_attention_heads), head_dim (default hidden_size / num_attention_heads),
  // max_position_embeddings (2048), rms_norm_eps (1e-6), tie_word_embeddings (false),
  // bos_token_id (none), and the RoPE either as rope_theta (10000) + rope_scaling (null or
  // {"rope_type"|"type": "linear"|"llama3", ...}) or as transformers 5's rope_parameters
  // {"rope_theta", "rope_type": "default"|"linear"|"llama3", ...}. RoPE pairs are half-split.
  // Tensor names: model.embed_tokens.weight, model.layers.{i}.input_layernorm.weight,
  // .self_attn.{q,k,v,o}_proj.weight, .post_attention_layernorm.weight,
  // .mlp.{gate,up,down}_proj.weight, model.norm.weight, lm_head.weight (ignored when tied).
  // Errors (INVALID_ARGUMENT unless said; each names the file, key or tensor):
  //   NOT_FOUND: no config.json, no model.safetensors / index, a shard the index names is absent;
  //   config.json not JSON, a key of the wrong type or value, another architecture or model_type
  //   than Llama, hidden_act other than silu, attention_bias or mlp_bias true, a rope type other
  //   than default/linear/llama3, partial_rotary_factor != 1, a quantization_config;
  //   a missing tensor (named), a tensor of the wrong shape (both shapes), dtype (not F32/BF16/
  //   F16), an unknown tensor (e.g. a bias), a tensor in two shards or not where the index says;
  //   RESOURCE_EXHAUSTED when the weights cannot be allocated.
  static absl::StatusOr<Checkpoint> LoadHuggingFace(const std::string& dir);

  Checkpoint(Checkpoint&&) = default;
  Checkpoint& operator=(Checkpoint&&) = default;
  Checkpoint(const Checkpoint&) = delete;
  Checkpoint& operator=(const Checkpoint&) = delete;

  const LlamaConfig& config() const { return config_; }

  const float* token_embedding() const { return at(embedding_); }  // [vocab, dim]
  const float* attn_norm(int layer) const { return at(attn_norm_, layer, config_.dim); }
  const float* wq(int layer) const { return at(wq_, layer, QSize()); }   // [q_dim, dim]
  const float* wk(int layer) const { return at(wk_, layer, KvSize()); }  // [kv_dim, dim]
  const float* wv(int layer) const { return at(wv_, layer, KvSize()); }  // [kv_dim, dim]
  const float* wo(int layer) const { return at(wo_, layer, QSize()); }   // [dim, q_dim]
  const float* ffn_norm(int layer) const { return at(ffn_norm_, layer, config_.dim); }
  const float* w1(int layer) const { return at(w1_, layer, FfnSize()); }  // [hidden, dim]
  const float* w2(int layer) const { return at(w2_, layer, FfnSize()); }  // [dim, hidden]
  const float* w3(int layer) const { return at(w3_, layer, FfnSize()); }  // [hidden, dim]
  const float* final_norm() const { return at(final_norm_); }             // [dim]
  const float* classifier() const { return at(classifier_); }             // [vocab, dim]

 private:
  Checkpoint() = default;
  size_t QSize() const { return static_cast<size_t>(config_.q_dim()) * config_.dim; }
  size_t KvSize() const { return static_cast<size_t>(config_.kv_dim()) * config_.dim; }
  size_t FfnSize() const { return static_cast<size_t>(config_.hidden_dim) * config_.dim; }
  const float* at(size_t offset) const { return data_.data() + offset; }
  const float* at(size_t offset, int layer, size_t stride) const {
    return data_.data() + offset + static_cast<size_t>(layer) * stride;
  }
  // Sets the offsets of the llama2.c order (embedding, per-layer tensors stacked, final norm) and
  // returns the float count up to the final norm's end.
  size_t LayOut();

  LlamaConfig config_;
  std::vector<float> data_;  // llama2.c: everything after the header; HF: the same order
  size_t embedding_ = 0, attn_norm_ = 0, wq_ = 0, wk_ = 0, wv_ = 0, wo_ = 0, ffn_norm_ = 0, w1_ = 0,
         w2_ = 0, w3_ = 0, final_norm_ = 0, classifier_ = 0;
};

}  // namespace kvc::model

#endif  // KVC_MODEL_CHECKPOINT_H_

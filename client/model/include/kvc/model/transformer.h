// A reference Llama transformer in fp32 on the CPU, for the fidelity tests and tools: RMSNorm
// (epsilon from the config), RoPE on channel pairs (2i, 2i+1) or (i, i + head_dim/2) with the
// config's theta and scaling, GQA attention, SwiGLU FFN. Two independent code paths: Forward (a
// whole sequence at once: OpenBLAS sgemm for the projections, the FFN and the classifier, causal
// attention in blocks of query rows) and DecodeStep (one token against a KvCache, sgemv). They
// agree to float rounding; the tests check that, and check both against a plain reference and
// against Hugging Face transformers.
#ifndef KVC_MODEL_TRANSFORMER_H_
#define KVC_MODEL_TRANSFORMER_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvc/model/checkpoint.h"
#include "kvc/model/kv_cache.h"

namespace kvc::model {

// llama2.c's BOS token (its checkpoints do not say; LlamaConfig::bos_token holds the model's).
inline constexpr int32_t kBosToken = 1;

struct ForwardOptions {
  // Positions whose logits are computed: -1 every position, else the last min(N, seq_len) (0:
  // none). The classifier is the largest single product of a long prefill of a small model.
  int last_logits = -1;
  // Whether ForwardOutput::layers is filled (the post-RoPE q, k, v of every layer).
  bool keep_layers = true;
};

struct ForwardOutput {
  int seq_len = 0;
  int vocab_size = 0;
  int logits_first = 0;                  // first position that has logits
  std::vector<float> logits;             // [seq_len - logits_first, vocab]; row for position t
                                         // predicts token t + 1
  std::vector<LayerProjections> layers;  // [n_layers], or empty (ForwardOptions::keep_layers)
  // Logits of position t, for t in [logits_first, seq_len).
  const float* logits_at(int t) const {
    return logits.data() + static_cast<size_t>(t - logits_first) * vocab_size;
  }
};

// Rotates each head's channel pairs of `x` ([heads, head_dim]) for position `pos`, with the
// frequencies of `rope` (default: theta 10000, no scaling).
void ApplyRope(float* x, int heads, int head_dim, int pos,
               RopePairs pairs = RopePairs::kInterleaved);
void ApplyRope(float* x, int heads, int head_dim, int pos, const RopeConfig& rope);

// Seeded temperature sampling. temperature == 0 is greedy (argmax, lowest id on ties). Same seed,
// same logits: same tokens on every platform (own uniform generator, no std distributions).
class Sampler {
 public:
  Sampler(float temperature, uint64_t seed);
  int32_t Sample(absl::Span<const float> logits);

 private:
  double Uniform();  // [0, 1)
  float temperature_;
  uint64_t state_;
};

// The model. Immutable; all methods are const and thread-safe.
class Transformer {
 public:
  // The checkpoint's own config (llama2.c: interleaved RoPE pairs; Hugging Face: half-split).
  explicit Transformer(Checkpoint checkpoint) : ck_(std::move(checkpoint)), config_(ck_.config()) {}
  // The same weights with RoPE pairs overridden (the tests run llama2.c weights both ways).
  Transformer(Checkpoint checkpoint, RopePairs pairs)
      : ck_(std::move(checkpoint)), config_(ck_.config()) {
    config_.rope.pairs = pairs;
  }
  // Checkpoint::Load: a directory is a Hugging Face checkpoint, a file a llama2.c one.
  static absl::StatusOr<Transformer> Load(const std::string& path);

  const LlamaConfig& config() const { return config_; }
  RopePairs rope_pairs() const { return config_.rope.pairs; }

  // Full causal forward pass over `tokens` at positions 0..S-1. INVALID_ARGUMENT when tokens is
  // empty, longer than config().seq_len, or holds an id outside [0, vocab_size), or
  // options.last_logits < -1. RESOURCE_EXHAUSTED when its buffers cannot be allocated.
  absl::StatusOr<ForwardOutput> Forward(absl::Span<const int32_t> tokens,
                                        const ForwardOptions& options = {}) const;

  // Decodes `token` at cache->position(): appends its K/V to the cache, writes the next-token
  // logits into `logits` (size vocab_size). When `attn_out` is not null it receives each layer's
  // attention output (before the output projection): [n_layers, q_dim].
  // Checks the token id, the logits size and cache->CanAppend() before touching the cache; an
  // error from the cache's attention itself leaves the cache unusable.
  absl::Status DecodeStep(int32_t token, KvCache* cache, absl::Span<float> logits,
                          std::vector<float>* attn_out = nullptr) const;

  // Extends `prompt` (non-empty) by `n_new` sampled tokens using a full KV cache; returns prompt +
  // new tokens. Does not stop at BOS: the model starts a new story after one. The total must not
  // exceed config().seq_len.
  absl::StatusOr<std::vector<int32_t>> Generate(absl::Span<const int32_t> prompt, int n_new,
                                                Sampler* sampler) const;

  // Mean negative log-likelihood (nats/token) of tokens[1..] given their prefixes.
  absl::StatusOr<double> MeanNll(absl::Span<const int32_t> tokens) const;

 private:
  absl::Status CheckTokens(absl::Span<const int32_t> tokens) const;
  Checkpoint ck_;
  LlamaConfig config_;
};

}  // namespace kvc::model

#endif  // KVC_MODEL_TRANSFORMER_H_

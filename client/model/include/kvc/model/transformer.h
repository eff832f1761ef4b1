// A reference Llama transformer in fp32 on the CPU, for the fidelity tests and tools: RMSNorm
// (eps 1e-5), RoPE on channel pairs (2i, 2i+1) by default or (i, i + head_dim/2) (RopePairs) with
// frequency 10000^(-2i/head_dim), GQA attention, SwiGLU FFN. Two independent code paths: Forward
// (a whole sequence at once, causal attention per position) and DecodeStep (one token against a
// KvCache). They agree to float rounding; the tests check that.
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

inline constexpr int32_t kBosToken = 1;
inline constexpr float kRmsNormEps = 1e-5f;

struct ForwardOutput {
  int seq_len = 0;
  int vocab_size = 0;
  std::vector<float> logits;             // [seq_len, vocab_size]; row t predicts token t + 1
  std::vector<LayerProjections> layers;  // [n_layers]
  const float* logits_at(int t) const {
    return logits.data() + static_cast<size_t>(t) * vocab_size;
  }
};

// Which channels RoPE pairs: (2i, 2i+1) as llama2.c and Meta's checkpoints (the default), or
// (i, i + head_dim/2) as Hugging Face Llama and GPT-NeoX. The checkpoint does not say; the tests
// run the same weights both ways to cover both conventions.
enum class RopePairs { kInterleaved, kHalfSplit };

// Rotates each head's channel pairs of `x` ([heads, head_dim]) for position `pos`.
void ApplyRope(float* x, int heads, int head_dim, int pos,
               RopePairs pairs = RopePairs::kInterleaved);

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
  explicit Transformer(Checkpoint checkpoint, RopePairs pairs = RopePairs::kInterleaved)
      : ck_(std::move(checkpoint)), pairs_(pairs) {}
  static absl::StatusOr<Transformer> Load(const std::string& path);

  const LlamaConfig& config() const { return ck_.config(); }
  RopePairs rope_pairs() const { return pairs_; }

  // Full causal forward pass over `tokens` at positions 0..S-1. INVALID_ARGUMENT when tokens is
  // empty, longer than config().seq_len, or holds an id outside [0, vocab_size).
  absl::StatusOr<ForwardOutput> Forward(absl::Span<const int32_t> tokens) const;

  // Decodes `token` at cache->position(): appends its K/V to the cache, writes the next-token
  // logits into `logits` (size vocab_size). When `attn_out` is not null it receives each layer's
  // attention output (before the output projection): [n_layers, n_heads * head_dim].
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
  RopePairs pairs_;
};

}  // namespace kvc::model

#endif  // KVC_MODEL_TRANSFORMER_H_

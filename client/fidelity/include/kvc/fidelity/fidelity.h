// Fidelity of compressed KV caches on a real model: sample sequences, run the prefix through the
// reference transformer, compress each layer's cache, decode the continuation teacher-forced on
// the compact cache (attention on the packed bytes), and compare with full-cache decoding.
#ifndef KVC_FIDELITY_FIDELITY_H_
#define KVC_FIDELITY_FIDELITY_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"
#include "kvc/spec.h"

namespace kvc::fidelity {

struct RunOptions {
  int num_sequences = 16;    // sampled from BOS, sequence i with seed `seed + i`
  int prefix_len = 256;      // P: tokens whose cache is compressed
  int continuation = 64;     // C: tokens decoded teacher-forced on the compressed cache
  int obs_window = 32;       // W: observation queries (the last W prefix positions); <= P
  float temperature = 1.0f;  // sampling temperature of the sequences
  uint64_t seed = 1;
};

// INVALID_ARGUMENT naming the field: counts < 1, W outside [0, P], P + C above the model's
// seq_len.
absl::Status ValidateRunOptions(const RunOptions& options, const model::LlamaConfig& config);

// The uncompressed cache of one prefix, per layer in HND: k, v [Hkv, P, D] and q (the observation
// queries only) [Hq, W, D]. This is what a prefill node would push.
struct PrefixCache {
  int prefix_len = 0;
  int obs_window = 0;
  int num_kv_heads = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  std::vector<model::LayerProjections> layers;
  RopeParams rope;  // the model's RoPE (expected attention)
  // Per layer, calibration statistics of the un-rotated queries of the *other* sequences' whole
  // prefixes (leave-one-out), float32 [Hq, D + D*D] (TENSOR_Q_STATS): what an engine could send
  // without this request's queries.
  std::vector<std::vector<float>> q_stats;

  // Views for Backend::Compress (fp32, HND); valid while this object lives.
  LayerInput Input(int layer) const;
  uint64_t full_bytes() const;  // K + V bytes, fp32
};

// Produces one compact blob per layer from a prefix cache. `sequence` identifies the sequence
// (for naming remote caches).
using Compressor = std::function<absl::StatusOr<std::vector<CompactLayer>>(
    const PrefixCache& prefix, const CompressionSpec& spec, int sequence)>;

// Compresses in this process with `backend` (not owned; must outlive the returned function).
Compressor InProcessCompressor(Backend* backend);

struct Metrics {
  int steps = 0;              // compared next-token distributions (sequences x C)
  double top1_agreement = 0;  // fraction of steps where argmax(compressed) == argmax(full)
  double mean_kl = 0;         // mean KL(full || compressed) in nats
  double max_kl = 0;
  std::vector<double> attn_rel_err;  // per layer: mean ||o_c - o_f|| / ||o_f||
  double mean_attn_rel_err = 0;      // over layers
  double size_ratio = 0;             // compact bytes / full fp32 K+V bytes
};

// Holds the sampled sequences, their prefix caches and the full-cache reference. Not thread-safe.
class FidelityEval {
 public:
  // Samples the sequences and runs the reference. `model` and `attention` (may be null: then
  // kvc::PackedAttentionCpu) must outlive the object.
  static absl::StatusOr<std::unique_ptr<FidelityEval>> Create(const model::Transformer* model,
                                                              const RunOptions& options,
                                                              Backend* attention);

  // Compresses every prefix with `compressor` and scores decoding on the compact caches. Errors
  // of the compressor (e.g. an invalid spec) are returned as they are.
  absl::StatusOr<Metrics> Evaluate(const CompressionSpec& spec, const Compressor& compressor);

  // Decodes the continuation of sequence `i` on the given compact layers and returns the logits
  // [C, vocab] (for tests comparing blob sources).
  absl::StatusOr<std::vector<float>> DecodeOnCompact(int i, std::vector<CompactLayer> layers);

  const RunOptions& options() const { return options_; }
  const std::vector<std::vector<int32_t>>& sequences() const { return sequences_; }
  const PrefixCache& prefix(int i) const { return prefixes_[i]; }

 private:
  FidelityEval(const model::Transformer* model, const RunOptions& options, Backend* attention)
      : model_(model), options_(options), attention_(attention) {}
  absl::Status Prepare();

  const model::Transformer* model_;
  RunOptions options_;
  Backend* attention_;
  std::vector<std::vector<int32_t>> sequences_;
  std::vector<PrefixCache> prefixes_;
  // Full-cache reference per sequence: log-probabilities [C, vocab], argmax [C], attention
  // outputs [C, n_layers * dim].
  std::vector<std::vector<double>> ref_logp_;
  std::vector<std::vector<int32_t>> ref_top1_;
  std::vector<std::vector<float>> ref_attn_;
};

// Quantization group size for a model: `requested` when > 0, else min(32, head_dim). Must divide
// head_dim (INVALID_ARGUMENT naming quant_group otherwise).
absl::StatusOr<int> ResolveQuantGroup(int requested, int head_dim);

// One row of a sweep.
struct SweepEntry {
  std::string family;  // "eviction", "think", "quant"
  std::string label;   // e.g. "snapkv@0.50", "snapkv@0.50+think0.25", "quant4"
  std::string policy;  // eviction policy name
  double keep_ratio = 1.0;
  CompressionSpec spec;
};

// The default sweep: keep ratios {1.0, 0.75, 0.5, 0.25} for every eviction policy but none;
// ThinK key-channel pruning at lambda 0.25 and 0.5 on top of snapkv keeping 0.5; 4- and 2-bit
// quantization of all tokens (no eviction) with group size `quant_group`; then, at keep 0.5 and
// 0.25, value-aware h2o/snapkv/keyformer (mul, add), expected attention from the observation
// queries and from calibration statistics (stats=1), and keydiff, labelled by spec string.
std::vector<SweepEntry> DefaultSweep(int quant_group);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_FIDELITY_H_

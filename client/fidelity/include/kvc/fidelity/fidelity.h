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
#include "absl/strings/string_view.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/fidelity/recon.h"
#include "kvc/fidelity/sweep.h"
#include "kvc/layer.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"
#include "kvc/rope.h"
#include "kvc/spec.h"

namespace kvc::fidelity {

// The two ways a stored cache is used; both compress a prefix of the same sampled sequence and
// score the same C next-token distributions (the continuation s[P, P+C), teacher-forced), against
// full-cache decoding of s[0, P+C). The last W prompt tokens s[P-W, P) are "the question".
//   kInside: question inside the compressed prompt. The compressed prefix is s[0, P); the
//            observation window is the question (the queries of s[P-W, P)), as SnapKV assumes.
//            Then s[P, P+C) is decoded on the compact cache.
//   kAfter:  question after compression, as a prefix cache or an earlier chat turn is used. Only
//            s[0, P-W) is compressed, knowing nothing of what follows: with W = 0 (no queries) when
//            the spec can run without queries, else with the queries of its own last W positions
//            s[P-2W, P-W) (clamped to P-W). Then the question s[P-W, P) is decoded uncompressed
//            onto the compact cache (not scored) and s[P, P+C) is decoded and scored.
// With W = 0 there is no question and the two coincide.
enum class Scenario { kInside, kAfter };
absl::string_view ScenarioName(Scenario s);  // "inside", "after"
// "inside", "after", a comma-separated list of them, or "both" (= inside,after); no duplicates.
absl::StatusOr<std::vector<Scenario>> ParseScenarios(absl::string_view text);

struct RunOptions {
  int num_sequences = 16;    // sampled from the model's BOS, sequence i with seed `seed + i`
  int prefix_len = 256;      // P: the prompt (tokens before the scored continuation)
  int continuation = 64;     // C: tokens decoded teacher-forced on the compressed cache, scored
  int obs_window = 32;       // W: observation queries and question length; <= P (< P for kAfter)
  float temperature = 1.0f;  // sampling temperature of the sequences
  uint64_t seed = 1;
  // When not empty: these sequences instead of sampled ones (exactly num_sequences of them, each
  // of at least P + C valid token ids; only the first P + C are used).
  std::vector<std::vector<int32_t>> given_sequences;
  // kvzip: the reconstruction passes' prompts and chunk (recon.h; the ids may be empty). A pass
  // needs the prefix + its prompt + its chunk positions of the model.
  ReconPrompts kvzip;
};

// INVALID_ARGUMENT naming the field: counts < 1, W outside [0, P], P + C above the model's
// seq_len, given_sequences of the wrong count, length or token range, kvzip prompt ids outside
// the vocabulary, a negative kvzip chunk.
absl::Status ValidateRunOptions(const RunOptions& options, const model::LlamaConfig& config);

// The uncompressed cache of one prefix, per layer in HND: k, v [Hkv, P, D] and q (the observation
// queries only) [Hq, W, D]. This is what a prefill node would push. Copies share the tensors.
// For kvzip, `recon` holds the reconstruction pass's rows instead (obs_window is then its W).
struct PrefixCache {
  int prefix_len = 0;
  int obs_window = 0;
  int num_kv_heads = 0;
  int num_q_heads = 0;
  int head_dim = 0;
  std::shared_ptr<const std::vector<model::LayerProjections>> layers;
  RopeParams rope;  // the model's RoPE (expected attention)
  // Per layer, calibration statistics of the un-rotated queries of the *other* sequences' whole
  // prefixes (leave-one-out), float32 [Hq, D + D*D] (TENSOR_Q_STATS): what an engine could send
  // without this request's queries. Shared by the scenarios of one sequence.
  std::shared_ptr<const std::vector<std::vector<float>>> q_stats;
  // kvzip: Q_obs is the pass's queries and Q_stats their log-masses (obs_window == recon->rows).
  std::shared_ptr<const ReconstructionPass> recon;

  int num_layers() const { return layers ? static_cast<int>(layers->size()) : 0; }
  // Views for Backend::Compress (fp32, HND); valid while this object lives. q_obs is null when
  // obs_window is 0.
  LayerInput Input(int layer) const;
  // The shape of every layer (fp32 HND tensors of prefix_len tokens).
  LayerShape shape() const;
  uint64_t full_bytes() const;  // K + V bytes, fp32
};

// Produces one compact blob per layer from a prefix cache. `sequence` identifies the sequence
// (for naming remote caches).
using Compressor = std::function<absl::StatusOr<std::vector<CompactLayer>>(
    const PrefixCache& prefix, const CompressionSpec& spec, int sequence)>;

// Compresses in this process with `backend` (not owned; must outlive the returned function),
// one layer at a time: a spec with layer-adaptive budgets (xlayer=1) is INVALID_ARGUMENT.
Compressor InProcessCompressor(Backend* backend);

// Whether the spec needs observation queries on layers of `shape`: it passes ValidateSpec with
// obs_window max(1, shape.obs_window) and fails with 0 (h2o, snapkv, keyformer, think, value
// pruning, and any later policy ValidateSpec marks so). False when it is invalid anyway.
bool NeedsQueries(const CompressionSpec& spec, LayerShape shape);

struct Metrics {
  int steps = 0;              // compared next-token distributions (sequences x C)
  double top1_agreement = 0;  // fraction of steps where argmax(compressed) == argmax(full)
  double mean_kl = 0;         // mean KL(full || compressed) in nats
  double max_kl = 0;
  // Per layer: mean over scored steps of ||o_c - o_f|| / ||o_f||, the layer's attention output
  // (all heads) when the FULL model's continuation queries, keys and values at that layer attend
  // over the compressed prefix (o_c) or the full one (o_f): the layer's own compression error,
  // seen by the queries that use the cache, with no error carried over from earlier layers.
  std::vector<double> attn_rel_err;
  double mean_attn_rel_err = 0;  // over layers
  double size_ratio = 0;         // compact bytes / full fp32 K+V bytes of the compressed prefix
  uint64_t compact_bytes = 0;    // summed over sequences and layers
  uint64_t full_bytes = 0;       // fp32 K+V of the compressed prefixes, summed
  int obs_window = 0;            // W sent with the compressed prefix
  // Per sequence (for intervals): top-1 agreement and mean KL over its C steps.
  std::vector<double> seq_top1, seq_kl;
};

// Holds the sampled sequences, their prefix caches and the full-cache reference. Not thread-safe.
class FidelityEval {
 public:
  // Samples the sequences from the model's BOS token (or takes options.given_sequences) and runs
  // the reference. `model` and `attention` (may be null: then kvc::PackedAttentionCpu) must
  // outlive the object. INVALID_ARGUMENT for invalid options, a model whose RoPE the engine
  // cannot express (model::EngineRope), or sampling asked of a model without a BOS token.
  static absl::StatusOr<std::unique_ptr<FidelityEval>> Create(const model::Transformer* model,
                                                              const RunOptions& options,
                                                              Backend* attention);

  // Compresses every prefix with `compressor` as `scenario` defines and scores decoding on the
  // compact caches. Errors of the compressor (e.g. an invalid spec) are returned as they are.
  absl::StatusOr<Metrics> Evaluate(const CompressionSpec& spec, const Compressor& compressor,
                                   Scenario scenario = Scenario::kInside);

  // Decodes the continuation of sequence `i` on the given compact layers of the kInside prefix
  // and returns the logits [C, vocab] (for tests comparing blob sources).
  absl::StatusOr<std::vector<float>> DecodeOnCompact(int i, std::vector<CompactLayer> layers);

  const RunOptions& options() const { return options_; }
  const std::vector<std::vector<int32_t>>& sequences() const { return sequences_; }
  // The kInside prefix of sequence i (what Evaluate compresses for kInside).
  const PrefixCache& prefix(int i) const { return inside_[i]; }
  // What Evaluate compresses for sequence i, `scenario` and `spec`: for kvzip with the
  // reconstruction pass of that prefix (run on first use, then kept: about 4 x layers x Hq x
  // (P + prompt) x D bytes per sequence and scenario). INVALID_ARGUMENT as
  // CheckReconstructionSpec and RunReconstruction say (e.g. a pass past the model's seq_len).
  absl::StatusOr<PrefixCache> CompressedPrefix(int i, Scenario scenario,
                                               const CompressionSpec& spec);

 private:
  FidelityEval(const model::Transformer* model, const RunOptions& options, Backend* attention)
      : model_(model), options_(options), attention_(attention) {}
  absl::Status Prepare();
  absl::Status PrepareSequence(std::vector<int32_t> seq);
  void SetCalibrationStatistics();

  const model::Transformer* model_;
  RunOptions options_;
  Backend* attention_;
  RopeParams rope_;  // the model's RoPE in the engine's terms
  std::vector<std::vector<int32_t>> sequences_;
  // Per sequence: the prefixes Evaluate compresses: s[0, P) with the question's queries;
  // s[0, P-W) with its own last queries, and the same without queries.
  std::vector<PrefixCache> inside_, after_, after_no_queries_;
  // Per sequence: kvzip's reconstruction passes of the inside and after prefixes (on first use).
  std::vector<std::shared_ptr<const ReconstructionPass>> recon_inside_, recon_after_;
  // Per sequence, while preparing: sums of the un-rotated prefix queries and their outer
  // products [layers, Hq, D + D*D].
  std::vector<std::vector<double>> query_sums_;
  // Per sequence, per layer: the full model's q, k, v of positions [P-W, P+C) (HND, that many
  // positions), fed to a compact cache for the per-layer attention error.
  std::vector<std::vector<model::LayerProjections>> tail_;
  // Full-cache reference per sequence: log-probabilities [C, vocab], argmax [C], and each layer's
  // attention output for the full model's own continuation queries [C, n_layers * dim].
  std::vector<std::vector<double>> ref_logp_;
  std::vector<std::vector<int32_t>> ref_top1_;
  std::vector<std::vector<float>> ref_attn_;
};

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_FIDELITY_H_

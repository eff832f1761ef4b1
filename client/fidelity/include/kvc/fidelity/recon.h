// KVzip's context reconstruction for the fidelity tools: the queries kvcd's `kvzip` policy scores
// with, produced by the reference transformer instead of a serving engine.
//
// KVzip runs the model once more on top of the context's cache, on a prompt that asks it to
// repeat the context followed by the context itself; a cached token's score is the attention
// those queries give it. Here that pass is one causal forward over context + prompt + context
// (the same keys and values for the first S positions as the context's own prefill), so each
// row's post-RoPE query and its log-mass over the pass's own keys come out of one Forward.
// `prompt` is token ids: kvc.recon's "\n\nRepeat the previous context exactly." and "\n" for a
// Hugging Face model (tokenized in Python), or nothing for the tiny llama2.c models, which follow
// no instruction: their copy heads repeat a context given right after itself.
// One pass over the whole context: no chunking (kvcd's `passes=` option is refused by the tools).
#ifndef KVC_FIDELITY_RECON_H_
#define KVC_FIDELITY_RECON_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "kvc/model/transformer.h"
#include "kvc/spec.h"

namespace kvc::fidelity {

struct ReconstructionPass {
  int context_len = 0;  // S
  int rows = 0;         // W = prompt tokens + S
  // Per layer: the pass's post-RoPE queries, HND [Hq, W, D] (the upload's Q_obs), and for each
  // query head and row the log of sum_j exp(q . k_j / sqrt(D)) over the pass's own keys j up to
  // and including the row's position ([Hq, W]; Q_stats with kvzip's `stats=1`).
  std::vector<std::vector<float>> q, log_mass;
};

// Runs the pass for `context` (S >= 1 tokens). INVALID_ARGUMENT when the context is empty or the
// pass (2 S + prompt positions) is longer than the model's seq_len (the message names both), or
// for a token id outside the vocabulary; RESOURCE_EXHAUSTED when its buffers cannot be allocated.
absl::StatusOr<ReconstructionPass> RunReconstruction(const model::Transformer& model,
                                                     absl::Span<const int32_t> context,
                                                     absl::Span<const int32_t> prompt);

// OK when the pass of a `context_len`-token context fits the model: 2 x context_len + prompt_len
// positions <= config.seq_len (and context_len >= 1); else INVALID_ARGUMENT naming the numbers.
absl::Status CheckReconstructionFits(const model::LlamaConfig& config, int64_t context_len,
                                     int64_t prompt_len);

// OK, or INVALID_ARGUMENT "kvzip_prompt: token T is outside [0, vocab V)".
absl::Status CheckKVzipPrompt(const model::LlamaConfig& config, absl::Span<const int32_t> prompt);

// Token ids separated by spaces and/or commas ("" gives none); INVALID_ARGUMENT naming `flag` for
// anything that is not a non-negative 32-bit integer.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view text, absl::string_view flag);

// Whether `spec` scores with reconstruction queries (its eviction policy is kvzip).
bool NeedsReconstruction(const CompressionSpec& spec);

// OK, or INVALID_ARGUMENT for a kvzip spec the tools cannot feed: one that names reconstruction
// passes (`passes=`), since they run one pass over the whole context.
absl::Status CheckReconstructionSpec(const CompressionSpec& spec);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_RECON_H_

// KVzip's context reconstruction for the fidelity tools: the queries kvcd's `kvzip` policy scores
// with, produced by the reference transformer instead of a serving engine.
//
// KVzip runs the model once more on top of the context's cache, on a prompt that asks it to
// repeat the context followed by the context itself; a cached token's score is the attention
// those queries give it. Here a pass is one causal forward over context + pass tokens (the same
// keys and values for the first S positions as the context's own prefill), so each row's
// post-RoPE query and its log-mass over the pass's own keys come out of one Forward.
// A context longer than `chunk` tokens is repeated one chunk at a time, as kvc.recon (and KVzip)
// do: the first pass runs `prompt` + chunk 0, every later one `part_prompt` + the previous chunk's
// last kReconOverlap tokens + `part_suffix` + its chunk. The rows of every pass are concatenated,
// and the pass structure goes to kvcd as the spec's pass_rows / pass_tokens (SpecForPasses), so
// that each row is normalised over the sinks and its own chunk, as kvpress's KVzipPress does.
// The ids are kvc.recon's: for a Hugging Face model `prompt` is "\n\nRepeat the previous context
// exactly." + "\n", `part_prompt` "\n\nRepeat the part of the previous context exactly, starting
// with" and `part_suffix` "\n" (tokenized in Python); the tiny llama2.c models follow no
// instruction and take none (their copy heads repeat a context given right after itself).
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

// A later pass's prompt ends with this many of the previous chunk's last tokens (kvc.recon's).
inline constexpr int kReconOverlap = 8;

// How a context is split into reconstruction passes, and what each pass runs before its chunk.
struct ReconPrompts {
  std::vector<int32_t> prompt;       // the first (or only) pass's instruction and newline
  std::vector<int32_t> part_prompt;  // a later pass's instruction, before the overlap
  std::vector<int32_t> part_suffix;  // a later pass's ids after the overlap, before its chunk
  // Context tokens one pass repeats (kvc.recon's and kvpress's 2,048 by default); 0: one pass
  // over the whole context, however long.
  int chunk = kDefaultPassTokens;
};

// One pass of a context of `context_len` tokens: it repeats context tokens [start, end) after
// `head` (its prompt ids, and for a later pass the overlap).
struct ReconPassPlan {
  int start = 0, end = 0;
  std::vector<int32_t> head;
  // The pass's tokens, each a reconstruction row: head + end - start.
  int rows() const { return static_cast<int>(head.size()) + end - start; }
};

// The passes of `context` under `prompts` (one when it fits in a chunk, or chunk is 0).
std::vector<ReconPassPlan> PlanReconstruction(absl::Span<const int32_t> context,
                                              const ReconPrompts& prompts);

struct ReconstructionPass {
  int context_len = 0;  // S
  int rows = 0;         // W = the rows of every pass (prompt tokens + S with one pass)
  // Per layer: the passes' post-RoPE queries, HND [Hq, W, D] (the upload's Q_obs), and for each
  // query head and row the log of sum_j exp(q . k_j / sqrt(D)) over its pass's own keys j up to
  // and including the row's position ([Hq, W]; Q_stats with kvzip's `stats=1`).
  std::vector<std::vector<float>> q, log_mass;
  // With more than one pass: each pass's row count (they sum to W) and the chunk; empty for one.
  std::vector<int> pass_rows;
  int pass_tokens = 0;
};

// Runs the passes for `context` (S >= 1 tokens). INVALID_ARGUMENT when the context is empty, a
// pass (S + its tokens positions) is longer than the model's seq_len (the message names the
// numbers), or for a token id outside the vocabulary or a negative chunk; RESOURCE_EXHAUSTED when
// its buffers cannot be allocated.
absl::StatusOr<ReconstructionPass> RunReconstruction(const model::Transformer& model,
                                                     absl::Span<const int32_t> context,
                                                     const ReconPrompts& prompts);

// OK when every pass of a `context_len`-token context fits the model: context_len + the longest
// pass's tokens <= config.seq_len (and context_len >= 1); else INVALID_ARGUMENT naming the numbers.
absl::Status CheckReconstructionFits(const model::LlamaConfig& config, int64_t context_len,
                                     const ReconPrompts& prompts);

// OK, or INVALID_ARGUMENT naming the list ("kvzip_prompt: token T is outside [0, vocab V)") or a
// negative chunk.
absl::Status CheckKVzipPrompts(const model::LlamaConfig& config, const ReconPrompts& prompts);

// The prompts from the tools' flag values (token ids as ParseTokenIds reads them, and the chunk);
// INVALID_ARGUMENT naming the flag.
absl::StatusOr<ReconPrompts> ParseReconPrompts(absl::string_view prompt,
                                               absl::string_view part_prompt,
                                               absl::string_view part_suffix, int chunk);

// Token ids separated by spaces and/or commas ("" gives none); INVALID_ARGUMENT naming `flag` for
// anything that is not a non-negative 32-bit integer.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view text, absl::string_view flag);

// Whether `spec` scores with reconstruction queries (its eviction policy is kvzip).
bool NeedsReconstruction(const CompressionSpec& spec);

// OK, or INVALID_ARGUMENT for a kvzip spec the tools cannot feed: one that names reconstruction
// passes (`passes=`), which depend on each document's length: the tools plan the passes
// themselves (ReconPrompts::chunk) and name them for each document (SpecForPasses).
absl::Status CheckReconstructionSpec(const CompressionSpec& spec);

// `spec` with the passes of `pass` (pass_rows, pass_tokens) when it ran more than one; else
// (one pass, or none: `pass` null, a policy without reconstruction) `spec` unchanged.
CompressionSpec SpecForPasses(const CompressionSpec& spec, const ReconstructionPass* pass);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_RECON_H_

// What to do to a layer: token eviction, then channel pruning on the kept tokens, then
// quantization. Formulas and defaults: DESIGN.md, "Compression policies".
#ifndef KVC_SPEC_H_
#define KVC_SPEC_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvc/layer.h"
#include "kvc/policy.h"

namespace kvc {

// EvictionPolicy and what each policy is: kvc/policy.h.
enum class ChannelPolicy : uint8_t { kNone = 0, kThink = 1, kL1 = 2, kL2 = 3 };
enum class PoolKind : uint8_t { kMax = 0, kAvg = 1 };
enum class Granularity : uint8_t { kPerHead = 0, kPerLayer = 1 };
// Value-aware scores (CriticalKV, Expected Attention): the attention score s_j of token j is
// weighted by its value norm, kMul: s_j * (||v_j|| + eps * n̄), kAdd: (s_j + eps * s̄) * ||v_j||,
// with n̄ and s̄ the head's mean value norm and mean score (so eps is scale-free). kAuto is kMul
// for expected attention and kOff for every other policy.
enum class ValueWeight : uint8_t { kAuto = 0, kOff = 1, kMul = 2, kAdd = 3 };

// Caps on the parameters whose work grows with their value (see kvc/cost.h): snapkv's pooling
// costs seq_len * pool_kernel per head; `horizon` is the number of future positions expected
// attention averages its rotation over (more than any model's context is meaningless: the mean
// rotation of every pair but the slowest is then about 0).
inline constexpr int kMaxPoolKernel = 1023;
inline constexpr int kMaxHorizon = 1 << 20;
// kvzip: context tokens repeated by one reconstruction pass when the client sends passes
// (KVzip's and kvpress's chunk).
inline constexpr int kDefaultPassTokens = 2048;
// kvzip: the most reconstruction rows a token's score may average (EvictionSpec::top_rows).
inline constexpr int kMaxTopRows = 64;

struct EvictionSpec {
  EvictionPolicy policy = EvictionPolicy::kNone;
  // Tokens kept per KV head: `budget` when > 0, else round(keep_ratio * S) (at least 1).
  int budget = 0;
  double keep_ratio = 1.0;  // (0, 1]
  // Optional per-layer budgets in tokens (PyramidKV-style); entry i applies to layer i and wins
  // over budget/keep_ratio. 0 entries fall back to the layer-independent budget.
  std::vector<int> layer_budgets;
  Granularity granularity = Granularity::kPerHead;

  int sink_tokens = 4;             // streaming, kvzip: first tokens always kept
  double recent_fraction = -1.0;   // [0, 1]; h2o 0.5, keyformer 0.3 when < 0
  int pool_kernel = 7;             // snapkv: odd, in [1, kMaxPoolKernel]
  PoolKind pool = PoolKind::kMax;  // snapkv
  double tau = 1.0;                // keyformer temperature, > 0
  uint64_t seed = 0;               // keyformer Gumbel noise, random

  // Head-adaptive budgets (AdaKV): the layer's H * B tokens go where the scores are high, each
  // head keeping at least its protected tokens plus its top floor(adaptive_floor * B); see
  // SelectTokens (kvc/selection.h). Only for scoring policies (all but none and streaming) at
  // per-head granularity. adaptive_floor = 1 gives the uniform selection.
  bool adaptive = false;
  double adaptive_floor = 0.2;  // alpha, [0, 1]
  // Layer-adaptive budgets (needs adaptive): the request's num_layers * H * B tokens go where the
  // scores are highest over all its layers (AllocateAcrossLayers, kvc/layer_budget.h), each
  // (layer, head) keeping its protected tokens plus its top floor(adaptive_floor * B). Needs every
  // layer's scores before any selection: kvcd does it (CPU backend); the engine's per-layer
  // Compress treats it as head-adaptive. Value weighting must be off.
  bool layer_adaptive = false;
  // h2o, snapkv, keyformer, expected: weight scores by value norms (see ValueWeight).
  ValueWeight value_weight = ValueWeight::kAuto;
  double value_eps = 0.02;  // >= 0, finite
  // expected: the query statistics are rotated to the average of the next `horizon` positions
  // (S .. S + horizon - 1), in [1, kMaxHorizon]. Default 1 (the next position): on stories260K
  // (head_dim 8, 64 decoded tokens, seeds 1/101/201) top-1 agreement fell with the horizon, 1 > 8 >
  // 128 at keep 0.5 and 0.25, because averaging the rotation cancels the fast-turning channel
  // pairs.
  int horizon = 1;
  // expected: query statistics come from the client (LayerInput::q_stats) instead of Q_obs; the
  // only source when obs_window is 0. kvzip: q_stats holds, per query head and observation row,
  // the log of sum_j exp(q . k_j / sqrt(D)) over the keys the row attends to that the upload does
  // not hold (its reconstruction pass's own tokens), added to the softmax's denominator (KVzip's
  // normalisation); float32 [Hq, W].
  bool query_stats = false;
  // kvzip: the observation rows come from reconstruction passes that each repeat one chunk of
  // the context (KVzip's chunked reconstruction). Pass i's rows are the next pass_rows[i] (in
  // order; they sum to obs_window) and it repeats context tokens [i * pass_tokens, min(S, (i + 1)
  // * pass_tokens)); each of its rows is normalised over the first sink_tokens keys, its chunk
  // and (q_stats) its own pass's tokens, and scores only those keys. Empty: every row sees all
  // S keys.
  std::vector<int> pass_rows;
  int pass_tokens = kDefaultPassTokens;  // >= 1; read only with pass_rows
  // kvzip: a token's score is the mean of the top_rows largest probabilities the group's rows
  // give it (absent rows count 0), in [1, kMaxTopRows]; 1: the largest (KVzip's score).
  int top_rows = 1;
};

struct ChannelSpec {
  ChannelPolicy key_policy = ChannelPolicy::kNone;
  double key_lambda = 0.0;    // [0, 1): keep T = D - floor(lambda * D) key channels per KV head
  bool prune_values = false;  // query-driven value channel pruning (ThinK appendix)
  double value_lambda = 0.0;  // [0, 1)
};

struct QuantSpec {
  int bits = 0;         // 0 (off), 2, 4 or 8: the keys' bits, and the values' unless value_bits
  int group_size = 32;  // keys: tokens per group (per channel); values: channels per group.
                        // Checked only when bits > 0: >= 1 and dividing head_dim.
  int value_bits = 0;   // 0: as bits; 2, 4 or 8: the values' own bits (needs bits > 0)
};

// Bits of the old keys and of the old values (0 when quantization is off).
inline int KeyBits(const QuantSpec& q) { return q.bits; }
inline int ValueBits(const QuantSpec& q) {
  return q.bits > 0 && q.value_bits > 0 ? q.value_bits : q.bits;
}

struct CompressionSpec {
  EvictionSpec eviction;
  ChannelSpec channels;
  QuantSpec quant;
  // r: the most recent kept tokens stay unpruned and in full precision. Applies only when channel
  // pruning or quantization is on (otherwise r = 0). Clamped to the kept count.
  int recent_tokens = 32;
};

// Checks the spec against a layer shape; the message names the field, e.g.
// "eviction.budget: 5000 exceeds seq_len 4096" or "channels.key_lambda: 1.5 is outside [0, 1)".
// Rejects: unknown enum values; budget or layer_budgets entries < 0 or > seq_len; keep_ratio
// outside (0, 1]; sink_tokens < 0; recent_fraction NaN or > 1; pool_kernel even, < 1 or above
// kMaxPoolKernel; tau not finite and > 0; adaptive with a policy that has no scores (row .scores
// false: none, streaming) or with per-layer granularity; adaptive_floor NaN or outside [0, 1]
// (checked only when adaptive); a policy reading observation queries (row .inputs kObservation:
// h2o, snapkv, keyformer), think and prune_values with obs_window 0; lambdas outside [0, 1);
// quant.bits not in {0, 2, 4, 8}; quant.value_bits not in {0, 2, 4, 8}, or set with bits 0;
// recent_tokens < 0; layer_index < 0; value_weight unknown, or on (mul/add) for a policy whose
// row does not compose with it; value_eps negative or not finite; horizon < 1 or above
// kMaxHorizon; query_stats with a policy that reads no query statistics; such a policy
// (expected) with obs_window 0 and no query_stats; obs_window > seq_len unless the policy is
// kvzip ("shape.obs_window: ..."); pass_rows with a policy other than kvzip, with a count other
// than ceil(seq_len / pass_tokens), an entry below its chunk's token count, or entries that do not
// sum to obs_window; pass_tokens < 1 with pass_rows.
absl::Status ValidateSpec(const CompressionSpec& spec, const LayerShape& shape, int layer_index);
// The inputs a valid spec reads beyond K, V and Q_obs: a policy reading query statistics
// (expected) needs in.rope ("rope: ..."), query_stats needs in.q_stats ("q_stats: ...").
absl::Status ValidateSpecInput(const CompressionSpec& spec, const LayerInput& in);

// Tokens kept per KV head for this layer (spec must be valid): seq_len for policy none; else a
// positive layer_budgets[layer_index], else budget when > 0, else max(1, round(keep_ratio * S)).
int EffectiveBudget(const EvictionSpec& spec, int layer_index, int seq_len);

// The keys the rows of kvzip's reconstruction pass p see (EvictionSpec::pass_rows): the sinks
// [0, sink_end) and the pass's chunk [lo, hi) = [p * pass_tokens, min(S, (p + 1) * pass_tokens))
// clamped to seq_len, sink_end = min(lo, sink_tokens). `pass` < pass_rows.size(), which
// validation holds to ceil(seq_len / pass_tokens).
struct PassKeys {
  int sink_end, lo, hi;
};
PassKeys PassKeyRange(const EvictionSpec& spec, int seq_len, size_t pass);
// Channels kept of head_dim D at pruning ratio lambda: D - floor(lambda * D).
int KeptChannels(double lambda, int head_dim);

// Tokens a policy keeps whatever the scores (its row's ProtectedWindow, kvc/policy.h), for a
// budget of B = EffectiveBudget(...) tokens: positions [0, sinks) and [S - recent, S), with
// sinks + recent <= B. Both backends select with these. The spec must be valid for `shape`.
struct ProtectedTokens {
  int sinks = 0;
  int recent = 0;
};
ProtectedTokens ProtectedFor(const EvictionSpec& spec, const LayerShape& shape, int budget);

std::string_view PolicyName(EvictionPolicy p);  // "none", "streaming", "h2o", "snapkv", ...
// Whether the policy scores tokens (its row's .scores, kvc/policy.h): what head-adaptive budgets
// and value-aware weighting need.
bool PolicyHasScores(EvictionPolicy p);
// The shortest decimal form of `v` that reads back as `v` (messages quote values exactly:
// 1.0000001 is not printed as "1").
std::string FormatDouble(double v);
std::string_view PolicyName(ChannelPolicy p);                         // "none", "think", "l1", "l2"
std::string_view ValueWeightName(ValueWeight w);                      // "auto", "off", "mul", "add"
absl::StatusOr<ValueWeight> ParseValueWeight(std::string_view name);  // "" = auto
// kAuto resolved: kMul where the policy's row says value_weight_by_default (expected), else kOff.
ValueWeight EffectiveValueWeight(const EvictionSpec& e);
absl::StatusOr<EvictionPolicy> ParseEvictionPolicy(std::string_view name);
absl::StatusOr<ChannelPolicy> ParseChannelPolicy(std::string_view name);
// Every policy name, for GetServerInfo and --help.
std::vector<std::string> EvictionPolicyNames();
std::vector<std::string> ChannelPolicyNames();

// Spec strings (one-line specs for tools and tests): kvc/protocol/spec_string.h.

}  // namespace kvc

#endif  // KVC_SPEC_H_

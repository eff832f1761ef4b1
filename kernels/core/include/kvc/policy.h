// The token-eviction policies: one row each, read by the spec's validation (kvc/spec.h), the
// selection rules of both backends (protected windows, head-adaptive budgets, value weighting),
// the spec strings and the tools. A backend adds only its scorer, in its own scorer table
// (kernels/cpu/scorers.cc, kernels/cuda/scorers.cc), whose rows follow this table's order.
// Adding a policy: docs/design-notes.md, "Adding a policy". Formulas: ScoreTokens and
// SelectTokens in kvc/selection.h.
//
// Thread-safety: constant data and pure functions.
#ifndef KVC_POLICY_H_
#define KVC_POLICY_H_

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvc {

struct EvictionSpec;  // kvc/spec.h
struct LayerShape;    // kvc/layer.h

// Values are part of the wire format (the compact layer header): never renumber. Each value is
// the index of its row in kPolicies.
enum class EvictionPolicy : uint8_t {
  kNone = 0,  // keep every token
  kStreaming = 1,
  kH2O = 2,
  kSnapKV = 3,
  kKeyformer = 4,
  kKNorm = 5,
  kRandom = 6,
  kKeyDiff = 7,            // query-agnostic: -cos(k_j, mean normalised key of the head)
  kExpectedAttention = 8,  // from query statistics: see ScoreTokens in kvc/selection.h
  kKVzip = 9,              // max attention of context-reconstruction queries (KVzip)
};

// What a policy reads besides K (and V when its scores are value-weighted).
enum class PolicyInputs : uint8_t {
  kKeys,             // nothing more
  kObservation,      // the observation queries Q_obs: shape.obs_window must be > 0 (the last
                     // W prompt positions' queries, or for kvzip the queries of a pass that
                     // repeats the context, which come after it)
  kQueryStatistics,  // the queries' mean and covariance, from Q_obs or from the client
                     // (EvictionSpec::query_stats, the only source when obs_window is 0), and
                     // the model's RoPE (LayerInput::rope, PutCacheHeader.rope)
};

// Positions kept whatever the scores, for a budget of B tokens (see ProtectedFor in kvc/spec.h).
enum class ProtectedWindow : uint8_t {
  kEverything,      // all of them (B = S)
  kSinksAndRecent,  // the first min(sink_tokens, B), then the most recent B - sinks
  kSinks,           // the first min(sink_tokens, B) only
  kRecentFraction,  // the most recent int(f * B), f = recent_fraction, or the row's default
  kObservation,     // the observation window, or its most recent B tokens when B < W
  kNothing,
};

// How head-adaptive budgets (EvictionSpec::adaptive) compare one head's scores with another's.
enum class CrossHeadScale : uint8_t {
  kAsIs,            // the scores mean the same in every head (attention mass, uniform noise)
  kSoftmaxPerHead,  // no common scale (negative key norms): a softmax over each head first
};

// Which formula of the per-request cost model (kernels/core/cost.cc, kvc/cost.h) prices the
// policy's scoring: its work and scratch bytes for a layer's shape and the spec, from which kvcd's
// work budget refuses uploads it could not finish in time. A policy whose scorer does the work of
// an existing one names that formula; a new kind of scorer adds its formula there.
enum class ScoreCost : uint8_t {
  kNone,       // no scores (position only)
  kAttention,  // observation queries against every key, softmax (h2o, snapkv, keyformer)
  kKeyNorms,   // one norm per key
  kRandom,     // one hash per key
  kKeyDiff,    // cosine of every key with the head's mean key
  kExpected,   // query statistics rotated to the horizon, k^T Sigma k per key
};

struct PolicyInfo {
  EvictionPolicy policy;
  std::string_view name;     // EvictionConfig.policy on the wire, spec strings, tools
  std::string_view summary;  // one line for help texts
  // False: the policy selects by position only (no scorer; head-adaptive budgets do not apply).
  bool scores;
  PolicyInputs inputs;
  ProtectedWindow window;
  double default_recent_fraction;  // kRecentFraction when EvictionSpec::recent_fraction < 0
  CrossHeadScale cross_head;
  // Composes with value-aware weighting (EvictionSpec::value_weight mul or add), applied to the
  // scores after the scorer (and after snapkv's pooling); `auto` means mul when
  // value_weight_by_default, else off.
  bool value_weight;
  bool value_weight_by_default;
  ScoreCost cost;  // its scoring's formula in the per-request cost model
  // The observation rows come from a pass after the prompt (kvzip's context reconstruction), not
  // from its last W positions: every row sees every key, and W may exceed S (ValidateSpec).
  bool rows_after_context = false;
};

inline constexpr PolicyInfo kPolicies[] = {
    {.policy = EvictionPolicy::kNone,
     .name = "none",
     .summary = "keep every token",
     .scores = false,
     .inputs = PolicyInputs::kKeys,
     .window = ProtectedWindow::kEverything,
     .default_recent_fraction = 0,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = false,
     .value_weight_by_default = false,
     .cost = ScoreCost::kNone},
    {.policy = EvictionPolicy::kStreaming,
     .name = "streaming",
     .summary = "StreamingLLM: the first sink tokens and the most recent rest",
     .scores = false,
     .inputs = PolicyInputs::kKeys,
     .window = ProtectedWindow::kSinksAndRecent,
     .default_recent_fraction = 0,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = false,
     .value_weight_by_default = false,
     .cost = ScoreCost::kNone},
    {.policy = EvictionPolicy::kH2O,
     .name = "h2o",
     .summary = "heavy hitters: attention of the observation queries, recent half kept",
     .scores = true,
     .inputs = PolicyInputs::kObservation,
     .window = ProtectedWindow::kRecentFraction,
     .default_recent_fraction = 0.5,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = true,
     .value_weight_by_default = false,
     .cost = ScoreCost::kAttention},
    {.policy = EvictionPolicy::kSnapKV,
     .name = "snapkv",
     .summary = "SnapKV: pooled attention of the observation window, the window kept",
     .scores = true,
     .inputs = PolicyInputs::kObservation,
     .window = ProtectedWindow::kObservation,
     .default_recent_fraction = 0,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = true,
     .value_weight_by_default = false,
     .cost = ScoreCost::kAttention},
    {.policy = EvictionPolicy::kKeyformer,
     .name = "keyformer",
     .summary = "Keyformer: attention with Gumbel noise at temperature tau, recent 30% kept",
     .scores = true,
     .inputs = PolicyInputs::kObservation,
     .window = ProtectedWindow::kRecentFraction,
     .default_recent_fraction = 0.3,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = true,
     .value_weight_by_default = false,
     .cost = ScoreCost::kAttention},
    {.policy = EvictionPolicy::kKNorm,
     .name = "knorm",
     .summary = "keys of low L2 norm (query-agnostic baseline)",
     .scores = true,
     .inputs = PolicyInputs::kKeys,
     .window = ProtectedWindow::kNothing,
     .default_recent_fraction = 0,
     .cross_head = CrossHeadScale::kSoftmaxPerHead,
     .value_weight = false,
     .value_weight_by_default = false,
     .cost = ScoreCost::kKeyNorms},
    {.policy = EvictionPolicy::kRandom,
     .name = "random",
     .summary = "uniformly random tokens from the seed (baseline)",
     .scores = true,
     .inputs = PolicyInputs::kKeys,
     .window = ProtectedWindow::kNothing,
     .default_recent_fraction = 0,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = false,
     .value_weight_by_default = false,
     .cost = ScoreCost::kRandom},
    {.policy = EvictionPolicy::kKeyDiff,
     .name = "keydiff",
     .summary = "KeyDiff: keys least similar to the head's mean key (query-agnostic)",
     .scores = true,
     .inputs = PolicyInputs::kKeys,
     .window = ProtectedWindow::kRecentFraction,
     .default_recent_fraction = 0,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = false,
     .value_weight_by_default = false,
     .cost = ScoreCost::kKeyDiff},
    {.policy = EvictionPolicy::kExpectedAttention,
     .name = "expected",
     .summary = "expected attention of the next queries, from their mean and covariance",
     .scores = true,
     .inputs = PolicyInputs::kQueryStatistics,
     .window = ProtectedWindow::kRecentFraction,
     .default_recent_fraction = 0,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = true,
     .value_weight_by_default = true,
     .cost = ScoreCost::kExpected},
    {.policy = EvictionPolicy::kKVzip,
     .name = "kvzip",
     .summary = "KVzip: max attention of queries that reconstruct the context (sent as Q_obs)",
     .scores = true,
     .inputs = PolicyInputs::kObservation,
     .window = ProtectedWindow::kSinks,
     .default_recent_fraction = 0,
     .cross_head = CrossHeadScale::kAsIs,
     .value_weight = true,
     .value_weight_by_default = false,
     .cost = ScoreCost::kAttention,
     .rows_after_context = true},
};

inline constexpr size_t kNumPolicies = sizeof(kPolicies) / sizeof(kPolicies[0]);

// True when `rows` lists one row per policy, in enum order (row i is policy i); each backend's
// scorer table checks itself with it (static_assert), so a policy cannot lack a scorer row.
template <typename Row, size_t N>
constexpr bool CoversEveryPolicyInOrder(const Row (&rows)[N]) {
  if (N != kNumPolicies) return false;
  for (size_t i = 0; i < N; ++i) {
    if (static_cast<size_t>(rows[i].policy) != i) return false;
  }
  return true;
}
static_assert(CoversEveryPolicyInOrder(kPolicies));

// False for a value outside the enum (e.g. from a corrupt header).
constexpr bool IsKnownPolicy(EvictionPolicy p) { return static_cast<size_t>(p) < kNumPolicies; }

// The row of a known policy (IsKnownPolicy).
constexpr const PolicyInfo& Policy(EvictionPolicy p) { return kPolicies[static_cast<size_t>(p)]; }

}  // namespace kvc

#endif  // KVC_POLICY_H_

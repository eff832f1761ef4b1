// The CPU engine's stages, exposed for tests, benchmarks and the CUDA backend's reference checks.
// A Backend (kvc/backend.h) composes them: SelectTokens -> SelectChannels -> PackLayer.
// All functions are thread-safe, allocate their outputs and read host memory. They run on a
// process-wide pool of hardware_concurrency threads (parallel over KV heads, OpenBLAS set to one
// thread inside it) and keep per-thread scratch buffers for reuse across calls: scoring needs at
// most 16 MiB of logits plus 1024 * D floats of keys; value pruning needs about
// (g * W + 2 * budget) * D + g * W * budget floats.
#ifndef KVC_SELECTION_H_
#define KVC_SELECTION_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

// Per-token importance used by the eviction policy: [num_kv_heads, S] (group-aggregated over the
// query heads of each KV head), higher = more important. With a_tj = q_t . k_j / sqrt(D) and
// observation row t at prompt position S - W + t (it sees keys j <= S - W + t):
//   h2o, snapkv: (1/g) * sum over the g query heads and W rows of softmax_j(a_t)
//   keyformer:   the same with softmax_j((a_tj + G) / tau), G = CounterGumbel(seed, layer_index,
//                query head, t, j) from kvc/noise.h (so the CUDA backend draws the same noise)
//   snapkv:      then 1-D pooling (max or avg, odd kernel, same size, window clipped at the
//                edges) over the prefix [0, S - W); the window's own scores are left unpooled
//   knorm: -||k_j||_2;  random: CounterUniform(seed, layer_index, kv head, 0, j);
//   keydiff: -cos(k_j, m), m = (1/S) sum_i k_i / ||k_i|| (KeyDiff; query-agnostic, 0 when m = 0)
//   expected: per query head, mean mu and covariance Sigma of its un-rotated queries (the W
//            Q_obs rows turned back by their positions with in.rope, population covariance; or
//            in.q_stats when spec.query_stats), rotated to the average of the next `horizon`
//            positions (R = mean over p in [S, S + horizon) of RoPE(p); mu' = R mu,
//            Sigma' = R Sigma R^T), then z_j = k_j . mu' / sqrt(D) + k_j^T Sigma' k_j / (2D),
//            softmax over all S keys, averaged over the g query heads (Expected Attention)
//   kvzip: the W rows are queries of a pass that repeats the context after it (KVzip's context
//          reconstruction; the client runs that pass): every row sees all S keys, and
//          score_j = max over the g query heads and W rows of softmax_j(a_t); with
//          spec.query_stats the denominator of row t of query head i also holds
//          exp(q_stats[i * W + t]), the row's mass over keys not uploaded (KVzip's softmax runs
//          over the reconstruction tokens' own keys too)
//   streaming, none: 0.
// Value-aware weighting (EffectiveValueWeight: mul by default for expected, off for the others;
// only for h2o, snapkv, keyformer, expected, kvzip), after pooling, with n = mean_j ||v_j|| and
// s = mean_j score_j of the head:  mul: score_j * (||v_j|| + value_eps * n);
// add: (score_j + value_eps * s) * ||v_j||.
// Sinks, recent windows and the snapkv window are applied by SelectTokens. INVALID_ARGUMENT
// (naming the field) for an invalid input or eviction spec.
absl::StatusOr<std::vector<float>> ScoreTokens(const LayerInput& in, const EvictionSpec& spec);

// How attention scoring (h2o, snapkv, keyformer, kvzip) computes its logits at the active
// instruction-set level (kvc/cpu_isa.h) with `math` (kvc/layer.h), per dtype, for a head_dim of
// 128 (a head_dim that is not a multiple of 32 uses sgemm, or int8 at a multiple of 16), e.g.
// "f32 f16: sgemm fp32; bf16: avx512-bf16 dot products". kvcd prints it at start-up.
std::string ScoringLogitsDescription(ScoringMath math = ScoringMath::kExact);

// Kept positions per KV head, B = EffectiveBudget(spec.eviction, in.layer_index, S) of them:
// protected tokens first, then the highest scores (ties broken by the lower position, NaN scores
// last), sorted ascending. Protected tokens per policy:
//   none: all;  streaming: the first min(sink_tokens, B) + the most recent rest;
//   h2o / keyformer: the most recent int(recent_fraction * B) (defaults 0.5 / 0.3);
//   snapkv: the observation window, or only its most recent B tokens when B < W;
//   keydiff, expected: the most recent int(recent_fraction * B) (default 0);
//   kvzip: the first min(sink_tokens, B);  knorm, random: none.
// Granularity::kPerLayer selects once from the scores summed over heads and gives every head
// that set.
// Head-adaptive budgets (eviction.adaptive, AdaKV): the layer keeps H * B tokens in all, spread
// over heads where the scores are high. Each head keeps its protected tokens (as above, for B)
// plus its own top max(floor(alpha * B), 1 - protected) candidates by score (alpha =
// adaptive_floor; at least one token per head). The rest of the layer's budget, H * B minus
// those, goes to the highest remaining candidates over all heads, compared by a score that means
// the same in every head: attention-based policies use their scores as they are, since each
// head's (unpooled) scores are attention mass summing to W, so a score is already the token's
// share of its head's attention (snapkv's pooled scores are compared as pooled, as AdaKV does);
// random's are uniform in [0, 1) in every head; knorm's (negative key norms, no common scale) go
// through a softmax over each head first. Ties go to the lower head, then the lower position;
// NaN scores last. The result is ragged (counts per head, sum H * B, each in [1, S]); alpha = 1
// gives exactly the uniform selection. See ValidateSpec for the policies it applies to.
absl::StatusOr<TokenSelection> SelectTokens(const LayerInput& in, const CompressionSpec& spec);

// Channel selection per KV head on the kept tokens that will be pruned: all but the most recent
// r = min(spec.recent_tokens, budget) kept tokens when pruning or quantization is on (r = 0
// otherwise), because those r stay unpruned. Keys keep T_k = KeptChannels(key_lambda, D):
//   think: mean over the group's query heads and W rows of Q_obs[.., c]^2, times the mean of
//          K[s, c]^2 over the pruned tokens;  l1 / l2: L1 / L2 norm of K[:, c] over them;
//   none:  all D channels.
// Values (prune_values) keep T_v = KeptChannels(value_lambda, D) by
//   score_v[c] = sum over the group's query rows of (P[:, pruned] V[pruned, c])^2,
//   P = causal softmax of Q_obs K_kept^T / sqrt(D) over all kept tokens.
// Ties go to the lower channel; indices ascending. `tokens` must match the input (heads, budget,
// ascending positions < S; ragged: counts of size H, each in [1, S], summing to positions.size()),
// else INVALID_ARGUMENT naming "tokens.*". A ragged selection prunes each head on its own count.
absl::StatusOr<ChannelSelection> SelectChannels(const LayerInput& in, const TokenSelection& tokens,
                                                const CompressionSpec& spec);

// Builds the blob from the input and the selections: gather kept tokens and channels, quantize the
// old block when spec.quant.bits > 0. Validates what it reads (INVALID_ARGUMENT naming the field):
// shape limits, dtype/layout, non-null k/v, tokens matching the heads with budget in [1, S] and
// positions strictly ascending in [0, S), channel counts in [1, D] with [Hkv, T] strictly
// ascending indices (an empty list with T == D means all channels), bits in {0, 2, 4, 8},
// group_size >= 1 when quantizing, recent_tokens >= 0. q_obs is not read. Thread-compatible.
absl::StatusOr<CompactLayer> PackLayer(const LayerInput& in, const TokenSelection& tokens,
                                       const ChannelSelection& channels,
                                       const CompressionSpec& spec);

}  // namespace kvc

#endif  // KVC_SELECTION_H_

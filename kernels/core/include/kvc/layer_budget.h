// Layer-adaptive budgets (EvictionSpec::layer_adaptive): how many tokens each (layer, KV head)
// of one request keeps when the request's whole budget is shared over its layers by score.
//
// Thread-safety: pure functions.
#ifndef KVC_LAYER_BUDGET_H_
#define KVC_LAYER_BUDGET_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

// Scores [H, S] made comparable across heads (and layers), by the policy row's cross_head:
// attention-based and random scores as they are (attention mass or uniform draws mean the same
// in every head), knorm's negative key norms through a softmax over each head.
void CrossHeadScores(const float* scores, int H, int S, EvictionPolicy policy, float* out);

// Kept tokens per (layer, KV head) for layer-adaptive budgets. scores[l] is layer l's [H, S]
// scores as the policy's scorer wrote them (value weighting off). With B_l =
// EffectiveBudget(spec, l, S) and P_l the protected tokens for B_l (ProtectedFor), every head of
// layer l keeps P_l plus its own top own_l = floor(adaptive_floor * B_l) candidates (at least one
// token per head), and the rest of the request's sum_l H * B_l tokens goes to the highest
// remaining candidates of all layers and heads, compared by CrossHeadScores (ties: lower layer,
// then lower head, then lower position; NaN scores last). Within a head the kept candidates are
// its top ones by score (ties to the lower position), so SelectTokens with these counts (the
// CPU backend's CompressScored with KeyScores::head_counts) keeps exactly the allocated tokens.
// Returns [L][H] counts, each in [P_l + own_l, S], summing to sum_l H * B_l. INVALID_ARGUMENT
// when the spec is not valid for the shape or a layer's scores are missing or mis-sized.
absl::StatusOr<std::vector<std::vector<int32_t>>> AllocateAcrossLayers(
    const EvictionSpec& spec, const LayerShape& shape,
    const std::vector<const std::vector<float>*>& scores);

}  // namespace kvc

#endif  // KVC_LAYER_BUDGET_H_

// Layer-adaptive budgets (EvictionSpec::layer_adaptive): how many tokens each (layer, KV head)
// of one request keeps when the request's whole budget is shared over its layers by score.
//
// Thread-safety: pure functions.
#ifndef KVC_LAYER_BUDGET_H_
#define KVC_LAYER_BUDGET_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

// The strict order of one head's candidates: higher score first, NaN scores last, then the lower
// position (so every selection is deterministic whatever nth_element does internally).
struct HigherScoreFirst {
  const float* score;  // the head's [S] scores
  bool operator()(int32_t a, int32_t b) const {
    const float sa = score[a], sb = score[b];
    const bool na = std::isnan(sa), nb = std::isnan(sb);
    if (na != nb) return nb;
    if (!na && sa != sb) return sa > sb;
    return a < b;
  }
};

// Head-adaptive budgets: the candidates a head keeps of its own besides its `protected_count`
// protected tokens, for a budget of B: floor(adaptive_floor * B), at least one token per head,
// at most B - protected_count.
inline int OwnCandidates(double adaptive_floor, int budget, int protected_count) {
  int own = static_cast<int>(std::floor(adaptive_floor * budget));
  if (protected_count == 0) own = std::max(own, 1);
  return std::clamp(own, 0, budget - protected_count);
}

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

#include "kvc/layer_budget.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kvc/policy.h"
#include "kvc/status_macros.h"

namespace kvc {

void CrossHeadScores(const float* scores, int H, int S, EvictionPolicy policy, float* out) {
  for (int h = 0; h < H; ++h) {
    const float* x = scores + static_cast<size_t>(h) * S;
    float* y = out + static_cast<size_t>(h) * S;
    if (Policy(policy).cross_head == CrossHeadScale::kSoftmaxPerHead) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < S; ++j) mx = std::max(mx, x[j]);
      double sum = 0;
      for (int j = 0; j < S; ++j) sum += std::exp(static_cast<double>(x[j]) - mx);
      for (int j = 0; j < S; ++j) {
        y[j] = static_cast<float>(std::exp(static_cast<double>(x[j]) - mx) / sum);
      }
    } else {
      std::copy_n(x, S, y);
    }
  }
}

absl::StatusOr<std::vector<std::vector<int32_t>>> AllocateAcrossLayers(
    const EvictionSpec& spec, const LayerShape& shape,
    const std::vector<const std::vector<float>*>& scores) {
  const int L = static_cast<int>(scores.size()), H = shape.num_kv_heads, S = shape.seq_len;
  CompressionSpec full;
  full.eviction = spec;
  for (int l = 0; l < L; ++l) {
    RETURN_IF_ERROR(ValidateSpec(full, shape, l));
    if (scores[l] == nullptr || scores[l]->size() != static_cast<size_t>(H) * S) {
      return absl::InvalidArgumentError(
          absl::StrCat("scores: layer ", l, " has ",
                       scores[l] == nullptr ? 0 : scores[l]->size(), " scores, want ",
                       static_cast<size_t>(H) * S));
    }
  }
  // A NaN score ranks below every number (as in SelectTokens); -inf stands for it in the pool.
  auto key = [](float s) { return std::isnan(s) ? -std::numeric_limits<float>::infinity() : s; };
  std::vector<std::vector<int32_t>> counts(L, std::vector<int32_t>(H, 0));
  // Per (layer, head), the candidates left after its own top picks: their comparable scores, in
  // one array with a segment per (layer, head).
  std::vector<float> pool;
  std::vector<size_t> segment(static_cast<size_t>(L) * H + 1, 0);
  uint64_t extra = 0;  // tokens of the request's budget not yet given to a head
  std::vector<float> norm(static_cast<size_t>(H) * S);
  std::vector<int32_t> cand;
  for (int l = 0; l < L; ++l) {
    const int B = EffectiveBudget(spec, l, S);
    const ProtectedTokens p = ProtectedFor(spec, shape, B);
    const int first = p.sinks, last = S - p.recent, prot = p.sinks + p.recent;
    const int own = OwnCandidates(spec.adaptive_floor, B, prot);
    extra += static_cast<uint64_t>(H) * static_cast<uint64_t>(B - prot - own);
    CrossHeadScores(scores[l]->data(), H, S, spec.policy, norm.data());
    for (int h = 0; h < H; ++h) {
      const float* raw = scores[l]->data() + static_cast<size_t>(h) * S;
      const float* nh = norm.data() + static_cast<size_t>(h) * S;
      cand.resize(static_cast<size_t>(last - first));
      std::iota(cand.begin(), cand.end(), first);
      // The head's own picks: its top `own` by raw score.
      if (own < static_cast<int>(cand.size())) {
        std::nth_element(cand.begin(), cand.begin() + own, cand.end(), HigherScoreFirst{raw});
      }
      // The rest compete, in position order (so ties at the threshold go to lower positions).
      std::sort(cand.begin() + own, cand.end());
      for (size_t i = own; i < cand.size(); ++i) pool.push_back(key(nh[cand[i]]));
      segment[static_cast<size_t>(l) * H + h + 1] = pool.size();
      counts[l][h] = prot + own;
    }
  }
  if (extra >= pool.size()) {
    for (int l = 0; l < L; ++l) {
      for (int h = 0; h < H; ++h) {
        const size_t i = static_cast<size_t>(l) * H + h;
        counts[l][h] += static_cast<int32_t>(segment[i + 1] - segment[i]);
      }
    }
    return counts;
  }
  if (extra == 0) return counts;
  // The threshold: the extra-th highest remaining score. Everything above it is kept; of the
  // scores equal to it, the first in (layer, head, position) order fill what is left.
  std::vector<float> sorted = pool;
  std::nth_element(sorted.begin(), sorted.begin() + static_cast<std::ptrdiff_t>(extra - 1),
                   sorted.end(), std::greater<float>());
  const float tau = sorted[extra - 1];
  sorted = std::vector<float>();
  uint64_t above = 0;
  for (float s : pool) above += s > tau;
  uint64_t ties = extra - above;
  for (int l = 0; l < L; ++l) {
    for (int h = 0; h < H; ++h) {
      const size_t i = static_cast<size_t>(l) * H + h;
      int32_t take = 0;
      for (size_t j = segment[i]; j < segment[i + 1]; ++j) {
        if (pool[j] > tau) {
          ++take;
        } else if (pool[j] == tau && ties > 0) {
          ++take;
          --ties;
        }
      }
      counts[l][h] += take;
    }
  }
  return counts;
}

}  // namespace kvc

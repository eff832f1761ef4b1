// Token selection: protected positions (sinks, recent window, observation window) first, then the
// best-scoring rest. Ordering is a strict total order (score descending, then position ascending,
// NaN scores last), so the result is deterministic whatever nth_element does internally.
#include "kvc/selection.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "cpu/engine.h"
#include "kvc/status_macros.h"

namespace kvc::cpu {
namespace {

struct Protected {
  int sinks = 0;   // positions [0, sinks)
  int recent = 0;  // positions [S - recent, S)
};

double DefaultRecentFraction(EvictionPolicy p) {
  if (p == EvictionPolicy::kKeyDiff || p == EvictionPolicy::kExpectedAttention) return 0.0;
  return p == EvictionPolicy::kKeyformer ? 0.3 : 0.5;
}

Protected ProtectedFor(const EvictionSpec& e, const LayerShape& sh, int budget) {
  Protected p;
  const double rf = e.recent_fraction >= 0.0 ? e.recent_fraction : DefaultRecentFraction(e.policy);
  switch (e.policy) {
    case EvictionPolicy::kNone:
      p.recent = budget;
      break;
    case EvictionPolicy::kStreaming:
      p.sinks = std::min(e.sink_tokens, budget);
      p.recent = budget - p.sinks;
      break;
    case EvictionPolicy::kH2O:
    case EvictionPolicy::kKeyformer:
    case EvictionPolicy::kKeyDiff:
    case EvictionPolicy::kExpectedAttention:
      // int(rf * B) as in the reference implementations (floor for non-negative values).
      p.recent = static_cast<int>(rf * budget);
      break;
    case EvictionPolicy::kSnapKV:
      // The observation window is always kept; a budget below W keeps its most recent B tokens.
      p.recent = std::min(sh.obs_window, budget);
      break;
    case EvictionPolicy::kKNorm:
    case EvictionPolicy::kRandom:
      break;
  }
  p.recent = std::clamp(p.recent, 0, budget - p.sinks);
  return p;
}

// Writes the `budget` kept positions of one head, ascending, into out.
void SelectHead(const float* score, int S, int budget, const Protected& p,
                std::vector<int32_t>& cand, int32_t* out) {
  const int first = p.sinks, last = S - p.recent;  // candidates: [first, last)
  const int want = budget - p.sinks - p.recent;
  cand.resize(static_cast<size_t>(last - first));
  std::iota(cand.begin(), cand.end(), first);
  auto better = [score](int32_t a, int32_t b) {
    const float sa = score[a], sb = score[b];
    const bool na = std::isnan(sa), nb = std::isnan(sb);
    if (na != nb) return nb;  // a non-NaN score beats NaN
    if (!na && sa != sb) return sa > sb;
    return a < b;
  };
  if (want <= 0) {
    cand.clear();
  } else if (want < static_cast<int>(cand.size())) {
    std::nth_element(cand.begin(), cand.begin() + want, cand.end(), better);
    cand.resize(static_cast<size_t>(want));
  }
  std::sort(cand.begin(), cand.end());
  int n = 0;
  for (int i = 0; i < p.sinks; ++i) out[n++] = i;
  for (int32_t c : cand) out[n++] = c;
  for (int i = last; i < S; ++i) out[n++] = i;
}

}  // namespace

int RecentCount(const CompressionSpec& spec, int budget) {
  const bool active = spec.channels.key_policy != ChannelPolicy::kNone ||
                      spec.channels.prune_values || spec.quant.bits > 0;
  return active ? std::min(spec.recent_tokens, budget) : 0;
}

TokenSelection SelectTokensImpl(const LayerInput& in, const CompressionSpec& spec, ThreadPool* pool,
                                double* score_seconds) {
  const EvictionSpec& e = spec.eviction;
  const int S = in.shape.seq_len, H = in.shape.num_kv_heads;
  const int budget = EffectiveBudget(e, in.layer_index, S);
  TokenSelection sel;
  sel.num_kv_heads = H;
  sel.budget = budget;
  sel.positions.resize(static_cast<size_t>(H) * budget);
  const Protected prot = ProtectedFor(e, in.shape, budget);

  std::vector<float> scores;
  const auto t0 = std::chrono::steady_clock::now();
  const bool need_scores = prot.sinks + prot.recent < budget;
  if (need_scores) ScoreTokensImpl(in, e, pool, &scores);
  if (score_seconds != nullptr) {
    *score_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

  if (e.granularity == Granularity::kPerLayer) {
    // One set for the layer from the scores summed over heads (row 0 reused as the sum).
    if (need_scores) {
      for (int h = 1; h < H; ++h) {
        const float* row = scores.data() + static_cast<size_t>(h) * S;
        for (int j = 0; j < S; ++j) scores[j] += row[j];
      }
    }
    std::vector<int32_t> cand;
    SelectHead(scores.data(), S, budget, prot, cand, sel.positions.data());
    for (int h = 1; h < H; ++h) {
      std::copy_n(sel.positions.data(), budget,
                  sel.positions.data() + static_cast<size_t>(h) * budget);
    }
    return sel;
  }
  pool->ParallelFor(H, [&](int h) {
    thread_local std::vector<int32_t> cand;
    SelectHead(need_scores ? scores.data() + static_cast<size_t>(h) * S : nullptr, S, budget, prot,
               cand, sel.positions.data() + static_cast<size_t>(h) * budget);
  });
  return sel;
}

absl::Status ValidateTokenSelection(const LayerInput& in, const TokenSelection& tokens) {
  const int S = in.shape.seq_len, H = in.shape.num_kv_heads;
  if (tokens.num_kv_heads != H) {
    return absl::InvalidArgumentError(absl::StrCat("tokens.num_kv_heads: ", tokens.num_kv_heads,
                                                   " does not match shape.num_kv_heads ", H));
  }
  if (tokens.budget < 1 || tokens.budget > S) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens.budget: ", tokens.budget, " is outside [1, seq_len ", S, "]"));
  }
  if (tokens.positions.size() != static_cast<size_t>(H) * tokens.budget) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens.positions: size ", tokens.positions.size(),
                     " is not num_kv_heads * budget ", static_cast<size_t>(H) * tokens.budget));
  }
  for (int h = 0; h < H; ++h) {
    const int32_t* p = tokens.positions.data() + static_cast<size_t>(h) * tokens.budget;
    for (int i = 0; i < tokens.budget; ++i) {
      if (p[i] < 0 || p[i] >= S || (i > 0 && p[i] <= p[i - 1])) {
        return absl::InvalidArgumentError(
            absl::StrCat("tokens.positions: head ", h, " entry ", i, " (", p[i],
                         ") is not strictly ascending within [0, ", S, ")"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace kvc::cpu

namespace kvc {

absl::StatusOr<TokenSelection> SelectTokens(const LayerInput& in, const CompressionSpec& spec) {
  RETURN_IF_ERROR(ValidateInput(in));
  RETURN_IF_ERROR(ValidateSpec(spec, in.shape, in.layer_index));
  RETURN_IF_ERROR(ValidateSpecInput(spec, in));
  return cpu::SelectTokensImpl(in, spec, ThreadPool::Default(), nullptr);
}

}  // namespace kvc

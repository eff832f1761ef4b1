// Token selection: protected positions (sinks, recent window, observation window) first, then the
// best-scoring rest. Ordering is a strict total order (score descending, then position ascending,
// NaN scores last), so the result is deterministic whatever nth_element does internally.
#include "kvc/selection.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "cpu/engine.h"
#include "kvc/layer_budget.h"
#include "kvc/status_macros.h"

namespace kvc::cpu {
namespace {

using Protected = ProtectedTokens;  // kvc/spec.h: the policy row's protected window

// Writes the `budget` kept positions of one head, ascending, into out.
void SelectHead(const float* score, int S, int budget, const Protected& p, int32_t* out) {
  const int first = p.sinks, last = S - p.recent;  // candidates: [first, last)
  const int want = budget - p.sinks - p.recent;
  int32_t* const cand_begin =
      Scratch::ForThisThread().cand.Get<int32_t>(static_cast<size_t>(std::max(last - first, 1)));
  int32_t* cand_end = cand_begin + (last - first);
  std::iota(cand_begin, cand_end, first);
  const HigherScoreFirst better{score};
  if (want <= 0) {
    cand_end = cand_begin;
  } else if (want < cand_end - cand_begin) {
    std::nth_element(cand_begin, cand_begin + want, cand_end, better);
    cand_end = cand_begin + want;
  }
  std::sort(cand_begin, cand_end);
  int n = 0;
  for (int i = 0; i < p.sinks; ++i) out[n++] = i;
  for (const int32_t* c = cand_begin; c < cand_end; ++c) out[n++] = *c;
  for (int i = last; i < S; ++i) out[n++] = i;
}


// Head-adaptive selection (see SelectTokens in kvc/selection.h): per head the protected tokens
// and its own top `floor` candidates, then the rest of H * B to the best normalised candidates of
// all heads. Fills sel->positions (ragged) and sel->counts.
void SelectAdaptive(const float* scores, int H, int S, int budget, const Protected& p,
                    const EvictionSpec& e, TokenSelection* sel) {
  const int first = p.sinks, last = S - p.recent;  // candidates: [first, last) of every head
  const int n_cand = last - first;
  const int protected_count = p.sinks + p.recent;
  const int own = OwnCandidates(e.adaptive_floor, budget, protected_count);

  std::vector<float> norm(static_cast<size_t>(H) * S);
  CrossHeadScores(scores, H, S, e.policy, norm.data());
  // Per head: candidates in the head's order; the first `own` are kept, the rest compete.
  std::vector<std::vector<int32_t>> chosen(H);
  struct Cand {
    float s;
    int32_t h, j;
  };
  std::vector<Cand> pool;
  pool.reserve(static_cast<size_t>(H) * std::max(0, n_cand - own));
  std::vector<int32_t> cand(static_cast<size_t>(n_cand));
  for (int h = 0; h < H; ++h) {
    const HigherScoreFirst better{scores + static_cast<size_t>(h) * S};
    std::iota(cand.begin(), cand.end(), first);
    if (own < n_cand) std::nth_element(cand.begin(), cand.begin() + own, cand.end(), better);
    chosen[h].assign(cand.begin(), cand.begin() + own);
    const float* nh = norm.data() + static_cast<size_t>(h) * S;
    for (int i = own; i < n_cand; ++i) pool.push_back({nh[cand[i]], h, cand[i]});
  }
  const size_t extra = static_cast<size_t>(H) * (budget - protected_count - own);
  auto better = [](const Cand& a, const Cand& b) {
    const bool na = std::isnan(a.s), nb = std::isnan(b.s);
    if (na != nb) return nb;
    if (!na && a.s != b.s) return a.s > b.s;
    if (a.h != b.h) return a.h < b.h;
    return a.j < b.j;
  };
  if (extra < pool.size()) {
    std::nth_element(pool.begin(), pool.begin() + static_cast<std::ptrdiff_t>(extra), pool.end(),
                     better);
    pool.resize(extra);
  }
  for (const Cand& c : pool) chosen[c.h].push_back(c.j);
  sel->counts.resize(H);
  sel->positions.clear();
  sel->positions.reserve(static_cast<size_t>(H) * budget);
  sel->budget = 0;
  for (int h = 0; h < H; ++h) {
    std::sort(chosen[h].begin(), chosen[h].end());
    for (int i = 0; i < p.sinks; ++i) sel->positions.push_back(i);
    sel->positions.insert(sel->positions.end(), chosen[h].begin(), chosen[h].end());
    for (int i = last; i < S; ++i) sel->positions.push_back(i);
    sel->counts[h] = protected_count + static_cast<int>(chosen[h].size());
    sel->budget = std::max(sel->budget, sel->counts[h]);
  }
}

}  // namespace

int RecentCount(const CompressionSpec& spec, int budget) {
  const bool active = spec.channels.key_policy != ChannelPolicy::kNone ||
                      spec.channels.prune_values || spec.quant.bits > 0;
  return active ? std::min(spec.recent_tokens, budget) : 0;
}

bool NeedsScores(const LayerInput& in, const CompressionSpec& spec) {
  const EvictionSpec& e = spec.eviction;
  const int budget = EffectiveBudget(e, in.layer_index, in.shape.seq_len);
  const Protected prot = ProtectedFor(e, in.shape, budget);
  return prot.sinks + prot.recent < budget;
}

TokenSelection SelectTokensImpl(const LayerInput& in, const CompressionSpec& spec, ThreadPool* pool,
                                double* score_seconds) {
  const EvictionSpec& e = spec.eviction;
  std::vector<float> scores;
  const auto t0 = std::chrono::steady_clock::now();
  const bool need_scores = NeedsScores(in, spec);
  if (need_scores) ScoreTokensImpl(in, e, pool, &scores);
  if (Cancelled(in)) return TokenSelection{};  // the caller reports CancelStatus(in)
  if (score_seconds != nullptr) {
    *score_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  return SelectFromScoresImpl(in, spec, pool, need_scores ? &scores : nullptr);
}

TokenSelection SelectFromScoresImpl(const LayerInput& in, const CompressionSpec& spec,
                                    ThreadPool* pool, std::vector<float>* score_buffer) {
  const EvictionSpec& e = spec.eviction;
  const int S = in.shape.seq_len, H = in.shape.num_kv_heads;
  const int budget = EffectiveBudget(e, in.layer_index, S);
  TokenSelection sel;
  sel.num_kv_heads = H;
  sel.budget = budget;
  sel.positions.resize(static_cast<size_t>(H) * budget);
  const Protected prot = ProtectedFor(e, in.shape, budget);
  const bool need_scores = prot.sinks + prot.recent < budget;
  std::vector<float> none;
  std::vector<float>& scores = score_buffer != nullptr ? *score_buffer : none;

  if (e.adaptive && need_scores) {
    SelectAdaptive(scores.data(), H, S, budget, prot, e, &sel);
    return sel;
  }
  if (e.granularity == Granularity::kPerLayer) {
    // One set for the layer from the scores summed over heads (row 0 reused as the sum).
    if (need_scores) {
      for (int h = 1; h < H; ++h) {
        const float* row = scores.data() + static_cast<size_t>(h) * S;
        for (int j = 0; j < S; ++j) scores[j] += row[j];
      }
    }
    ScratchTask task;
    SelectHead(scores.data(), S, budget, prot, sel.positions.data());
    for (int h = 1; h < H; ++h) {
      std::copy_n(sel.positions.data(), budget,
                  sel.positions.data() + static_cast<size_t>(h) * budget);
    }
    return sel;
  }
  pool->ParallelFor(H, [&](int h) {
    ScratchTask task;
    SelectHead(need_scores ? scores.data() + static_cast<size_t>(h) * S : nullptr, S, budget, prot,
               sel.positions.data() + static_cast<size_t>(h) * budget);
  });
  return sel;
}

absl::StatusOr<TokenSelection> SelectCountsImpl(const LayerInput& in, const CompressionSpec& spec,
                                                ThreadPool* pool, const std::vector<float>& scores,
                                                const std::vector<int32_t>& counts) {
  const EvictionSpec& e = spec.eviction;
  const int S = in.shape.seq_len, H = in.shape.num_kv_heads;
  const int budget = EffectiveBudget(e, in.layer_index, S);
  const Protected prot = ProtectedFor(e, in.shape, budget);
  if (counts.size() != static_cast<size_t>(H) || scores.size() != static_cast<size_t>(H) * S) {
    return absl::InvalidArgumentError(absl::StrCat("head_counts: ", counts.size(), " counts and ",
                                                   scores.size(), " scores for ", H, " heads"));
  }
  TokenSelection sel;
  sel.num_kv_heads = H;
  sel.counts.assign(counts.begin(), counts.end());
  std::vector<size_t> offset(H + 1, 0);
  for (int h = 0; h < H; ++h) {
    if (counts[h] < prot.sinks + prot.recent || counts[h] > S || counts[h] < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("head_counts: head ", h, " keeps ", counts[h], ", outside [",
                       std::max(1, prot.sinks + prot.recent), ", ", S, "]"));
    }
    offset[h + 1] = offset[h] + counts[h];
    sel.budget = std::max(sel.budget, counts[h]);
  }
  sel.positions.resize(offset[H]);
  pool->ParallelFor(H, [&](int h) {
    ScratchTask task;
    SelectHead(scores.data() + static_cast<size_t>(h) * S, S, counts[h], prot,
               sel.positions.data() + offset[h]);
  });
  return sel;
}

absl::Status ValidateTokenSelection(const LayerInput& in, const TokenSelection& tokens) {
  const int S = in.shape.seq_len, H = in.shape.num_kv_heads;
  if (tokens.num_kv_heads != H) {
    return absl::InvalidArgumentError(absl::StrCat("tokens.num_kv_heads: ", tokens.num_kv_heads,
                                                   " does not match shape.num_kv_heads ", H));
  }
  if (tokens.ragged()) {
    if (tokens.counts.size() != static_cast<size_t>(H)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens.counts: size ", tokens.counts.size(), " is not num_kv_heads ", H));
    }
    size_t sum = 0;
    for (int h = 0; h < H; ++h) {
      if (tokens.counts[h] < 1 || tokens.counts[h] > S) {
        return absl::InvalidArgumentError(absl::StrCat("tokens.counts[", h, "]: ", tokens.counts[h],
                                                       " is outside [1, seq_len ", S, "]"));
      }
      sum += static_cast<size_t>(tokens.counts[h]);
    }
    if (tokens.positions.size() != sum) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokens.positions: size ", tokens.positions.size(), " is not the sum of counts ", sum));
    }
  } else {
    if (tokens.budget < 1 || tokens.budget > S) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens.budget: ", tokens.budget, " is outside [1, seq_len ", S, "]"));
    }
    if (tokens.positions.size() != static_cast<size_t>(H) * tokens.budget) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens.positions: size ", tokens.positions.size(),
                       " is not num_kv_heads * budget ", static_cast<size_t>(H) * tokens.budget));
    }
  }
  size_t at = 0;
  for (int h = 0; h < H; ++h) {
    const int n = tokens.count(h);
    const int32_t* p = tokens.positions.data() + at;
    at += static_cast<size_t>(n);
    for (int i = 0; i < n; ++i) {
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
  return CallNoThrow([&]() -> absl::StatusOr<TokenSelection> {
    TokenSelection sel = cpu::SelectTokensImpl(in, spec, ThreadPool::Default(), nullptr);
    RETURN_IF_ERROR(cpu::CancelStatus(in));
    return sel;
  });
}

}  // namespace kvc

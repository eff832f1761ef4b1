#include "kvc/spec.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace kvc {
namespace {

constexpr ChannelPolicy kChannelPolicies[] = {ChannelPolicy::kNone, ChannelPolicy::kThink,
                                              ChannelPolicy::kL1, ChannelPolicy::kL2};

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// The names of the policies whose row passes `pred`, as "a, b, c and d".
template <typename Pred>
std::string PolicyList(Pred pred) {
  std::vector<std::string> names;
  for (const PolicyInfo& row : kPolicies) {
    if (pred(row)) names.emplace_back(row.name);
  }
  if (names.size() < 2) return absl::StrJoin(names, "");
  const std::string last = names.back();
  names.pop_back();
  return absl::StrCat(absl::StrJoin(names, ", "), " and ", last);
}

// kvzip's reconstruction rows: top_rows in [1, kMaxTopRows]; the passes (EvictionSpec::pass_rows):
// one entry per chunk of pass_tokens context tokens, each at least its chunk's length, summing to
// obs_window.
absl::Status ValidateReconstruction(const EvictionSpec& e, const LayerShape& shape) {
  if (e.top_rows != 1) {
    if (e.policy != EvictionPolicy::kKVzip) {
      return Invalid("eviction.top_rows",
                     absl::StrCat("a mean over the top rows is read only by kvzip, not ",
                                  std::string(PolicyName(e.policy))));
    }
    if (e.top_rows < 1 || e.top_rows > kMaxTopRows) {
      return Invalid("eviction.top_rows",
                     absl::StrCat(e.top_rows, " is outside [1, ", kMaxTopRows, "]"));
    }
  }
  if (e.pass_rows.empty()) return absl::OkStatus();
  if (e.policy != EvictionPolicy::kKVzip) {
    return Invalid("eviction.pass_rows",
                   absl::StrCat("reconstruction passes are read only by kvzip, not ",
                                std::string(PolicyName(e.policy))));
  }
  if (e.pass_tokens < 1) {
    return Invalid("eviction.pass_tokens", absl::StrCat(e.pass_tokens, " must be >= 1"));
  }
  const int64_t S = shape.seq_len, C = e.pass_tokens;
  const int64_t passes = (S + C - 1) / C;
  if (static_cast<int64_t>(e.pass_rows.size()) != passes) {
    return Invalid("eviction.pass_rows",
                   absl::StrCat(e.pass_rows.size(), " passes, but seq_len ", S, " in chunks of ",
                                C, " (pass_tokens) makes ", passes));
  }
  int64_t sum = 0;
  for (size_t i = 0; i < e.pass_rows.size(); ++i) {
    const PassKeys keys = PassKeyRange(e, shape.seq_len, i);
    const int chunk = keys.hi - keys.lo;
    if (e.pass_rows[i] < chunk) {
      return Invalid(absl::StrCat("eviction.pass_rows[", i, "]"),
                     absl::StrCat(e.pass_rows[i], " rows for a pass that repeats ", chunk,
                                  " context tokens (one row per copied token at least)"));
    }
    sum += e.pass_rows[i];
  }
  if (sum != shape.obs_window) {
    return Invalid("eviction.pass_rows",
                   absl::StrCat("the passes' rows sum to ", sum, ", not shape.obs_window ",
                                shape.obs_window));
  }
  return absl::OkStatus();
}

absl::Status ValidateEviction(const EvictionSpec& e, const LayerShape& shape) {
  if (!IsKnownPolicy(e.policy)) {
    return Invalid("eviction.policy", absl::StrCat("unknown value ", static_cast<int>(e.policy)));
  }
  const PolicyInfo& row = Policy(e.policy);
  if (e.budget < 0) return Invalid("eviction.budget", absl::StrCat(e.budget, " must be >= 0"));
  if (e.budget > shape.seq_len) {
    return Invalid("eviction.budget", absl::StrCat(e.budget, " exceeds seq_len ", shape.seq_len));
  }
  // Written so that NaN fails too.
  if (!(e.keep_ratio > 0.0 && e.keep_ratio <= 1.0)) {
    return Invalid("eviction.keep_ratio",
                   absl::StrCat(FormatDouble(e.keep_ratio), " is outside (0, 1]"));
  }
  for (size_t i = 0; i < e.layer_budgets.size(); ++i) {
    const int b = e.layer_budgets[i];
    const std::string field = absl::StrCat("eviction.layer_budgets[", i, "]");
    if (b < 0) return Invalid(field, absl::StrCat(b, " must be >= 0"));
    if (b > shape.seq_len) {
      return Invalid(field, absl::StrCat(b, " exceeds seq_len ", shape.seq_len));
    }
  }
  if (static_cast<uint8_t>(e.granularity) > static_cast<uint8_t>(Granularity::kPerLayer)) {
    return Invalid("eviction.granularity",
                   absl::StrCat("unknown value ", static_cast<int>(e.granularity)));
  }
  if (e.sink_tokens < 0) {
    return Invalid("eviction.sink_tokens", absl::StrCat(e.sink_tokens, " must be >= 0"));
  }
  // Negative means "the policy's default"; NaN is rejected.
  if (std::isnan(e.recent_fraction) || e.recent_fraction > 1.0) {
    return Invalid(
        "eviction.recent_fraction",
        absl::StrCat(FormatDouble(e.recent_fraction), " is outside [0, 1] (negative = default)"));
  }
  if (e.pool_kernel < 1 || e.pool_kernel % 2 == 0) {
    return Invalid("eviction.pool_kernel", absl::StrCat(e.pool_kernel, " must be odd and >= 1"));
  }
  if (e.pool_kernel > kMaxPoolKernel) {
    return Invalid("eviction.pool_kernel",
                   absl::StrCat(e.pool_kernel, " exceeds ", kMaxPoolKernel,
                                " (pooling costs seq_len * pool_kernel per head)"));
  }
  if (static_cast<uint8_t>(e.pool) > static_cast<uint8_t>(PoolKind::kAvg)) {
    return Invalid("eviction.pool", absl::StrCat("unknown value ", static_cast<int>(e.pool)));
  }
  if (!(e.tau > 0.0) || std::isinf(e.tau)) {
    return Invalid("eviction.tau", absl::StrCat(FormatDouble(e.tau), " must be finite and > 0"));
  }
  if (e.adaptive) {
    if (!row.scores) {
      return Invalid("eviction.adaptive",
                     absl::StrCat("needs a scoring policy (",
                                  PolicyList([](const PolicyInfo& r) { return r.scores; }),
                                  "), not ", std::string(row.name)));
    }
    if (e.granularity == Granularity::kPerLayer) {
      return Invalid("eviction.adaptive",
                     "per-head budgets need per-head granularity (per-layer keeps one set for "
                     "every head)");
    }
    if (!(e.adaptive_floor >= 0.0 && e.adaptive_floor <= 1.0)) {
      return Invalid("eviction.adaptive_floor",
                     absl::StrCat(FormatDouble(e.adaptive_floor), " is outside [0, 1]"));
    }
  }
  if (e.layer_adaptive) {
    if (!e.adaptive) {
      return Invalid("eviction.layer_adaptive",
                     "needs head-adaptive budgets too (adaptive; in a spec string ada=ALPHA)");
    }
    const ValueWeight w = EffectiveValueWeight(e);
    if (w == ValueWeight::kMul || w == ValueWeight::kAdd) {
      return Invalid("eviction.layer_adaptive",
                     absl::StrCat("value weighting (", std::string(ValueWeightName(w)),
                                  ") is not supported with layer-adaptive budgets yet; set "
                                  "value_weight off"));
    }
  }
  if (row.inputs == PolicyInputs::kObservation && shape.obs_window == 0) {
    return Invalid("eviction.policy",
                   absl::StrCat(std::string(PolicyName(e.policy)),
                                " needs observation queries but shape.obs_window is 0"));
  }
  if (static_cast<uint8_t>(e.value_weight) > static_cast<uint8_t>(ValueWeight::kAdd)) {
    return Invalid("eviction.value_weight",
                   absl::StrCat("unknown value ", static_cast<int>(e.value_weight)));
  }
  const bool weighted = e.value_weight == ValueWeight::kMul || e.value_weight == ValueWeight::kAdd;
  if (weighted && !row.value_weight) {
    return Invalid("eviction.value_weight",
                   absl::StrCat(std::string(ValueWeightName(e.value_weight)), " applies to ",
                                PolicyList([](const PolicyInfo& r) { return r.value_weight; }),
                                ", not ", std::string(row.name)));
  }
  if (!(e.value_eps >= 0.0) || std::isinf(e.value_eps)) {
    return Invalid("eviction.value_eps",
                   absl::StrCat(FormatDouble(e.value_eps), " must be finite and >= 0"));
  }
  if (e.horizon < 1) return Invalid("eviction.horizon", absl::StrCat(e.horizon, " must be >= 1"));
  if (e.horizon > kMaxHorizon) {
    return Invalid("eviction.horizon",
                   absl::StrCat(e.horizon, " exceeds ", kMaxHorizon,
                                " (future positions the statistics are averaged over)"));
  }
  // kvzip reads Q_stats as its rows' log-masses (EvictionSpec::query_stats).
  auto reads_query_stats = [](const PolicyInfo& r) {
    return r.inputs == PolicyInputs::kQueryStatistics || r.policy == EvictionPolicy::kKVzip;
  };
  const bool reads_stats = reads_query_stats(row);
  if (e.query_stats && !reads_stats) {
    return Invalid("eviction.query_stats",
                   absl::StrCat("query statistics are read only by ", PolicyList(reads_query_stats),
                                ", not ", std::string(row.name)));
  }
  if (row.inputs == PolicyInputs::kQueryStatistics && shape.obs_window == 0 && !e.query_stats) {
    return Invalid("eviction.query_stats",
                   absl::StrCat(std::string(row.name),
                                " needs query statistics from the client when shape.obs_window "
                                "is 0"));
  }
  return ValidateReconstruction(e, shape);
}

absl::Status ValidateChannels(const ChannelSpec& c, const LayerShape& shape) {
  if (static_cast<uint8_t>(c.key_policy) > static_cast<uint8_t>(ChannelPolicy::kL2)) {
    return Invalid("channels.key_policy",
                   absl::StrCat("unknown value ", static_cast<int>(c.key_policy)));
  }
  if (!(c.key_lambda >= 0.0 && c.key_lambda < 1.0)) {
    return Invalid("channels.key_lambda",
                   absl::StrCat(FormatDouble(c.key_lambda), " is outside [0, 1)"));
  }
  if (!(c.value_lambda >= 0.0 && c.value_lambda < 1.0)) {
    return Invalid("channels.value_lambda",
                   absl::StrCat(FormatDouble(c.value_lambda), " is outside [0, 1)"));
  }
  if (c.key_policy == ChannelPolicy::kThink && shape.obs_window == 0) {
    return Invalid("channels.key_policy",
                   "think needs observation queries but shape.obs_window is 0");
  }
  if (c.prune_values && shape.obs_window == 0) {
    return Invalid("channels.prune_values",
                   "value pruning needs observation queries but shape.obs_window is 0");
  }
  return absl::OkStatus();
}

absl::Status ValidateQuant(const QuantSpec& q, const LayerShape& shape) {
  if (q.bits != 0 && q.bits != 2 && q.bits != 4 && q.bits != 8) {
    return Invalid("quant.bits", absl::StrCat(q.bits, " is not one of 0, 2, 4, 8"));
  }
  if (q.value_bits != 0 && q.value_bits != 2 && q.value_bits != 4 && q.value_bits != 8) {
    return Invalid("quant.value_bits", absl::StrCat(q.value_bits, " is not one of 0, 2, 4, 8"));
  }
  if (q.value_bits > 0 && q.bits == 0) {
    return Invalid("quant.value_bits",
                   absl::StrCat(q.value_bits, " needs quant.bits > 0 (keys quantized too)"));
  }
  // group_size only matters when quantizing (the default 32 does not divide a head_dim of 8).
  if (q.bits > 0) {
    if (q.group_size < 1) {
      return Invalid("quant.group_size", absl::StrCat(q.group_size, " must be >= 1"));
    }
    if (shape.head_dim % q.group_size != 0) {
      return Invalid("quant.group_size",
                     absl::StrCat(q.group_size, " does not divide head_dim ", shape.head_dim));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateSpec(const CompressionSpec& spec, const LayerShape& shape, int layer_index) {
  if (layer_index < 0) {
    return Invalid("layer_index", absl::StrCat(layer_index, " must be >= 0"));
  }
  if (absl::Status s = ValidateEviction(spec.eviction, shape); !s.ok()) return s;
  if (shape.obs_window > shape.seq_len && !Policy(spec.eviction.policy).rows_after_context) {
    // The observation rows are the prompt's last W positions: there are only S of them.
    return Invalid("shape.obs_window",
                   absl::StrCat(shape.obs_window, " exceeds seq_len ", shape.seq_len,
                                " (only kvzip's reconstruction rows may outnumber the tokens)"));
  }
  if (absl::Status s = ValidateChannels(spec.channels, shape); !s.ok()) return s;
  if (absl::Status s = ValidateQuant(spec.quant, shape); !s.ok()) return s;
  if (spec.recent_tokens < 0) {
    return Invalid("recent_tokens", absl::StrCat(spec.recent_tokens, " must be >= 0"));
  }
  return absl::OkStatus();
}

absl::Status ValidateSpecInput(const CompressionSpec& spec, const LayerInput& in) {
  const EvictionSpec& e = spec.eviction;
  if (!IsKnownPolicy(e.policy)) {
    return Invalid("eviction.policy", absl::StrCat("unknown value ", static_cast<int>(e.policy)));
  }
  const PolicyInfo& row = Policy(e.policy);
  if (row.inputs == PolicyInputs::kQueryStatistics && in.rope == nullptr) {
    return Invalid("rope", absl::StrCat("the ", std::string(row.name),
                                        " policy needs the model's RoPE (theta, rotary dims, "
                                        "style)"));
  }
  if (e.query_stats && in.q_stats == nullptr) {
    return Invalid("q_stats", "null pointer with eviction.query_stats set");
  }
  return absl::OkStatus();
}

int EffectiveBudget(const EvictionSpec& spec, int layer_index, int seq_len) {
  if (spec.policy == EvictionPolicy::kNone) return seq_len;
  int b = 0;
  if (layer_index >= 0 && static_cast<size_t>(layer_index) < spec.layer_budgets.size()) {
    b = spec.layer_budgets[layer_index];
  }
  if (b <= 0) b = spec.budget;
  if (b <= 0) b = static_cast<int>(std::lround(spec.keep_ratio * seq_len));
  if (b < 1) b = 1;
  if (b > seq_len) b = seq_len;
  return b;
}

PassKeys PassKeyRange(const EvictionSpec& spec, int seq_len, size_t pass) {
  const int64_t chunk = std::max(spec.pass_tokens, 1);
  const int64_t start = chunk * static_cast<int64_t>(pass);  // < 2^30 * 2^31: no overflow
  const int lo = static_cast<int>(std::min<int64_t>(seq_len, start));
  const int hi = static_cast<int>(std::min<int64_t>(seq_len, start + chunk));
  return {std::min(lo, std::max(spec.sink_tokens, 0)), lo, hi};
}

ProtectedTokens ProtectedFor(const EvictionSpec& e, const LayerShape& shape, int budget) {
  const PolicyInfo& row = Policy(e.policy);
  ProtectedTokens p;
  switch (row.window) {
    case ProtectedWindow::kEverything:
      p.recent = budget;
      break;
    case ProtectedWindow::kSinksAndRecent:
      p.sinks = std::min(e.sink_tokens, budget);
      p.recent = budget - p.sinks;
      break;
    case ProtectedWindow::kSinks:
      p.sinks = std::min(e.sink_tokens, budget);
      break;
    case ProtectedWindow::kRecentFraction: {
      const double f = e.recent_fraction >= 0.0 ? e.recent_fraction : row.default_recent_fraction;
      // int(f * B) as in the reference implementations (floor for non-negative values).
      p.recent = static_cast<int>(f * budget);
      break;
    }
    case ProtectedWindow::kObservation:
      // The observation window is always kept; a budget below W keeps its most recent B tokens.
      p.recent = std::min(shape.obs_window, budget);
      break;
    case ProtectedWindow::kNothing:
      break;
  }
  p.recent = std::clamp(p.recent, 0, budget - p.sinks);
  return p;
}

int KeptChannels(double lambda, int head_dim) {
  return head_dim - static_cast<int>(std::floor(lambda * head_dim));
}

std::string_view PolicyName(EvictionPolicy p) {
  return IsKnownPolicy(p) ? Policy(p).name : "unknown";
}

bool PolicyHasScores(EvictionPolicy p) { return IsKnownPolicy(p) && Policy(p).scores; }

std::string FormatDouble(double v) {
  char buf[40];
  for (int precision = 6; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string_view ValueWeightName(ValueWeight w) {
  switch (w) {
    case ValueWeight::kAuto:
      return "auto";
    case ValueWeight::kOff:
      return "off";
    case ValueWeight::kMul:
      return "mul";
    case ValueWeight::kAdd:
      return "add";
  }
  return "unknown";
}

absl::StatusOr<ValueWeight> ParseValueWeight(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n.empty()) return ValueWeight::kAuto;
  for (ValueWeight w :
       {ValueWeight::kAuto, ValueWeight::kOff, ValueWeight::kMul, ValueWeight::kAdd}) {
    if (n == ValueWeightName(w)) return w;
  }
  return Invalid("eviction.value_weight", absl::StrCat("unknown '", std::string(name),
                                                       "' (expected auto, off, mul or add)"));
}

ValueWeight EffectiveValueWeight(const EvictionSpec& e) {
  if (e.value_weight != ValueWeight::kAuto) return e.value_weight;
  return IsKnownPolicy(e.policy) && Policy(e.policy).value_weight_by_default ? ValueWeight::kMul
                                                                             : ValueWeight::kOff;
}

std::string_view PolicyName(ChannelPolicy p) {
  switch (p) {
    case ChannelPolicy::kNone:
      return "none";
    case ChannelPolicy::kThink:
      return "think";
    case ChannelPolicy::kL1:
      return "l1";
    case ChannelPolicy::kL2:
      return "l2";
  }
  return "unknown";
}

absl::StatusOr<EvictionPolicy> ParseEvictionPolicy(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  for (const PolicyInfo& row : kPolicies) {
    if (n == row.name) return row.policy;
  }
  return Invalid("eviction.policy",
                 absl::StrCat("unknown '", std::string(name), "' (expected one of ",
                              absl::StrJoin(EvictionPolicyNames(), ", "), ")"));
}

absl::StatusOr<ChannelPolicy> ParseChannelPolicy(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  for (ChannelPolicy p : kChannelPolicies) {
    if (n == PolicyName(p)) return p;
  }
  return Invalid("channels.key_policy",
                 absl::StrCat("unknown '", std::string(name), "' (expected one of ",
                              absl::StrJoin(ChannelPolicyNames(), ", "), ")"));
}

std::vector<std::string> EvictionPolicyNames() {
  std::vector<std::string> names;
  for (const PolicyInfo& row : kPolicies) names.emplace_back(row.name);
  return names;
}

std::vector<std::string> ChannelPolicyNames() {
  std::vector<std::string> names;
  for (ChannelPolicy p : kChannelPolicies) names.emplace_back(PolicyName(p));
  return names;
}

}  // namespace kvc

// Spec strings (kvc/spec.h): parsing and the canonical form.
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "kvc/spec.h"

namespace kvc {
namespace {

// The shortest decimal form that reads back as exactly `x`.
std::string ShortestDouble(double x) {
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}

absl::StatusOr<double> ParseDouble(absl::string_view what, absl::string_view text) {
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || std::isnan(v)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", text, "' is not a number"));
  }
  return v;
}

absl::StatusOr<int> ParseInt(absl::string_view what, absl::string_view text, int min) {
  int v = 0;
  if (!absl::SimpleAtoi(text, &v)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " '", text, "' is not an integer"));
  }
  if (v < min) return absl::InvalidArgumentError(absl::StrCat(what, " ", v, " must be >= ", min));
  return v;
}

absl::StatusOr<double> ParseFraction(absl::string_view what, absl::string_view text) {
  absl::StatusOr<double> v = ParseDouble(what, text);
  if (!v.ok()) return v;
  if (!(*v >= 0.0 && *v < 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat(what, " ", text, " is outside [0, 1)"));
  }
  return v;
}

// One eviction option. Add new keys to kEvictionKeys (parse) and AppendEvictionOptions (print).
using KeySetter = absl::Status (*)(absl::string_view value, EvictionSpec& e);
struct EvictionKey {
  absl::string_view name;
  KeySetter set;
};

absl::Status SetSink(absl::string_view v, EvictionSpec& e) {
  absl::StatusOr<int> n = ParseInt("sink", v, 0);
  if (n.ok()) e.sink_tokens = *n;
  return n.status();
}
absl::Status SetRecent(absl::string_view v, EvictionSpec& e) {
  absl::StatusOr<double> f = ParseDouble("recent", v);
  if (!f.ok()) return f.status();
  if (!(*f >= 0.0 && *f <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("recent ", v, " is outside [0, 1]"));
  }
  e.recent_fraction = *f;
  return absl::OkStatus();
}
absl::Status SetKernel(absl::string_view v, EvictionSpec& e) {
  absl::StatusOr<int> n = ParseInt("kernel", v, 1);
  if (!n.ok()) return n.status();
  if (*n % 2 == 0) return absl::InvalidArgumentError(absl::StrCat("kernel ", *n, " must be odd"));
  e.pool_kernel = *n;
  return absl::OkStatus();
}
absl::Status SetPool(absl::string_view v, EvictionSpec& e) {
  if (v == "max") {
    e.pool = PoolKind::kMax;
  } else if (v == "avg") {
    e.pool = PoolKind::kAvg;
  } else {
    return absl::InvalidArgumentError(absl::StrCat("pool '", v, "' is not max or avg"));
  }
  return absl::OkStatus();
}
absl::Status SetTau(absl::string_view v, EvictionSpec& e) {
  absl::StatusOr<double> f = ParseDouble("tau", v);
  if (!f.ok()) return f.status();
  if (!(*f > 0.0) || std::isinf(*f)) {
    return absl::InvalidArgumentError(absl::StrCat("tau ", v, " must be finite and > 0"));
  }
  e.tau = *f;
  return absl::OkStatus();
}
absl::Status SetSeed(absl::string_view v, EvictionSpec& e) {
  uint64_t seed = 0;
  if (!absl::SimpleAtoi(v, &seed)) {
    return absl::InvalidArgumentError(absl::StrCat("seed '", v, "' is not an unsigned integer"));
  }
  e.seed = seed;
  return absl::OkStatus();
}
absl::Status SetLayer(absl::string_view v, EvictionSpec& e) {
  if (v != "0" && v != "1") {
    return absl::InvalidArgumentError(absl::StrCat("layer '", v, "' is not 0 or 1"));
  }
  e.granularity = v == "1" ? Granularity::kPerLayer : Granularity::kPerHead;
  return absl::OkStatus();
}
absl::Status SetLayerBudgets(absl::string_view v, EvictionSpec& e) {
  e.layer_budgets.clear();
  for (absl::string_view b : absl::StrSplit(v, '/')) {
    absl::StatusOr<int> n = ParseInt("lb entry", b, 0);
    if (!n.ok()) return n.status();
    e.layer_budgets.push_back(*n);
  }
  return absl::OkStatus();
}
absl::Status SetAdaptive(absl::string_view v, EvictionSpec& e) {
  absl::StatusOr<double> f = ParseDouble("ada", v);
  if (!f.ok()) return f.status();
  if (!(*f >= 0.0 && *f <= 1.0)) {
    return absl::InvalidArgumentError(absl::StrCat("ada ", v, " is outside [0, 1]"));
  }
  e.adaptive = true;
  e.adaptive_floor = *f;
  return absl::OkStatus();
}

// Value-aware and expected-attention options: value=auto|off|mul|add, veps=EPS, horizon=N,
// stats=0|1 (expected: query statistics from the client).
absl::Status SetValue(absl::string_view v, EvictionSpec& e) {
  absl::StatusOr<ValueWeight> w = ParseValueWeight(std::string(v));
  if (!w.ok() || v.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("value '", v, "' is not auto, off, mul or add"));
  }
  e.value_weight = *w;
  return absl::OkStatus();
}
absl::Status SetValueEps(absl::string_view v, EvictionSpec& e) {
  absl::StatusOr<double> f = ParseDouble("veps", v);
  if (!f.ok()) return f.status();
  if (!(*f >= 0.0) || std::isinf(*f)) {
    return absl::InvalidArgumentError(absl::StrCat("veps ", v, " must be finite and >= 0"));
  }
  e.value_eps = *f;
  return absl::OkStatus();
}
absl::Status SetHorizon(absl::string_view v, EvictionSpec& e) {
  absl::StatusOr<int> n = ParseInt("horizon", v, 1);
  if (n.ok()) e.horizon = *n;
  return n.status();
}
absl::Status SetStats(absl::string_view v, EvictionSpec& e) {
  if (v != "0" && v != "1") {
    return absl::InvalidArgumentError(absl::StrCat("stats '", v, "' is not 0 or 1"));
  }
  e.query_stats = v == "1";
  return absl::OkStatus();
}

constexpr EvictionKey kEvictionKeys[] = {
    {"sink", SetSink},   {"recent", SetRecent}, {"kernel", SetKernel},   {"pool", SetPool},
    {"tau", SetTau},     {"seed", SetSeed},     {"layer", SetLayer},     {"lb", SetLayerBudgets},
    {"ada", SetAdaptive}, {"value", SetValue},  {"veps", SetValueEps},   {"horizon", SetHorizon},
    {"stats", SetStats},
};

void AppendEvictionOptions(const EvictionSpec& e, std::string& out) {
  const EvictionSpec d;
  if (e.sink_tokens != d.sink_tokens) absl::StrAppend(&out, ",sink=", e.sink_tokens);
  if (e.recent_fraction >= 0) {
    absl::StrAppend(&out, ",recent=", ShortestDouble(e.recent_fraction));
  }
  if (e.pool_kernel != d.pool_kernel) absl::StrAppend(&out, ",kernel=", e.pool_kernel);
  if (e.pool != d.pool) absl::StrAppend(&out, ",pool=", e.pool == PoolKind::kAvg ? "avg" : "max");
  if (e.tau != d.tau) absl::StrAppend(&out, ",tau=", ShortestDouble(e.tau));
  if (e.seed != d.seed) absl::StrAppend(&out, ",seed=", e.seed);
  if (e.granularity == Granularity::kPerLayer) absl::StrAppend(&out, ",layer=1");
  if (!e.layer_budgets.empty()) {
    absl::StrAppend(&out, ",lb=", absl::StrJoin(e.layer_budgets, "/"));
  }
  if (e.adaptive) absl::StrAppend(&out, ",ada=", ShortestDouble(e.adaptive_floor));
  if (e.value_weight != d.value_weight) {
    absl::StrAppend(&out, ",value=", std::string(ValueWeightName(e.value_weight)));
  }
  if (e.value_eps != d.value_eps) absl::StrAppend(&out, ",veps=", ShortestDouble(e.value_eps));
  if (e.horizon != d.horizon) absl::StrAppend(&out, ",horizon=", e.horizon);
  if (e.query_stats) absl::StrAppend(&out, ",stats=1");
}

absl::Status ParseEvictionTerm(absl::string_view term, EvictionSpec& e) {
  std::vector<absl::string_view> parts = absl::StrSplit(term, ',');
  const absl::string_view head = parts[0];
  const size_t sep = head.find_first_of(":@");
  absl::StatusOr<EvictionPolicy> policy = ParseEvictionPolicy(std::string(head.substr(0, sep)));
  if (policy.ok() && sep == absl::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(head, " needs an amount: ", head, ":KEEP or ", head, "@BUDGET"));
  }
  if (!policy.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown term '", head.substr(0, sep), "' (eviction policies: ",
        absl::StrJoin(EvictionPolicyNames(), ", "), "; channels: think, l1, l2, vthink; qB; r=N)"));
  }
  if (*policy == EvictionPolicy::kNone) {
    return absl::InvalidArgumentError("'none' takes no amount; write 'none' or 'full' alone");
  }
  e.policy = *policy;
  const absl::string_view amount = head.substr(sep + 1);
  if (head[sep] == ':') {
    absl::StatusOr<double> keep = ParseDouble("keep", amount);
    if (!keep.ok()) return keep.status();
    if (!(*keep > 0.0 && *keep <= 1.0)) {
      return absl::InvalidArgumentError(absl::StrCat("keep ", amount, " is outside (0, 1]"));
    }
    e.keep_ratio = *keep;
  } else {
    absl::StatusOr<int> budget = ParseInt("budget", amount, 1);
    if (!budget.ok()) return budget.status();
    e.budget = *budget;
  }
  for (size_t i = 1; i < parts.size(); ++i) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(parts[i], '=');
    if (kv.first.empty() || kv.second.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("option '", parts[i], "' is not key=value"));
    }
    const EvictionKey* key = nullptr;
    for (const EvictionKey& k : kEvictionKeys) {
      if (k.name == kv.first) key = &k;
    }
    if (key == nullptr) {
      std::vector<absl::string_view> names;
      for (const EvictionKey& k : kEvictionKeys) names.push_back(k.name);
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown option '", kv.first, "' (options: ", absl::StrJoin(names, ", "), ")"));
    }
    if (absl::Status s = key->set(kv.second, e); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ParseQuantTerm(absl::string_view term, QuantSpec& q) {
  absl::string_view rest = term.substr(1);
  absl::string_view bits = rest, group;
  if (const size_t g = rest.find('g'); g != absl::string_view::npos) {
    bits = rest.substr(0, g);
    group = rest.substr(g + 1);
  }
  absl::StatusOr<int> b = ParseInt("bits", bits, 0);
  if (!b.ok()) return b.status();
  if (*b != 2 && *b != 4 && *b != 8) {
    return absl::InvalidArgumentError(absl::StrCat("bits ", *b, " is not 2, 4 or 8"));
  }
  q.bits = *b;
  if (!group.empty() || term.back() == 'g') {
    absl::StatusOr<int> g = ParseInt("group", group, 1);
    if (!g.ok()) return g.status();
    q.group_size = *g;
  }
  return absl::OkStatus();
}

// Parses one term into `spec`; `seen` tracks the kinds already given.
absl::Status ParseTerm(absl::string_view term, CompressionSpec& spec, std::vector<char>& seen) {
  auto once = [&](char kind, absl::string_view what) -> absl::Status {
    if (seen[kind]) {
      return absl::InvalidArgumentError(absl::StrCat("a second ", what, " term"));
    }
    seen[kind] = 1;
    return absl::OkStatus();
  };
  const size_t colon = term.find(':');
  const absl::string_view name = term.substr(0, colon);
  if (colon != absl::string_view::npos &&
      (name == "think" || name == "l1" || name == "l2" || name == "vthink")) {
    if (term.find(',') != absl::string_view::npos) {
      return absl::InvalidArgumentError("channel terms take no options");
    }
    absl::StatusOr<double> lambda = ParseFraction("lambda", term.substr(colon + 1));
    if (!lambda.ok()) return lambda.status();
    if (name == "vthink") {
      if (absl::Status s = once('v', "value pruning"); !s.ok()) return s;
      spec.channels.prune_values = true;
      spec.channels.value_lambda = *lambda;
      return absl::OkStatus();
    }
    if (absl::Status s = once('k', "key channel"); !s.ok()) return s;
    spec.channels.key_policy = *ParseChannelPolicy(std::string(name));
    spec.channels.key_lambda = *lambda;
    return absl::OkStatus();
  }
  if (absl::ConsumePrefix(&term, "r=")) {
    if (absl::Status s = once('r', "r="); !s.ok()) return s;
    absl::StatusOr<int> r = ParseInt("recent_tokens", term, 0);
    if (r.ok()) spec.recent_tokens = *r;
    return r.status();
  }
  if (term.size() >= 2 && term[0] == 'q' && absl::ascii_isdigit(term[1])) {
    if (absl::Status s = once('q', "quantization"); !s.ok()) return s;
    return ParseQuantTerm(term, spec.quant);
  }
  if (absl::Status s = once('e', "eviction"); !s.ok()) return s;
  return ParseEvictionTerm(term, spec.eviction);
}

}  // namespace

absl::StatusOr<CompressionSpec> ParseSpecString(std::string_view text) {
  const absl::string_view whole =
      absl::StripAsciiWhitespace(absl::string_view(text.data(), text.size()));
  auto fail = [&](absl::string_view term, const absl::Status& s) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec \"", whole, "\": term \"", term, "\": ", s.message()));
  };
  CompressionSpec spec;
  if (whole.empty()) {
    return absl::InvalidArgumentError("spec \"\": empty (use 'full' to keep everything)");
  }
  if (whole == "full" || whole == "none") return spec;
  std::vector<char> seen(256, 0);
  for (absl::string_view raw : absl::StrSplit(whole, '+')) {
    const absl::string_view term = absl::StripAsciiWhitespace(raw);
    if (term.empty()) return fail(term, absl::InvalidArgumentError("empty term"));
    if (term == "full" || term == "none") {
      return fail(term, absl::InvalidArgumentError("'full' and 'none' stand alone"));
    }
    if (absl::Status s = ParseTerm(term, spec, seen); !s.ok()) return fail(term, s);
  }
  return spec;
}

std::string SpecString(const CompressionSpec& spec) {
  std::vector<std::string> terms;
  const EvictionSpec& e = spec.eviction;
  if (e.policy != EvictionPolicy::kNone) {
    std::string t(PolicyName(e.policy).data(), PolicyName(e.policy).size());
    if (e.budget > 0) {
      absl::StrAppend(&t, "@", e.budget);
    } else {
      absl::StrAppend(&t, ":", ShortestDouble(e.keep_ratio));
    }
    AppendEvictionOptions(e, t);
    terms.push_back(std::move(t));
  }
  const ChannelSpec& c = spec.channels;
  if (c.key_policy != ChannelPolicy::kNone) {
    terms.push_back(
        absl::StrCat(std::string(PolicyName(c.key_policy)), ":", ShortestDouble(c.key_lambda)));
  }
  if (c.prune_values) terms.push_back(absl::StrCat("vthink:", ShortestDouble(c.value_lambda)));
  if (spec.quant.bits > 0) {
    std::string t = absl::StrCat("q", spec.quant.bits);
    if (spec.quant.group_size != QuantSpec().group_size) {
      absl::StrAppend(&t, "g", spec.quant.group_size);
    }
    terms.push_back(std::move(t));
  }
  if (spec.recent_tokens != CompressionSpec().recent_tokens) {
    terms.push_back(absl::StrCat("r=", spec.recent_tokens));
  }
  return terms.empty() ? "full" : absl::StrJoin(terms, "+");
}

}  // namespace kvc

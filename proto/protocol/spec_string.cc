// Spec strings (kvc/protocol/spec_string.h): parsing into a CompressionConfig and the canonical
// form. The eviction options come from the (kvcache.v1.spec) annotations of EvictionConfig's
// fields, read and written through protobuf reflection.
#include "kvc/protocol/spec_string.h"

#include <algorithm>
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
#include "google/protobuf/descriptor.h"
#include "google/protobuf/reflection.h"
#include "kvc/policy.h"
#include "kvc/protocol/convert.h"
#include "kvc/status_macros.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;
using google::protobuf::FieldDescriptor;
using google::protobuf::Reflection;

// The shortest decimal form that reads back as exactly `x`.
std::string ShortestDouble(double x) {
  char buf[40];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}

absl::Status Invalid(absl::string_view what) { return absl::InvalidArgumentError(what); }

absl::StatusOr<double> ParseDouble(absl::string_view what, absl::string_view text) {
  double v = 0;
  if (!absl::SimpleAtod(text, &v) || std::isnan(v)) {
    return Invalid(absl::StrCat(what, " '", text, "' is not a number"));
  }
  return v;
}

absl::StatusOr<int> ParseInt(absl::string_view what, absl::string_view text, int min) {
  int v = 0;
  if (!absl::SimpleAtoi(text, &v)) {
    return Invalid(absl::StrCat(what, " '", text, "' is not an integer"));
  }
  if (v < min) return Invalid(absl::StrCat(what, " ", v, " must be >= ", min));
  return v;
}

absl::StatusOr<double> ParseFraction(absl::string_view what, absl::string_view text) {
  absl::StatusOr<double> v = ParseDouble(what, text);
  if (!v.ok()) return v;
  if (!(*v >= 0.0 && *v < 1.0)) {
    return Invalid(absl::StrCat(what, " ", text, " is outside [0, 1)"));
  }
  return v;
}

// "a, b or c".
std::string OrList(const std::vector<std::string>& items) {
  if (items.size() < 2) return absl::StrJoin(items, "");
  return absl::StrCat(absl::StrJoin(items.begin(), items.end() - 1, ", "), " or ", items.back());
}

// One eviction option: an annotated EvictionConfig field.
struct Option {
  const FieldDescriptor* field;
  pb::SpecOption spec;
};

// The annotated fields of EvictionConfig, in the canonical order.
const std::vector<Option>& EvictionOptions() {
  static const std::vector<Option>* const options = [] {
    auto* out = new std::vector<Option>();
    const google::protobuf::Descriptor* d = pb::EvictionConfig::descriptor();
    for (int i = 0; i < d->field_count(); ++i) {
      const FieldDescriptor* f = d->field(i);
      if (f->options().HasExtension(pb::spec)) {
        out->push_back({f, f->options().GetExtension(pb::spec)});
      }
    }
    std::sort(out->begin(), out->end(),
              [](const Option& a, const Option& b) { return a.spec.order() < b.spec.order(); });
    return out;
  }();
  return *options;
}

// The choices of a string, enum or bool option: (text, enum value name or "").
std::vector<std::pair<std::string, std::string>> Choices(const Option& o) {
  std::vector<std::pair<std::string, std::string>> out;
  if (o.field->type() == FieldDescriptor::TYPE_BOOL) return {{"0", ""}, {"1", ""}};
  for (const std::string& v : o.spec.values()) {
    const size_t eq = v.find('=');
    if (eq == std::string::npos) {
      out.emplace_back(v, "");
    } else {
      out.emplace_back(v.substr(0, eq), v.substr(eq + 1));
    }
  }
  return out;
}

// Checks a number against the option's bounds; `text` is how the string wrote it.
absl::Status CheckBounds(const Option& o, absl::string_view what, double v,
                         absl::string_view text) {
  const pb::SpecOption& s = o.spec;
  if (s.has_min() && s.has_max()) {
    if (!(v >= s.min() && v <= s.max())) {
      return Invalid(absl::StrCat(what, " ", text, " is outside [", ShortestDouble(s.min()), ", ",
                                  ShortestDouble(s.max()), "]"));
    }
  } else if (s.has_min()) {
    const bool below = s.min_exclusive() ? !(v > s.min()) : !(v >= s.min());
    if (below || (s.finite() && std::isinf(v))) {
      return Invalid(absl::StrCat(what, " ", text, " must be ", s.finite() ? "finite and " : "",
                                  s.min_exclusive() ? "> " : ">= ", ShortestDouble(s.min())));
    }
  }
  if (s.odd() && std::fmod(v, 2.0) == 0.0) {
    return Invalid(absl::StrCat(what, " ", text, " must be odd"));
  }
  return absl::OkStatus();
}

// Sets one value (or one entry of a repeated field) of `o` in `e` from its text.
absl::Status SetValue(const Option& o, absl::string_view what, absl::string_view text,
                      pb::EvictionConfig& e) {
  const FieldDescriptor* f = o.field;
  const Reflection* r = e.GetReflection();
  switch (f->type()) {
    case FieldDescriptor::TYPE_UINT32: {
      const int min = o.spec.has_min() ? static_cast<int>(o.spec.min()) : 0;
      absl::StatusOr<int> n = ParseInt(what, text, min);
      if (!n.ok()) return n.status();
      RETURN_IF_ERROR(CheckBounds(o, what, *n, absl::StrCat(*n)));
      if (f->is_repeated()) {
        r->AddUInt32(&e, f, static_cast<uint32_t>(*n));
      } else {
        r->SetUInt32(&e, f, static_cast<uint32_t>(*n));
      }
      return absl::OkStatus();
    }
    case FieldDescriptor::TYPE_UINT64: {
      uint64_t n = 0;
      if (!absl::SimpleAtoi(text, &n)) {
        return Invalid(absl::StrCat(what, " '", text, "' is not an unsigned integer"));
      }
      r->SetUInt64(&e, f, n);
      return absl::OkStatus();
    }
    case FieldDescriptor::TYPE_DOUBLE: {
      absl::StatusOr<double> v = ParseDouble(what, text);
      if (!v.ok()) return v.status();
      RETURN_IF_ERROR(CheckBounds(o, what, *v, text));
      r->SetDouble(&e, f, *v);
      return absl::OkStatus();
    }
    case FieldDescriptor::TYPE_STRING:
    case FieldDescriptor::TYPE_ENUM:
    case FieldDescriptor::TYPE_BOOL: {
      std::vector<std::string> texts;
      for (const auto& [choice, enum_name] : Choices(o)) {
        texts.push_back(choice);
        if (!absl::EqualsIgnoreCase(choice, text)) continue;
        if (f->type() == FieldDescriptor::TYPE_STRING) {
          r->SetString(&e, f, choice);
        } else if (f->type() == FieldDescriptor::TYPE_BOOL) {
          r->SetBool(&e, f, choice == "1");
        } else {
          const google::protobuf::EnumValueDescriptor* v =
              f->enum_type()->FindValueByName(enum_name);
          if (v == nullptr) return absl::InternalError(absl::StrCat("spec option ", o.spec.key()));
          r->SetEnum(&e, f, v);
        }
        return absl::OkStatus();
      }
      return Invalid(absl::StrCat(what, " '", text, "' is not ", OrList(texts)));
    }
    default:
      return absl::InternalError(absl::StrCat("spec option ", o.spec.key(), ": unsupported type"));
  }
}

absl::Status SetOption(const Option& o, absl::string_view value, pb::EvictionConfig& e) {
  const std::string& key = o.spec.key();
  if (o.field->is_repeated()) {
    e.GetReflection()->ClearField(&e, o.field);
    for (absl::string_view entry : absl::StrSplit(value, '/')) {
      RETURN_IF_ERROR(SetValue(o, absl::StrCat(key, " entry"), entry, e));
    }
  } else {
    RETURN_IF_ERROR(SetValue(o, key, value, e));
  }
  if (!o.spec.sets().empty()) {
    const FieldDescriptor* flag = e.GetDescriptor()->FindFieldByName(o.spec.sets());
    if (flag == nullptr || flag->type() != FieldDescriptor::TYPE_BOOL) {
      return absl::InternalError(absl::StrCat("spec option ", key, ": sets ", o.spec.sets()));
    }
    e.GetReflection()->SetBool(&e, flag, true);
  }
  return absl::OkStatus();
}

// The option's value in `e` as the string writes it.
std::string FormatValue(const Option& o, const pb::EvictionConfig& e) {
  const FieldDescriptor* f = o.field;
  const Reflection* r = e.GetReflection();
  auto one = [&](int i) -> std::string {
    switch (f->type()) {
      case FieldDescriptor::TYPE_UINT32:
        return absl::StrCat(i < 0 ? r->GetUInt32(e, f) : r->GetRepeatedUInt32(e, f, i));
      case FieldDescriptor::TYPE_UINT64:
        return absl::StrCat(r->GetUInt64(e, f));
      case FieldDescriptor::TYPE_DOUBLE:
        return ShortestDouble(r->GetDouble(e, f));
      case FieldDescriptor::TYPE_STRING:
        return r->GetString(e, f);
      case FieldDescriptor::TYPE_BOOL:
        return r->GetBool(e, f) ? "1" : "0";
      case FieldDescriptor::TYPE_ENUM:
        for (const auto& [choice, enum_name] : Choices(o)) {
          if (enum_name == r->GetEnum(e, f)->name()) return choice;
        }
        return absl::StrCat(r->GetEnumValue(e, f));
      default:
        return "";
    }
  };
  if (!f->is_repeated()) return one(-1);
  std::vector<std::string> entries;
  for (int i = 0; i < r->FieldSize(e, f); ++i) entries.push_back(one(i));
  return absl::StrJoin(entries, "/");
}

// Whether the option is written: it differs from the engine's default (`defaults`: the config of
// a default CompressionSpec), or, for one that also sets a flag, that flag is on.
bool Differs(const Option& o, const pb::EvictionConfig& e, const pb::EvictionConfig& defaults) {
  const Reflection* r = e.GetReflection();
  if (!o.spec.sets().empty()) {
    return r->GetBool(e, e.GetDescriptor()->FindFieldByName(o.spec.sets()));
  }
  if (o.field->is_repeated()) return r->FieldSize(e, o.field) > 0;
  if (o.field->has_presence() && !r->HasField(e, o.field)) return false;
  if (o.field->has_presence() && !r->HasField(defaults, o.field)) return true;
  return FormatValue(o, e) != FormatValue(o, defaults);
}

absl::Status ParseEvictionTerm(absl::string_view term, pb::EvictionConfig& e) {
  std::vector<absl::string_view> parts = absl::StrSplit(term, ',');
  const absl::string_view head = parts[0];
  const size_t sep = head.find_first_of(":@");
  absl::StatusOr<EvictionPolicy> policy = ParseEvictionPolicy(std::string(head.substr(0, sep)));
  if (policy.ok() && sep == absl::string_view::npos) {
    return Invalid(absl::StrCat(head, " needs an amount: ", head, ":KEEP or ", head, "@BUDGET"));
  }
  if (!policy.ok()) {
    return Invalid(absl::StrCat("unknown term '", head.substr(0, sep), "' (eviction policies: ",
                                absl::StrJoin(EvictionPolicyNames(), ", "),
                                "; channels: think, l1, l2, vthink; qB; r=N)"));
  }
  if (*policy == EvictionPolicy::kNone) {
    return Invalid("'none' takes no amount; write 'none' or 'full' alone");
  }
  e.set_policy(std::string(PolicyName(*policy)));
  const absl::string_view amount = head.substr(sep + 1);
  if (head[sep] == ':') {
    absl::StatusOr<double> keep = ParseDouble("keep", amount);
    if (!keep.ok()) return keep.status();
    if (!(*keep > 0.0 && *keep <= 1.0)) {
      return Invalid(absl::StrCat("keep ", amount, " is outside (0, 1]"));
    }
    e.set_keep_ratio(*keep);
  } else {
    absl::StatusOr<int> budget = ParseInt("budget", amount, 1);
    if (!budget.ok()) return budget.status();
    e.set_budget(static_cast<uint32_t>(*budget));
  }
  for (size_t i = 1; i < parts.size(); ++i) {
    std::pair<absl::string_view, absl::string_view> kv = absl::StrSplit(parts[i], '=');
    if (kv.first.empty() || kv.second.empty()) {
      return Invalid(absl::StrCat("option '", parts[i], "' is not key=value"));
    }
    const Option* option = nullptr;
    for (const Option& o : EvictionOptions()) {
      if (o.spec.key() == kv.first) option = &o;
    }
    if (option == nullptr) {
      std::vector<std::string> keys;
      for (const Option& o : EvictionOptions()) keys.push_back(o.spec.key());
      return Invalid(absl::StrCat("unknown option '", kv.first,
                                  "' (options: ", absl::StrJoin(keys, ", "), ")"));
    }
    RETURN_IF_ERROR(SetOption(*option, kv.second, e));
  }
  return absl::OkStatus();
}

// qB[vV][gG]: B bits (keys, and values unless vV gives theirs), groups of G.
absl::Status ParseQuantTerm(absl::string_view term, pb::QuantConfig& q) {
  absl::string_view rest = term.substr(1);
  absl::string_view bits = rest, group;
  if (const size_t g = rest.find('g'); g != absl::string_view::npos) {
    bits = rest.substr(0, g);
    group = rest.substr(g + 1);
  }
  absl::string_view value_bits;
  if (const size_t v = bits.find('v'); v != absl::string_view::npos) {
    value_bits = bits.substr(v + 1);
    bits = bits.substr(0, v);
    if (value_bits.empty()) return Invalid("value bits missing after 'v' (e.g. q8v4)");
  }
  absl::StatusOr<int> b = ParseInt("bits", bits, 0);
  if (!b.ok()) return b.status();
  if (*b != 2 && *b != 4 && *b != 8) {
    return Invalid(absl::StrCat("bits ", *b, " is not 2, 4 or 8"));
  }
  q.set_bits(static_cast<uint32_t>(*b));
  if (!value_bits.empty()) {
    absl::StatusOr<int> vb = ParseInt("value bits", value_bits, 0);
    if (!vb.ok()) return vb.status();
    if (*vb != 2 && *vb != 4 && *vb != 8) {
      return Invalid(absl::StrCat("value bits ", *vb, " is not 2, 4 or 8"));
    }
    // The same bits as the keys is the plain term (one spelling per spec).
    if (*vb != *b) q.set_value_bits(static_cast<uint32_t>(*vb));
  }
  if (!group.empty() || term.back() == 'g') {
    absl::StatusOr<int> g = ParseInt("group", group, 1);
    if (!g.ok()) return g.status();
    q.set_group_size(static_cast<uint32_t>(*g));
  }
  return absl::OkStatus();
}

// A key channel policy other than none (think, l1, l2).
bool IsKeyChannelTerm(absl::string_view name) {
  return name != "none" && ParseChannelPolicy(std::string(name)).ok() &&
         name == absl::AsciiStrToLower(name);
}

// Parses one term into `c`; `seen` tracks the kinds already given.
absl::Status ParseTerm(absl::string_view term, pb::CompressionConfig& c, std::vector<char>& seen) {
  auto once = [&](char kind, absl::string_view what) -> absl::Status {
    if (seen[kind]) return Invalid(absl::StrCat("a second ", what, " term"));
    seen[kind] = 1;
    return absl::OkStatus();
  };
  const size_t colon = term.find(':');
  const absl::string_view name = term.substr(0, colon);
  if (colon != absl::string_view::npos && (IsKeyChannelTerm(name) || name == "vthink")) {
    if (term.find(',') != absl::string_view::npos) {
      return Invalid("channel terms take no options");
    }
    absl::StatusOr<double> lambda = ParseFraction("lambda", term.substr(colon + 1));
    if (!lambda.ok()) return lambda.status();
    if (name == "vthink") {
      RETURN_IF_ERROR(once('v', "value pruning"));
      c.mutable_channels()->set_prune_values(true);
      c.mutable_channels()->set_value_lambda(*lambda);
      return absl::OkStatus();
    }
    RETURN_IF_ERROR(once('k', "key channel"));
    c.mutable_channels()->set_key_policy(std::string(name));
    c.mutable_channels()->set_key_lambda(*lambda);
    return absl::OkStatus();
  }
  if (absl::ConsumePrefix(&term, "r=")) {
    RETURN_IF_ERROR(once('r', "r="));
    absl::StatusOr<int> r = ParseInt("recent_tokens", term, 0);
    if (r.ok()) c.set_recent_tokens(static_cast<uint32_t>(*r));
    return r.status();
  }
  if (term.size() >= 2 && term[0] == 'q' && absl::ascii_isdigit(term[1])) {
    RETURN_IF_ERROR(once('q', "quantization"));
    return ParseQuantTerm(term, *c.mutable_quant());
  }
  RETURN_IF_ERROR(once('e', "eviction"));
  return ParseEvictionTerm(term, *c.mutable_eviction());
}

}  // namespace

absl::StatusOr<pb::CompressionConfig> ParseSpecConfig(std::string_view text) {
  const absl::string_view whole =
      absl::StripAsciiWhitespace(absl::string_view(text.data(), text.size()));
  auto fail = [&](absl::string_view term, const absl::Status& s) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec \"", whole, "\": term \"", term, "\": ", s.message()));
  };
  pb::CompressionConfig config;
  if (whole.empty()) {
    return absl::InvalidArgumentError("spec \"\": empty (use 'full' to keep everything)");
  }
  if (whole == "full" || whole == "none") return config;
  std::vector<char> seen(256, 0);
  for (absl::string_view raw : absl::StrSplit(whole, '+')) {
    const absl::string_view term = absl::StripAsciiWhitespace(raw);
    if (term.empty()) return fail(term, absl::InvalidArgumentError("empty term"));
    if (term == "full" || term == "none") {
      return fail(term, absl::InvalidArgumentError("'full' and 'none' stand alone"));
    }
    if (absl::Status s = ParseTerm(term, config, seen); !s.ok()) return fail(term, s);
  }
  return config;
}

absl::StatusOr<CompressionSpec> ParseSpecString(std::string_view text) {
  ASSIGN_OR_RETURN(const pb::CompressionConfig config, ParseSpecConfig(text));
  absl::StatusOr<CompressionSpec> spec = SpecFromProto(config, "");
  if (!spec.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "spec \"", absl::StripAsciiWhitespace(absl::string_view(text.data(), text.size())),
        "\": ", spec.status().message()));
  }
  return spec;
}

std::string SpecString(const CompressionSpec& spec) {
  const pb::CompressionConfig c = SpecToProto(spec);
  static const pb::CompressionConfig* const defaults =
      new pb::CompressionConfig(SpecToProto(CompressionSpec()));
  std::vector<std::string> terms;
  const pb::EvictionConfig& e = c.eviction();
  if (spec.eviction.policy != EvictionPolicy::kNone) {
    std::string t = e.policy();
    if (e.budget() > 0) {
      absl::StrAppend(&t, "@", e.budget());
    } else {
      absl::StrAppend(&t, ":", ShortestDouble(e.keep_ratio()));
    }
    for (const Option& o : EvictionOptions()) {
      if (Differs(o, e, defaults->eviction())) {
        absl::StrAppend(&t, ",", o.spec.key(), "=", FormatValue(o, e));
      }
    }
    terms.push_back(std::move(t));
  }
  const pb::ChannelConfig& ch = c.channels();
  if (spec.channels.key_policy != ChannelPolicy::kNone) {
    terms.push_back(absl::StrCat(ch.key_policy(), ":", ShortestDouble(ch.key_lambda())));
  }
  if (ch.prune_values())
    terms.push_back(absl::StrCat("vthink:", ShortestDouble(ch.value_lambda())));
  if (c.quant().bits() > 0) {
    std::string t = absl::StrCat("q", c.quant().bits());
    if (c.quant().value_bits() > 0 && c.quant().value_bits() != c.quant().bits()) {
      absl::StrAppend(&t, "v", c.quant().value_bits());
    }
    if (c.quant().group_size() != defaults->quant().group_size()) {
      absl::StrAppend(&t, "g", c.quant().group_size());
    }
    terms.push_back(std::move(t));
  }
  if (c.recent_tokens() != defaults->recent_tokens()) {
    terms.push_back(absl::StrCat("r=", c.recent_tokens()));
  }
  return terms.empty() ? "full" : absl::StrJoin(terms, "+");
}

}  // namespace kvc

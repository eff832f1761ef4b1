#include "kvc/fidelity/sweep.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kvc/status_macros.h"

namespace kvc::fidelity {
namespace {

// "snapkv:0.5,kernel=7+think:0.25" -> "snapkv:*,kernel=7+think:0.25": the first term's keep
// ratio or budget replaced, so rows differing only there share a plot series. A plain
// "policy:*" becomes "policy".
std::string SeriesOf(const std::string& label, const CompressionSpec& spec) {
  if (spec.eviction.policy == EvictionPolicy::kNone) return label;
  std::vector<std::string> terms = absl::StrSplit(label, '+');
  std::string& first = terms[0];
  const size_t mark = first.find_first_of(":@");
  if (mark == std::string::npos) return label;
  const size_t end = first.find(',', mark);
  first = absl::StrCat(first.substr(0, mark + 1), "*",
                       end == std::string::npos ? "" : first.substr(end));
  if (terms.size() == 1 && end == std::string::npos) return first.substr(0, mark);
  return absl::StrJoin(terms, "+");
}

std::string FamilyOf(const CompressionSpec& spec) {
  const bool evicts = spec.eviction.policy != EvictionPolicy::kNone;
  const bool channels =
      spec.channels.key_policy != ChannelPolicy::kNone || spec.channels.prune_values;
  const bool bits = spec.quant.bits > 0;
  if (!channels && !bits) return "eviction";
  if (channels && !bits) return "think";
  if (bits && !evicts && !channels) return "quant";
  return "combined";
}

}  // namespace

absl::StatusOr<int> ResolveQuantGroup(int requested, int head_dim) {
  if (requested < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quant_group: ", requested, " must be >= 0 (0 = the default)"));
  }
  const int group = requested > 0 ? requested : std::min(32, head_dim);
  if (group <= 0 || head_dim % group != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quant_group: ", group, " must divide head_dim ", head_dim));
  }
  return group;
}

SweepEntry EntryForSpec(const CompressionSpec& spec) {
  SweepEntry e;
  e.spec = spec;
  e.label = SpecString(spec);
  e.family = FamilyOf(spec);
  e.policy = std::string(PolicyName(spec.eviction.policy));
  e.keep_ratio = spec.eviction.keep_ratio;
  e.series = SeriesOf(e.label, spec);
  return e;
}

std::vector<SweepEntry> DefaultSweep(int quant_group) {
  // One spec string per row; "qB" without a group gets the run's group. Append new rows here.
  static constexpr const char* kRows[] = {
      "streaming:1",
      "streaming:0.75",
      "streaming:0.5",
      "streaming:0.25",
      "h2o:1",
      "h2o:0.75",
      "h2o:0.5",
      "h2o:0.25",
      "snapkv:1",
      "snapkv:0.75",
      "snapkv:0.5",
      "snapkv:0.25",
      "keyformer:1",
      "keyformer:0.75",
      "keyformer:0.5",
      "keyformer:0.25",
      "knorm:1",
      "knorm:0.75",
      "knorm:0.5",
      "knorm:0.25",
      "random:1",
      "random:0.75",
      "random:0.5",
      "random:0.25",
      "snapkv:0.5+think:0.25",
      "snapkv:0.5+think:0.5",
      "q4",
      "q2",
      // Head-adaptive budgets (AdaKV, floor 0.2).
      "h2o:0.5,ada=0.2",
      "h2o:0.25,ada=0.2",
      "snapkv:0.5,ada=0.2",
      "snapkv:0.25,ada=0.2",
      "keyformer:0.5,ada=0.2",
      "keyformer:0.25,ada=0.2",
      // Value-aware scores, expected attention (from the observation queries, and from
      // calibration statistics: stats=1) and KeyDiff.
      "h2o:0.5,value=mul",
      "h2o:0.25,value=mul",
      "h2o:0.5,value=add",
      "h2o:0.25,value=add",
      "snapkv:0.5,value=mul",
      "snapkv:0.25,value=mul",
      "snapkv:0.5,value=add",
      "snapkv:0.25,value=add",
      "keyformer:0.5,value=mul",
      "keyformer:0.25,value=mul",
      "keyformer:0.5,value=add",
      "keyformer:0.25,value=add",
      "expected:0.5",
      "expected:0.25",
      "expected:0.5,stats=1",
      "expected:0.25,stats=1",
      "keydiff:0.5",
      "keydiff:0.25",
  };
  std::vector<SweepEntry> out;
  for (const char* row : kRows) {
    absl::StatusOr<std::vector<SweepEntry>> entry = ParseSpecList(row, quant_group);
    // The list is fixed and tested (tests/fidelity/report_test.cc): a bad row is a bug here.
    if (!entry.ok()) std::abort();
    out.push_back(std::move((*entry)[0]));
  }
  return out;
}

absl::StatusOr<std::vector<SweepEntry>> ParseSpecList(absl::string_view list, int quant_group) {
  std::vector<SweepEntry> out;
  for (absl::string_view item : absl::StrSplit(list, ';')) {
    item = absl::StripAsciiWhitespace(item);
    if (item.empty()) continue;
    absl::StatusOr<CompressionSpec> spec =
        ParseSpecString(std::string_view(item.data(), item.size()));
    if (!spec.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--spec '", item, "': ", spec.status().message()));
    }
    // "q4" without a group: the run's group (the parser's default may not divide head_dim).
    for (absl::string_view term : absl::StrSplit(item, '+')) {
      term = absl::StripAsciiWhitespace(term);
      if (term.size() >= 2 && term[0] == 'q' && !absl::StrContains(term, 'g') &&
          std::all_of(term.begin() + 1, term.end(), absl::ascii_isdigit)) {
        spec->quant.group_size = quant_group;
      }
    }
    out.push_back(EntryForSpec(*spec));
  }
  if (out.empty()) return absl::InvalidArgumentError("--spec: no spec strings in the list");
  return out;
}

absl::StatusOr<std::vector<SweepEntry>> FilterOnly(std::vector<SweepEntry> sweep,
                                                   absl::string_view only) {
  const std::vector<absl::string_view> keys = absl::StrSplit(only, ',', absl::SkipEmpty());
  if (keys.empty()) return sweep;
  std::vector<SweepEntry> kept;
  std::vector<std::string> labels;
  for (SweepEntry& e : sweep) {
    labels.push_back(e.label);
    for (absl::string_view k : keys) {
      if (absl::StartsWith(e.label, k) || e.family == k) {
        kept.push_back(std::move(e));
        break;
      }
    }
  }
  if (kept.empty()) {
    return absl::NotFoundError(
        absl::StrCat("--only '", only, "' matches no row; rows: ", absl::StrJoin(labels, " ")));
  }
  return kept;
}

CompressionSpec ForSeed(const CompressionSpec& spec, int r) {
  CompressionSpec s = spec;
  s.eviction.seed += static_cast<uint64_t>(r);
  return s;
}

}  // namespace kvc::fidelity

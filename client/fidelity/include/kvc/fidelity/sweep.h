// The rows a fidelity run evaluates: the default sweep, rows from spec strings (kvc/spec.h's
// grammar, e.g. "keyformer:0.5+think:0.5+q4"), --only filtering, and per-seed spec variants.
#ifndef KVC_FIDELITY_SWEEP_H_
#define KVC_FIDELITY_SWEEP_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvc/protocol/spec_string.h"  // ParseSpecString, SpecString: the sweep's labels
#include "kvc/spec.h"

namespace kvc::fidelity {

// Quantization group size for a model: `requested` when > 0, else min(32, head_dim). Must divide
// head_dim (INVALID_ARGUMENT naming quant_group otherwise).
absl::StatusOr<int> ResolveQuantGroup(int requested, int head_dim);

// One row of a sweep.
struct SweepEntry {
  // "eviction" (token eviction only), "think" (eviction + channel pruning), "quant" (bits only),
  // "combined" (anything else, e.g. eviction + bits).
  std::string family;
  std::string label;   // the canonical spec string (kvc::SpecString), e.g. "snapkv:0.5"
  std::string policy;  // eviction policy name
  double keep_ratio = 1.0;
  // Plot series: rows that differ only in the eviction keep ratio share it, e.g. "snapkv" or
  // "snapkv:*+think:0.25"; rows without eviction are their own series.
  std::string series;
  CompressionSpec spec;
};

// A row for `spec`, labelled with its canonical spec string.
SweepEntry EntryForSpec(const CompressionSpec& spec);

// The default sweep: keep ratios {1.0, 0.75, 0.5, 0.25} for every eviction policy but none;
// ThinK key-channel pruning at lambda 0.25 and 0.5 on top of snapkv keeping 0.5; 4- and 2-bit
// quantization of all tokens (no eviction) with group size `quant_group`. To add a row to every
// default run, append it to the list in sweep.cc.
std::vector<SweepEntry> DefaultSweep(int quant_group);

// Rows from a list of spec strings separated by ';' (spec strings themselves contain ',' and
// '+'); empty items are skipped. Quantization terms without a group ("q4") get `quant_group`.
// INVALID_ARGUMENT naming the item when one does not parse, or when the list has none.
absl::StatusOr<std::vector<SweepEntry>> ParseSpecList(absl::string_view list, int quant_group);

// The rows of `sweep` whose label starts with one of the comma-separated prefixes of `only`, or
// whose family equals one of them. NOT_FOUND listing the labels when none matches.
absl::StatusOr<std::vector<SweepEntry>> FilterOnly(std::vector<SweepEntry> sweep,
                                                   absl::string_view only);

// The spec evaluated for seed index `r` (0-based): the policies' noise seed advanced by r, so
// every seed draws different keyformer/random noise while seed 0 is the spec as given.
CompressionSpec ForSeed(const CompressionSpec& spec, int r);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_SWEEP_H_

// Spec strings: a whole compression config on one line, for tools, labels and tests. A spec string
// parses to the wire's CompressionConfig, which the one mapping (kvc/protocol/convert.h) turns
// into the engine's CompressionSpec. Terms are joined by '+', in any order, each kind at most once:
//   POLICY:KEEP[,key=value...]   eviction keeping a ratio KEEP in (0, 1] of the tokens
//   POLICY@BUDGET[,key=value...] eviction keeping BUDGET >= 1 tokens per KV head
//   think:L | l1:L | l2:L        key channel pruning, L = fraction pruned in [0, 1)
//   vthink:L                     value channel pruning (prune_values, value_lambda = L)
//   qB[vV][gG]                   quantization to B in {2, 4, 8} bits, group size G; with vV the
//                                values take V in {2, 4, 8} bits (keys B), e.g. q8v4g64
//   r=N                          recent_tokens
//   full | none                  keep everything (alone)
// POLICY is a name of the policy table (kvc/policy.h). The eviction options are the
// EvictionConfig fields annotated with (kvcache.v1.spec) in proto/kvcache/v1/kvcache.proto, read
// from the proto's descriptors: the annotation gives the key, the values accepted and the
// options' order in the canonical string. Today: sink=N (sink_tokens), recent=F
// (recent_fraction), kernel=N (pool_kernel, odd), pool=max|avg, tau=F, seed=N, layer=0|1 (per-layer
// granularity), lb=B0/B1/... (layer_budgets), ada=ALPHA (head-adaptive budgets with
// adaptive_floor ALPHA in [0, 1]), value=auto|off|mul|add, veps=EPS, horizon=N, stats=0|1,
// xlayer=0|1, passes=R0/R1/... (kvzip's reconstruction passes: rows per pass) and chunk=C
// (context tokens per pass).
// e.g. "keyformer:0.5+think:0.5+q4", "snapkv:0.25,kernel=7,pool=avg", "q2g16", "q8v4".
//
// Thread-safety: pure functions.
#ifndef KVC_PROTOCOL_SPEC_STRING_H_
#define KVC_PROTOCOL_SPEC_STRING_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kvc/spec.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc {

// INVALID_ARGUMENT quoting the string and the bad term, e.g. `spec "h2o:2": term "h2o:2": keep
// 2 is outside (0, 1]`. Only the string is checked here; ValidateSpec (or kvcd) checks the result
// against a layer shape.
absl::StatusOr<kvcache::v1::CompressionConfig> ParseSpecConfig(std::string_view text);

// ParseSpecConfig, then SpecFromProto.
absl::StatusOr<CompressionSpec> ParseSpecString(std::string_view text);

// The canonical spec string (options at their defaults omitted); ParseSpecString of it gives the
// spec back for every spec ValidateSpec accepts.
std::string SpecString(const CompressionSpec& spec);

}  // namespace kvc

#endif  // KVC_PROTOCOL_SPEC_STRING_H_

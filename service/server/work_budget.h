// An upload's work budget (kvcd's --work_* flags): the cost of its spec as kvcd runs the engine
// (kvc/cost.h), and the check of that cost against a budget in proportion to its bytes.
//
// Thread-safety: pure functions.
#ifndef KVC_SERVICE_SERVER_WORK_BUDGET_H_
#define KVC_SERVICE_SERVER_WORK_BUDGET_H_

#include <cstdint>

#include "absl/status/status.h"
#include "kvc/cost.h"

namespace kvc::server {

struct WorkBudget {
  double flops_per_byte = 8192;
  double base_flops = 1e9;
  double scratch_per_byte = 4;
  uint64_t base_scratch_bytes = 64ull << 20;
};

// How kvcd runs one upload on `engine_threads` threads: ceil(threads / Hkv) of its layers at
// once (at most num_layers), each layer job working on its own KV heads with the backend's other
// threads helping.
CostConcurrency UploadConcurrency(int engine_threads, int num_kv_heads, int num_layers,
                                  bool whole_layer_statistics);

// RESOURCE_EXHAUSTED when `cost` is over the budget for `bytes` uploaded bytes, naming the flags,
// the budget and the largest term, e.g. "header.compression: the spec needs 9.56e+10 flops to
// compress, over this upload's budget of 1.39e+10 (--work_flops_per_byte=8192 x 1572864 bytes +
// --work_base_flops=1e+09); the largest term is expected scores (...) = 9.4e+10".
absl::Status CheckWorkBudget(const WorkCost& cost, uint64_t bytes, const WorkBudget& budget);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_WORK_BUDGET_H_

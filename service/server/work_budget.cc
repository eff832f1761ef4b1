#include "server/work_budget.h"

#include <algorithm>

#include "absl/strings/str_format.h"

namespace kvc::server {

CostConcurrency UploadConcurrency(int engine_threads, int num_kv_heads, int num_layers,
                                  bool whole_layer_statistics) {
  const int threads = std::max(1, engine_threads);
  const int heads = std::max(1, num_kv_heads);
  CostConcurrency cc;
  cc.concurrent_layers = std::clamp((threads + heads - 1) / heads, 1, std::max(1, num_layers));
  cc.parallel_tasks = threads - 1 + cc.concurrent_layers;
  cc.whole_layer_statistics = whole_layer_statistics;
  return cc;
}

absl::Status CheckWorkBudget(const WorkCost& cost, uint64_t bytes, const WorkBudget& budget) {
  const double flops_budget =
      budget.flops_per_byte * static_cast<double>(bytes) + budget.base_flops;
  if (static_cast<double>(cost.flops) > flops_budget) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "header.compression: the spec needs %.3g flops to compress, over this upload's budget of "
        "%.3g (--work_flops_per_byte=%g x %d bytes + --work_base_flops=%g); the largest term is "
        "%s = %.3g",
        static_cast<double>(cost.flops), flops_budget, budget.flops_per_byte, bytes,
        budget.base_flops, cost.flops_term, static_cast<double>(cost.flops_term_value)));
  }
  const double scratch_budget = budget.scratch_per_byte * static_cast<double>(bytes) +
                                static_cast<double>(budget.base_scratch_bytes);
  if (static_cast<double>(cost.scratch_bytes) > scratch_budget) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "header.compression: the spec needs %.3g bytes of scratch memory to compress, over this "
        "upload's budget of %.3g (--work_scratch_per_byte=%g x %d bytes + "
        "--work_base_scratch_bytes=%d); the largest term is %s = %.3g",
        static_cast<double>(cost.scratch_bytes), scratch_budget, budget.scratch_per_byte, bytes,
        budget.base_scratch_bytes, cost.scratch_term,
        static_cast<double>(cost.scratch_term_value)));
  }
  return absl::OkStatus();
}

}  // namespace kvc::server

// Internals of the CPU decode attention, for the engine bench and tests: the dense-cache kernel
// the packed kernel is measured against. (The instruction set is capped through kvc/cpu_isa.h.)
#ifndef KVC_KERNELS_CPU_ATTENTION_INTERNAL_H_
#define KVC_KERNELS_CPU_ATTENTION_INTERNAL_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvc/attention.h"
#include "kvc/dtype.h"
#include "kvc/thread_pool.h"

namespace kvc::cpu {

// A full (uncompressed) cache: K and V in HND [num_kv_heads, seq_len, head_dim], `dtype`.
struct DenseKv {
  DType dtype = DType::kF16;
  int num_kv_heads = 0, seq_len = 0, head_dim = 0;
  const void* k = nullptr;
  const void* v = nullptr;
};

// Decode attention over dense caches, one (cache, query, out) per sequence, with the same
// kernels, scheduling and semantics as PackedAttentionBatchCpu (a compact layer that keeps every
// token and channel unquantized gives the same result). No validation beyond the query checks.
absl::Status DenseAttentionBatch(absl::Span<const DenseKv> caches,
                                 absl::Span<const DecodeQuery> queries,
                                 absl::Span<float* const> outs, ThreadPool* pool);

}  // namespace kvc::cpu

#endif  // KVC_KERNELS_CPU_ATTENTION_INTERNAL_H_

// The compact writer's internal entry point (internal to kernels/): PackLayer with the head
// sections written in parallel on a ThreadPool and the quantize share of the work measured.
#ifndef KVC_CPU_PACK_H_
#define KVC_CPU_PACK_H_

#include "absl/status/statusor.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/selection.h"
#include "kvc/spec.h"

namespace kvc {
class ThreadPool;  // kvc/thread_pool.h
}  // namespace kvc

namespace kvc::cpu {

// Time the tasks of one PackLayerImpl call ran, each measured with the steady clock around the
// task on its thread and summed over tasks (so with several threads it can exceed the wall time).
struct PackWork {
  double task_seconds = 0;      // everything the tasks did (gather, conversion, quantization)
  double quantize_seconds = 0;  // the part spent computing and writing scales, zeros and codes
};

// Same contract, validation and output bytes as kvc::PackLayer (which calls this with a null
// pool). The blob is split into one task per (head, K or V) part of a head section; each task
// writes only its own byte range, so the result does not depend on the pool or its thread count.
// pool == nullptr runs every task on the calling thread, in order. `work` may be null.
// Thread-safe for concurrent calls (the pool is; each call owns its blob).
absl::StatusOr<CompactLayer> PackLayerImpl(const LayerInput& in, const TokenSelection& tokens,
                                           const ChannelSelection& channels,
                                           const CompressionSpec& spec, ThreadPool* pool,
                                           PackWork* work);

}  // namespace kvc::cpu

#endif  // KVC_CPU_PACK_H_

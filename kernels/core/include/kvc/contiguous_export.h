// Engine-ready export: a DENSE layer whose keys are re-rotated so that a stock decode engine
// (vLLM, SGLang: a request's cache in slots 0..n-1, positions derived from the count) can use it.
//
// Keys are stored post-RoPE. When every KV head keeps the same K of the S prompt tokens, turning
// each kept key back by (S - K) positions puts kept token j in slot j of a plain cache and lets
// decoding continue at position K: query position K + t against a key that was at p (now at
// p - (S - K)) has the same distance (S + t) - p as in the original sequence, so every attention
// score is unchanged. Values carry no position and are not touched.
//
// Thread-safety: pure functions.
#ifndef KVC_CONTIGUOUS_EXPORT_H_
#define KVC_CONTIGUOUS_EXPORT_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvc/compact.h"
#include "kvc/rope.h"  // RopeParams, ValidateRope

namespace kvc {

// Rotates every key of `layer` (HND, [num_kv_heads, n_kept, head_dim] in layer->dtype) by
// -shift positions under `rope`, in place. Computed in double, rounded once to the dtype.
absl::Status RotateKeys(const RopeParams& rope, int shift, DenseLayer* layer);

// ExportDense(view), then RotateKeys by -(seq_len - n_kept): the layer for slots 0..n_kept-1.
// `positions` keeps the original positions. INVALID_ARGUMENT from ValidateRope; the errors of
// ExportDense come back as FAILED_PRECONDITION, and so does a layer whose heads keep different
// counts (head-adaptive budgets), naming the layer and head.
absl::StatusOr<DenseLayer> ExportDenseContiguous(const CompactLayerView& view,
                                                 const RopeParams& rope);

// ExportDenseContiguous(view, rope)'s keys alone (v and positions empty), for a layer whose
// values go out as DenseValueRunsOf's runs; the same errors.
absl::StatusOr<DenseLayer> ExportDenseKeysContiguous(const CompactLayerView& view,
                                                     const RopeParams& rope);

// The keys of ExportDenseContiguous(view, rope) for a layer DenseRunsOf accepts (`runs` its
// runs), turned straight from the blob into `k` of the result ([num_kv_heads, n_kept,
// head_dim]); v and positions stay empty: they are the blob's own runs, which the contiguous
// export leaves as they are. INVALID_ARGUMENT from ValidateRope; INTERNAL when `runs` are not
// the view's.
absl::StatusOr<DenseLayer> ExportKeysContiguous(const CompactLayerView& view,
                                                const DenseRuns& runs, const RopeParams& rope);

// The same exports written piece by piece (kvc/compact.h DenseExporter): the exporter of
// ExportDenseContiguous (keys_only false) or ExportDenseKeysContiguous, each head's keys turned
// as its piece is written, and of ExportKeysContiguous. Their errors, checked before anything is
// allocated, and RESOURCE_EXHAUSTED when the layer's memory cannot be allocated.
absl::StatusOr<DenseExporter> MakeContiguousExporter(const CompactLayerView& view,
                                                     const RopeParams& rope, bool keys_only);
absl::StatusOr<DenseExporter> MakeKeysContiguousExporter(const CompactLayerView& view,
                                                         const DenseRuns& runs,
                                                         const RopeParams& rope);

}  // namespace kvc

#endif  // KVC_CONTIGUOUS_EXPORT_H_

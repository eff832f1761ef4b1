// Host-side plan of one Compress call on the CUDA backend: the data-independent parts (budget,
// protected ranges, channel counts, blob layout) computed before any kernel runs, so the blob
// layout never waits for device results.
#ifndef KVC_KERNELS_CUDA_COMPRESS_PLAN_H_
#define KVC_KERNELS_CUDA_COMPRESS_PLAN_H_

#include <cstddef>
#include <vector>

#include "cuda/kernels.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc::cuda {

struct CompressPlan {
  int budget = 0;                       // kept tokens per KV head
  int sink_end = 0;                     // positions [0, sink_end) are protected
  int recent_begin = 0;                 // positions [recent_begin, S) are protected
  int n_recent = 0;                     // r, the most recent kept tokens stored unpruned
  int key_channels = 0, value_channels = 0;
  std::vector<HeadOffsets> offsets;  // [Hkv]
  std::vector<HeadDesc> descs;       // [Hkv]
  size_t blob_bytes = 0;
};

// Spec and input must already be valid (ValidateInput, ValidateSpec).
CompressPlan MakeCompressPlan(const LayerInput& in, const CompressionSpec& spec);

// Fills the header of a blob built from `in` and `spec`.
LayerHeader MakeLayerHeader(const LayerInput& in, const CompressionSpec& spec);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_COMPRESS_PLAN_H_

// GetCache FORMAT_DENSE_CONTIGUOUS: the request's RopeSpec checked and mapped onto the engine's
// RopeParams, and the cache checked for one kept-token count across its layers.
#ifndef KVC_SERVICE_SERVER_CONTIGUOUS_H_
#define KVC_SERVICE_SERVER_CONTIGUOUS_H_

#include "absl/status/statusor.h"
#include "kvc/contiguous_export.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc::server {

// INVALID_ARGUMENT names a missing or bad field ("rope.style: ..."); FAILED_PRECONDITION for a
// RoPE whose keys cannot be shifted exactly (DYNAMIC_NTK), saying why.
absl::StatusOr<RopeParams> RopeFromProto(const kvcache::v1::RopeSpec& rope, int head_dim);

// FAILED_PRECONDITION for a cache stored with head-adaptive budgets (its heads keep different
// counts), else naming the first layer whose kept-token count differs from layer 0's.
absl::Status CheckUniformKept(const kvcache::v1::CacheInfo& info);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_CONTIGUOUS_H_

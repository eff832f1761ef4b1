// GetCache FORMAT_DENSE_CONTIGUOUS: the cache checked for one kept-token count across its layers
// (the request's RoPE is mapped by RopeFromProto, kvc/protocol/convert.h).
#ifndef KVC_SERVICE_SERVER_CONTIGUOUS_H_
#define KVC_SERVICE_SERVER_CONTIGUOUS_H_

#include "absl/status/status.h"
#include "kvc/contiguous_export.h"
#include "kvc/protocol/convert.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc::server {

// FAILED_PRECONDITION for a cache stored with head-adaptive budgets (its heads keep different
// counts), else naming the first layer whose kept-token count differs from layer 0's.
absl::Status CheckUniformKept(const kvcache::v1::CacheInfo& info);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_CONTIGUOUS_H_

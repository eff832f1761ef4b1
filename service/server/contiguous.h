// GetCache FORMAT_DENSE_CONTIGUOUS: the check that a cache keeps one token count for every head
// and layer (the request's RoPE is mapped by RopeFromProto, kvc/protocol/convert.h).
#ifndef KVC_SERVICE_SERVER_CONTIGUOUS_H_
#define KVC_SERVICE_SERVER_CONTIGUOUS_H_

#include "absl/status/status.h"
#include "kvc/cache_store.h"
#include "kvc/contiguous_export.h"
#include "kvc/protocol/convert.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc::server {

// FAILED_PRECONDITION naming the first layer whose kept-token count differs from layer 0's, or,
// for a cache stored with head-adaptive budgets, the first head that keeps a different count
// than head 0 of its layer (read from the stored blobs: adaptive_floor = 1 keeps one count).
absl::Status CheckUniformKept(const kvcache::v1::CacheInfo& info, const CacheEntry& entry);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_CONTIGUOUS_H_

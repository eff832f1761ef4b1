// RopeSpec (proto) -> RopeParams (engine), for the two places a RoPE arrives: a PutCache header
// (expected attention rotates its query statistics with it) and a GetCache FORMAT_DENSE_CONTIGUOUS
// request (keys are re-rotated with it). Also the check that a cache keeps one token count for
// every head and layer, which FORMAT_DENSE_CONTIGUOUS needs.
#ifndef KVC_SERVICE_SERVER_CONTIGUOUS_H_
#define KVC_SERVICE_SERVER_CONTIGUOUS_H_

#include "absl/status/statusor.h"
#include "kvc/cache_store.h"
#include "kvc/contiguous_export.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc::server {

// What the RoPE is for; the messages say what it is needed for.
enum class RopeUse {
  kPutHeader,   // PutCacheHeader.rope: expected attention's query statistics
  kContiguous,  // GetCacheRequest.rope: FORMAT_DENSE_CONTIGUOUS
};

// INVALID_ARGUMENT names a missing or bad field ("rope.style: ..."); values are quoted as sent
// (no narrowing: a rotary_dims of 4294967294 is quoted as that). DYNAMIC_NTK (frequencies that
// depend on the sequence length) cannot be rotated exactly to other positions:
// FAILED_PRECONDITION for kContiguous (fetch FORMAT_DENSE instead), INVALID_ARGUMENT for
// kPutHeader (send NONE or LINEAR scaling).
absl::StatusOr<RopeParams> RopeFromProto(const kvcache::v1::RopeSpec& rope, int head_dim,
                                         RopeUse use);

// FAILED_PRECONDITION naming the first layer whose kept-token count differs from layer 0's, or,
// for a cache stored with head-adaptive budgets, the first head that keeps a different count
// than head 0 of its layer (read from the stored blobs: adaptive_floor = 1 keeps one count).
absl::Status CheckUniformKept(const kvcache::v1::CacheInfo& info, const CacheEntry& entry);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_CONTIGUOUS_H_

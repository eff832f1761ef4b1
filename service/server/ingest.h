// One PutCache upload in progress: header validation, placement of chunks into per-layer staging
// buffers with exact byte coverage, compression of each layer on the worker pool as soon as its
// tensors are complete, and the final insertion into the store.
//
// Use: OnHeader once, OnChunk for each chunk, then either Finish (stream closed cleanly) or Abort
// (cancelled, or a read failed). Nothing reaches the store unless Finish succeeds.
//
// Thread-safety: OnHeader/OnChunk/Finish/Abort must be called by one thread at a time (the
// stream's reactor serializes them); compression jobs run concurrently on the pool and touch
// only state guarded by the internal mutex. Hold the Upload by shared_ptr: jobs keep it alive.
#ifndef KVC_SERVICE_SERVER_INGEST_H_
#define KVC_SERVICE_SERVER_INGEST_H_

#include <xxhash.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/staging_pool.h"
#include "server/thread_pool.h"
#include "server/wire.h"

namespace kvc::server {

struct IngestLimits {
  uint64_t max_chunk_bytes = 4ull << 20;
  uint64_t max_cache_bytes = 1ull << 30;  // K + V + Q_obs bytes of one upload
  uint32_t default_ttl_seconds = 0;
};

// Why an upload was refused; the label of kvc_rejected_requests_total.
enum class RejectReason { kNone, kInvalid, kTooLarge, kNoSpace, kExists, kIncomplete, kCompress };
const char* RejectReasonName(RejectReason r);

class Upload : public std::enable_shared_from_this<Upload> {
 public:
  // `backend`, `store`, `pool` and `staging` must outlive every job of this upload (the server
  // joins the pool before destroying them). Staging buffers come from `staging` (non-null).
  Upload(Backend* backend, CacheStore* store, ThreadPool* pool, const IngestLimits& limits,
         StagingPool* staging);

  // Validates the header; on success the upload accepts chunks. Errors: INVALID_ARGUMENT (shape,
  // dtype, layout, spec, id), RESOURCE_EXHAUSTED (over max_cache_bytes or cannot fit the store),
  // ALREADY_EXISTS (id taken and !overwrite). `store_id` is the key in the store (the caller may
  // namespace it); the response and CacheInfo carry header.cache_id.
  absl::Status OnHeader(const kvcache::v1::PutCacheHeader& header, const std::string& store_id);

  // Copies the chunk's payload into place. INVALID_ARGUMENT (unknown layer or tensor, out of
  // range, overlap) or RESOURCE_EXHAUSTED (payload over max_chunk_bytes). Schedules compression
  // of the layer when it becomes complete. Also returns a compression error as soon as one layer
  // failed.
  absl::Status OnChunk(const RawPutRequest& chunk);

  // The stream closed: once every scheduled compression finishes, checks completeness, builds
  // the entry and inserts it. `done` runs exactly once, on this or a pool thread.
  using DoneCallback = std::function<void(absl::StatusOr<kvcache::v1::PutCacheResponse>)>;
  void Finish(DoneCallback done);

  // Drops everything; pending jobs discard their results. Safe to call more than once.
  void Abort();

  bool has_header() const { return has_header_; }
  RejectReason reject_reason() const;
  uint64_t payload_bytes() const { return payload_bytes_; }  // data bytes accepted so far
  const std::string& backend_name() const { return backend_name_; }

 private:
  // Received bytes of one tensor as disjoint [begin, end) intervals, merged when adjacent.
  struct Coverage {
    std::map<uint64_t, uint64_t> intervals;
    uint64_t received = 0;
    // Adds [begin, end); false when it overlaps bytes already received.
    bool Add(uint64_t begin, uint64_t end);
  };
  struct LayerState {
    StagingPool::Buffer tensor[3];  // K, V, Q_obs staging (acquired on first chunk)
    Coverage coverage[3];
    bool scheduled = false;
  };

  absl::Status Reject(RejectReason reason, absl::Status status);
  bool LayerComplete(const LayerState& layer) const;
  void CompressLayer(int layer);  // on a pool thread
  // Feeds the checksum with every compressed layer that directly follows the hashed prefix, so
  // the checksum is ready when the last layer is; hashes with mu_ released.
  void AdvanceChecksum() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeFinalize() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<kvcache::v1::PutCacheResponse> Finalize() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string IncompleteMessage() const;

  Backend* const backend_;
  CacheStore* const store_;
  ThreadPool* const pool_;
  StagingPool* const staging_;
  const IngestLimits limits_;
  const std::string backend_name_;

  // Reactor-thread state.
  bool has_header_ = false;
  kvcache::v1::PutCacheHeader header_;
  std::string store_id_;
  LayerShape shape_;
  DType dtype_ = DType::kF16;
  Layout layout_ = Layout::kHND;
  CompressionSpec spec_;
  uint64_t tensor_bytes_[3] = {0, 0, 0};
  std::vector<LayerState> layers_;
  uint64_t payload_bytes_ = 0;
  absl::Time start_;

  mutable absl::Mutex mu_;
  RejectReason reason_ ABSL_GUARDED_BY(mu_) = RejectReason::kNone;
  std::vector<CompactLayer> compact_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> compressed_ ABSL_GUARDED_BY(mu_);
  CompressTimings timings_ ABSL_GUARDED_BY(mu_);
  absl::Status compress_error_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  DoneCallback done_ ABSL_GUARDED_BY(mu_);
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  // XXH3-64 streaming state over compact_[0, hashed_) (CacheEntry::checksum's definition). One
  // thread at a time (hashing_) reads compact_ unlocked; Abort leaves compact_ to it meanwhile.
  std::unique_ptr<XXH3_state_t, XXH_errorcode (*)(XXH3_state_t*)> hash_{nullptr, nullptr};
  size_t hashed_ ABSL_GUARDED_BY(mu_) = 0;
  bool hashing_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_INGEST_H_

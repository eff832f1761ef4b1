// One PutCache upload in progress: header validation, placement of chunks into per-layer staging
// buffers with exact byte coverage, compression of each layer on the worker pool as soon as its
// tensors are complete, and the final insertion into the store. When the backend can
// (Backend::CanScoreKeys) and the policy has scores, a layer whose K and queries (Q_obs, Q_stats)
// are complete is scored while its V is still arriving, so that only the value weighting,
// selection and packing remain when V's last chunk lands (clients send the queries first, then K,
// then V; another order works too, scoring then waits for the whole layer as before). An upload that asks for no
// compression at all (InPlaceLayer::KeepsEverything) skips staging: its K and V chunks are copied
// straight into the layer's compact blob (and hashed there while in cache) and Q_obs is only
// accounted for, so each payload byte is copied once.
//
// Use: OnHeader once, OnChunk for each chunk, then either Finish (stream closed cleanly) or Abort
// (cancelled, or a read failed). Nothing reaches the store unless Finish succeeds.
//
// Thread-safety: OnHeader/OnChunk/Finish/Abort must be called by one thread at a time (the
// stream's reactor serializes them); compression jobs run concurrently on the pool and touch
// only state guarded by the internal mutex. Hold the Upload by shared_ptr: jobs keep it alive.
#ifndef KVC_SERVICE_SERVER_INGEST_H_
#define KVC_SERVICE_SERVER_INGEST_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvc/backend.h"
#include "kvc/buffer_pool.h"
#include "kvc/cache_store.h"
#include "kvc/cancel.h"
#include "kvc/compact.h"
#include "kvc/cost.h"
#include "kvc/thread_pool.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/stream_guard.h"
#include "server/wire.h"

namespace kvc::server {

struct IngestLimits {
  uint64_t max_chunk_bytes = 4ull << 20;
  uint64_t max_cache_bytes = 1ull << 30;  // K + V + Q_obs bytes of one upload
  uint32_t default_ttl_seconds = 0;
  // The work one upload may ask for (kvc/cost.h), in proportion to its bytes: at most
  // work_flops_per_byte * upload bytes + work_base_flops flops, and at most
  // work_scratch_per_byte * upload bytes + work_base_scratch_bytes of engine scratch. A spec that
  // needs more is refused at the header (RESOURCE_EXHAUSTED naming the term and the limit).
  double work_flops_per_byte = 8192;
  double work_base_flops = 1e9;
  double work_scratch_per_byte = 4;
  uint64_t work_base_scratch_bytes = 64ull << 20;
  // The engine's threads (kvcd: --threads): with the upload's number of KV heads, how many of its
  // layers compress at once and how many of its tasks may run at once (the scratch estimate).
  int engine_threads = 1;
  // The backend computes expected attention's statistics of a whole layer at once (CUDA).
  bool whole_layer_statistics = false;
  // An upload's compression stops with DEADLINE_EXCEEDED this long after its first layer started.
  absl::Duration compress_timeout = absl::Seconds(300);
};

// Why an upload was refused; the label of kvc_rejected_requests_total.
enum class RejectReason {
  kNone,
  kInvalid,
  kTooLarge,
  kNoSpace,
  kExists,
  kIncomplete,
  kCompress,
  kWork,  // the spec's work is over the upload's budget (IngestLimits::work_*)
};
const char* RejectReasonName(RejectReason r);

class Upload : public std::enable_shared_from_this<Upload> {
 public:
  // `backend`, `store`, the pools and `staging` must outlive every job of this upload (the server
  // joins the pools before destroying them, or abandons them all). Staging buffers come from
  // `staging` (non-null). Compression jobs run on `pool`, at most a few layers of one upload at a
  // time (so one upload cannot fill the pool); the cheap completion of uploads that keep
  // everything runs on `io_pool` (null: `pool`), so it never waits behind compressions.
  Upload(Backend* backend, CacheStore* store, ThreadPool* pool, const IngestLimits& limits,
         BufferPool* staging, ThreadPool* io_pool = nullptr);

  // Validates the header; on success the upload accepts chunks. Errors: INVALID_ARGUMENT (shape,
  // dtype, layout, spec, id), RESOURCE_EXHAUSTED (over max_cache_bytes, the spec's work over the
  // upload's budget, or cannot fit the store), ALREADY_EXISTS (id taken and !overwrite). `store_id`
  // is the key in the store (the caller may namespace it); the response and CacheInfo carry
  // header.cache_id.
  absl::Status OnHeader(const kvcache::v1::PutCacheHeader& header, const std::string& store_id);

  // Copies the chunk's payload into place. INVALID_ARGUMENT (unknown layer or tensor, out of
  // range, overlap) or RESOURCE_EXHAUSTED (payload over max_chunk_bytes). Schedules compression
  // of the layer when it becomes complete. Also returns a compression error as soon as one layer
  // failed: the engine's INVALID_ARGUMENT, RESOURCE_EXHAUSTED when memory ran out (an exception
  // thrown by the engine never leaves the pool thread), the cancellation's own status (e.g.
  // DEADLINE_EXCEEDED at the compress timeout), else INTERNAL.
  absl::Status OnChunk(const RawPutRequest& chunk);

  // The stream closed: once every scheduled compression finishes, checks completeness, builds
  // the entry and inserts it. `done` runs exactly once, on this or a pool thread (with the
  // cancellation's status when the upload was cancelled; a stream that ended itself on
  // cancellation must ignore it).
  using DoneCallback = std::function<void(absl::StatusOr<kvcache::v1::PutCacheResponse>)>;
  void Finish(DoneCallback done);

  // Drops everything; pending jobs discard their results and a running compression stops at its
  // next row block (its CancelToken is cancelled with `why`). Safe to call more than once; the
  // first reason wins. Abort() = Cancel(CANCELLED "upload cancelled").
  void Cancel(absl::Status why);
  void Abort();

  // K + V + Q_obs (+ Q_stats) bytes the accepted header declares (0 before OnHeader succeeded):
  // what the upload may stage.
  uint64_t declared_bytes() const { return declared_bytes_; }
  // What the upload reserves from the staging budget: declared_bytes() plus the engine scratch
  // its spec needs (kvc/cost.h), 0 before OnHeader succeeded.
  uint64_t reserved_bytes() const { return declared_bytes_ + cost_.scratch_bytes; }
  // The spec's estimated work (zero for an upload that keeps everything).
  const WorkCost& cost() const { return cost_; }
  // Holds `r` (the staging reserved for this upload) until the cache is in the store or the
  // upload is destroyed, so its bytes are given back once the staging is freed.
  void HoldStaging(StagingBudget::Reservation r) ABSL_LOCKS_EXCLUDED(mu_);

  // Called with +1 when a layer's compression starts in the engine and -1 when it ends (e.g. to
  // keep a gauge); set before OnHeader. Runs on pool threads.
  void set_compress_observer(std::function<void(int)> observer) {
    compress_observer_ = std::move(observer);
  }

  bool has_header() const { return has_header_; }
  // Bytes of tensor t (0 K, 1 V, 2 Q_obs, 3 Q_stats) of every layer, and the layer count, as the
  // accepted header declares them (0 before OnHeader succeeded).
  uint64_t tensor_bytes(int t) const { return tensor_bytes_[t]; }
  int num_layers() const { return static_cast<int>(layers_.size()); }
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
    BufferPool::Buffer tensor[4];          // K, V, Q_obs, Q_stats staging (acquired on first chunk)
    std::optional<InPlaceLayer> in_place;  // instead of staging when in_place_ (first K/V chunk)
    double place_seconds = 0;              // copying chunks into in_place and hashing them
    // Checksum progress of an in-place layer: written by the reactor thread as chunks land,
    // read by the completion job, which is scheduled after the last chunk (the pool's queue
    // orders the two).
    struct Hashing {
      std::vector<uint64_t> blocks;  // block hashes (CacheEntry::block_checksums' row)
      std::vector<uint8_t> done;     // 1 once blocks[i] is set
    };
    std::unique_ptr<Hashing> hashing;
    Coverage coverage[4];
    bool scheduled = false;    // complete, its compression queued or started
    bool keys_queued = false;  // K and the queries complete, queued for early scoring
  };
  // Where a layer is, for the jobs (guarded by mu_). Each job holds one of max_running_ slots; a
  // layer scored early keeps its slot (and its scores) until its compression ends.
  enum class Stage : uint8_t {
    kReceiving,    // no job yet
    kKeysQueued,   // in score_ready_
    kScoring,      // ScoreLayer running
    kScored,       // scores held, waiting for the rest of the layer
    kQueued,       // complete, in ready_
    kCompressing,  // CompressLayer queued or running
    kHeld,         // layer-adaptive: scored whole, waiting for the other layers (no slot, not
                   // pending); all of them go back to kQueued with their head counts at once
  };

  absl::Status Reject(RejectReason reason, absl::Status status);
  bool LayerComplete(const LayerState& layer) const;
  bool KeysComplete(const LayerState& layer) const;  // K, Q_obs and Q_stats
  // The layer's staging as engine input; V only with `values` (its staging is the receiving
  // thread's while keys are scored early).
  LayerInput InputOf(int index, bool values = true) const;
  // Schedules ready layers while fewer than max_running_ of this upload are compressing.
  void StartReady() ABSL_LOCKS_EXCLUDED(mu_);
  // Runs job() on `pool` for this upload (kept alive meanwhile). An exception escaping the job
  // (an allocation it could not make outside the engine) fails the upload at once (Broken): the
  // job's bookkeeping may be half done, so nothing waits for it.
  template <typename Job>
  void ScheduleJob(ThreadPool* pool, Job job);
  // Fails the upload with `why` without waiting for its jobs: they stop at their next check and
  // drop their results, and a finishing upload answers now.
  void Broken(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);
  // OnHeader/OnChunk with an exception (a failed allocation) made a status: the upload's state
  // may be half updated, so it is cancelled (no later chunk reaches it).
  absl::Status FailedAt(const char* where) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status AcceptHeader(const kvcache::v1::PutCacheHeader& header,
                            const std::string& store_id);
  absl::Status PlaceChunk(const RawPutRequest& chunk);
  void CompressLayer(int layer);  // on a pool thread
  void ScoreLayer(int layer);     // on a pool thread: Backend::ScoreKeys before V is complete
  // Layer-adaptive budgets (on a pool thread, in CompressLayer's slot): scores the complete
  // layer and holds the scores and the staging; the last layer scored allocates the budget
  // over all of them (AllocateHeldLayers) and queues every layer for compression.
  void HoldLayerScores(int layer, const LayerInput& in);
  void AllocateHeldLayers(std::vector<std::optional<KeyScores>> all) ABSL_LOCKS_EXCLUDED(mu_);
  // Frees the staging and scores of every kHeld layer (after an error or a cancellation).
  void DropHeldLayers() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Hashes the blocks of an in-place layer that no single chunk covered and records its
  // finished blob (on a pool thread).
  void CompleteInPlaceLayer(int layer);
  // Records layer `index`'s result and its share of the checksum, then finalizes if it was the
  // last job.
  void LayerDone(int index, absl::StatusOr<CompactLayer> out, std::vector<uint64_t> blocks,
                 const CompressTimings& t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void MaybeFinalize() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The compress timeout counts from the first job of the upload (score or compress).
  void ArmCompressTimeout() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Records a job's failure as the upload's error (the first one wins), prefixed with the layer
  // (index -1: the layer-adaptive allocation).
  void RecordError(int index, const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // INVALID_ARGUMENT naming the first non-finite entry of in.q_stats (when sent).
  absl::Status QueryStatsFinite(const LayerInput& in) const;
  absl::StatusOr<kvcache::v1::PutCacheResponse> Finalize() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string IncompleteMessage() const;

  Backend* const backend_;
  CacheStore* const store_;
  ThreadPool* const pool_;
  ThreadPool* const io_pool_;
  BufferPool* const staging_;
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
  uint64_t tensor_bytes_[4] = {0, 0, 0, 0};  // 0 for Q_obs / Q_stats when not sent
  std::optional<RopeParams> rope_;           // header.rope, when set
  bool in_place_ = false;  // no compression asked: chunks go straight into the blobs
  bool early_scoring_ = false;  // score layers from K and the queries before V is complete
  bool layer_adaptive_ = false;  // EvictionSpec::layer_adaptive: score all layers, then select
  std::vector<LayerState> layers_;
  uint64_t payload_bytes_ = 0;
  uint64_t declared_bytes_ = 0;
  WorkCost cost_;
  std::function<void(int)> compress_observer_;
  absl::Time start_;
  // Read by the engine between blocks; cancelled by Cancel/Abort, or at the compress timeout.
  const std::shared_ptr<CancelToken> cancel_ = std::make_shared<CancelToken>();

  mutable absl::Mutex mu_;
  RejectReason reason_ ABSL_GUARDED_BY(mu_) = RejectReason::kNone;
  std::vector<CompactLayer> compact_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> compressed_ ABSL_GUARDED_BY(mu_);
  CompressTimings timings_ ABSL_GUARDED_BY(mu_);
  absl::Status compress_error_ ABSL_GUARDED_BY(mu_);
  int pending_ ABSL_GUARDED_BY(mu_) = 0;
  // Set by Broken: a job threw, so pending_ may never reach 0; the upload finalizes without it.
  bool broken_ ABSL_GUARDED_BY(mu_) = false;
  // Complete layers waiting for a compression job, the jobs running, and how many may run.
  std::deque<int> ready_ ABSL_GUARDED_BY(mu_);
  // Layers whose K and queries are complete, waiting for a slot to be scored early.
  std::deque<int> score_ready_ ABSL_GUARDED_BY(mu_);
  std::vector<Stage> stage_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> complete_ ABSL_GUARDED_BY(mu_);  // every byte of the layer received
  std::vector<std::optional<KeyScores>> early_scores_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  int held_layers_ ABSL_GUARDED_BY(mu_) = 0;  // layer-adaptive: layers in Stage::kHeld so far
  int max_running_ ABSL_GUARDED_BY(mu_) = 1;
  bool timeout_armed_ ABSL_GUARDED_BY(mu_) = false;
  bool aborted_ ABSL_GUARDED_BY(mu_) = false;
  DoneCallback done_ ABSL_GUARDED_BY(mu_);
  bool finishing_ ABSL_GUARDED_BY(mu_) = false;
  // Block hashes of the finished layers and their sum (CacheEntry::block_checksums and checksum,
  // kvc/cache_store.h): each job hashes its own layer, so layers never wait for each other.
  std::vector<std::vector<uint64_t>> block_checksums_ ABSL_GUARDED_BY(mu_);
  uint64_t checksum_ ABSL_GUARDED_BY(mu_) = 0;
  StagingBudget::Reservation staging_reservation_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_INGEST_H_

#include "server/ingest.h"

#include "kvc/layer_budget.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kvc/compact.h"
#include "kvc/status_macros.h"
#include "kvc/thread_pool.h"
#include "kvc/xxh3.h"
#include "server/convert.h"
#include "server/work_budget.h"

namespace kvc::server {
namespace {

constexpr const char* kTensorNames[4] = {"K", "V", "Q_obs", "Q_stats"};
constexpr int kNumTensors = 4;

}  // namespace

const char* RejectReasonName(RejectReason r) {
  switch (r) {
    case RejectReason::kNone:
      return "none";
    case RejectReason::kInvalid:
      return "invalid_argument";
    case RejectReason::kTooLarge:
      return "too_large";
    case RejectReason::kNoSpace:
      return "no_space";
    case RejectReason::kExists:
      return "already_exists";
    case RejectReason::kIncomplete:
      return "incomplete";
    case RejectReason::kCompress:
      return "compress_failed";
    case RejectReason::kWork:
      return "work";
  }
  return "unknown";
}

bool Upload::Coverage::Add(uint64_t begin, uint64_t end) {
  if (begin == end) return true;
  auto next = intervals.lower_bound(begin);
  if (next != intervals.end() && next->first < end) return false;
  if (next != intervals.begin()) {
    auto prev = std::prev(next);
    if (prev->second > begin) return false;
    if (prev->second == begin) {  // extend the previous interval
      begin = prev->first;
      intervals.erase(prev);
    }
  }
  if (next != intervals.end() && next->first == end) {
    end = next->second;
    intervals.erase(next);
  }
  intervals[begin] = end;
  return true;
}

Upload::Upload(Backend* backend, CacheStore* store, ThreadPool* pool, const IngestLimits& limits,
               BufferPool* staging, ThreadPool* io_pool)
    : backend_(backend),
      store_(store),
      pool_(pool),
      io_pool_(io_pool != nullptr ? io_pool : pool),
      staging_(staging),
      limits_(limits),
      backend_name_(backend->name()),
      start_(absl::Now()) {}

RejectReason Upload::reject_reason() const {
  absl::MutexLock lock(&mu_);
  return reason_;
}

absl::Status Upload::Reject(RejectReason reason, absl::Status status) {
  absl::MutexLock lock(&mu_);
  if (reason_ == RejectReason::kNone) reason_ = reason;
  return status;
}

absl::Status Upload::OnHeader(const kvcache::v1::PutCacheHeader& h, const std::string& store_id) {
  try {
    return AcceptHeader(h, store_id);
  } catch (...) {
    return FailedAt("header");
  }
}

absl::Status Upload::OnChunk(const RawPutRequest& req) {
  try {
    return PlaceChunk(req);
  } catch (...) {
    return FailedAt("chunk");
  }
}

absl::Status Upload::FailedAt(const char* where) {
  const absl::Status thrown = StatusFromException(std::current_exception());
  absl::Status why(thrown.code(), absl::StrCat(where, ": ", thrown.message()));
  Cancel(why);  // no later chunk gets past OnChunk's first check
  Broken(why);  // and a half-counted job is not waited for
  return why;
}

template <typename Job>
void Upload::ScheduleJob(ThreadPool* pool, Job job) {
  pool->Schedule([self = shared_from_this(), job = std::move(job)]() mutable {
    RunNoThrow(job, [&self](const absl::Status& s) { self->Broken(s); });
  });
}

void Upload::Broken(const absl::Status& why) {
  cancel_->Cancel(why);  // engine work of this upload stops at its next row block
  absl::MutexLock lock(&mu_);
  broken_ = true;
  if (!aborted_ && compress_error_.ok()) {
    compress_error_ = why;
    if (reason_ == RejectReason::kNone) reason_ = RejectReason::kCompress;
  }
  MaybeFinalize();
}

absl::Status Upload::AcceptHeader(const kvcache::v1::PutCacheHeader& h,
                                  const std::string& store_id) {
  auto invalid = [this](absl::Status s) { return Reject(RejectReason::kInvalid, std::move(s)); };
  // Every field mapped and checked by the protocol and the engine (kvc/protocol/convert.h).
  absl::StatusOr<UploadHeader> header = HeaderFromProto(h);
  if (!header.ok()) return invalid(header.status());
  const int num_layers = header->num_layers;
  const LayerShape& shape = header->shape;
  const DType dtype = header->dtype;
  const CompressionSpec& spec = header->spec;
  // Sizes from the engine (kvc/layer.h, kvc/compact.h), overflow-checked there: a wrapped (small)
  // size can never pass the limits below. They name "shape..."; the field is "header.shape...".
  auto in_header = [](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("header.", s.message()));
  };
  const bool query_stats = spec.eviction.query_stats;
  const bool row_log_mass = spec.eviction.policy == EvictionPolicy::kKVzip;
  auto lb = LayerTensorBytes(shape, dtype, query_stats, row_log_mass);
  if (!lb.ok()) return invalid(in_header(lb.status()));
  auto upload_bytes = UploadBytes(shape, dtype, num_layers, query_stats, row_log_mass);
  if (!upload_bytes.ok()) return invalid(in_header(upload_bytes.status()));
  const uint64_t total = *upload_bytes;
  if (total > limits_.max_cache_bytes) {
    return Reject(RejectReason::kTooLarge,
                  absl::ResourceExhaustedError(
                      absl::StrCat("header.shape: the upload is ", total, " bytes (K + V + Q_obs",
                                   query_stats ? " + Q_stats" : "", "), over the ", "limit of ",
                                   limits_.max_cache_bytes, " bytes per cache")));
  }
  // The work the spec will cost, against a budget in proportion to the upload's bytes: a small
  // upload cannot ask for an unbounded amount of compute or memory. An upload that keeps
  // everything never reaches the engine.
  const bool in_place = InPlaceLayer::KeepsEverything(spec);
  int concurrent_layers = 1;
  if (!in_place) {
    const CostConcurrency cc = UploadConcurrency(limits_.engine_threads, shape.num_kv_heads,
                                                 num_layers, limits_.whole_layer_statistics);
    concurrent_layers = cc.concurrent_layers;
    cost_ = CompressCost(shape, dtype, spec, num_layers, cc);
    const WorkBudget budget{limits_.work_flops_per_byte, limits_.work_base_flops,
                            limits_.work_scratch_per_byte, limits_.work_base_scratch_bytes};
    if (auto s = CheckWorkBudget(cost_, total, budget); !s.ok()) {
      return Reject(RejectReason::kWork, s);
    }
  }
  if (spec.eviction.layer_adaptive && !in_place && !backend_->CanScoreKeys()) {
    return invalid(absl::InvalidArgumentError(absl::StrCat(
        "header.compression.eviction.layer_adaptive: the ", backend_name_,
        " backend cannot hold a request's scores across layers (run kvcd with the cpu backend, "
        "or drop xlayer)")));
  }
  if (!h.overwrite() && store_->Peek(store_id).ok()) {
    return Reject(RejectReason::kExists,
                  absl::AlreadyExistsError(absl::StrCat("header.cache_id: '", h.cache_id(),
                                                        "' exists (set overwrite to replace)")));
  }
  auto estimated = EstimateStoredBytes(shape, dtype, spec, num_layers);
  if (!estimated.ok()) return invalid(in_header(estimated.status()));
  const uint64_t estimate = *estimated;
  if (auto s = store_->CheckCanFit(estimate); !s.ok()) {
    return Reject(RejectReason::kNoSpace, absl::ResourceExhaustedError(absl::StrCat(
                                              "store: a compact cache of at least ", estimate,
                                              " bytes cannot fit: ", std::string(s.message()))));
  }

  header_ = h;
  store_id_ = store_id;
  shape_ = shape;
  dtype_ = dtype;
  layout_ = header->layout;
  spec_ = spec;
  tensor_bytes_[0] = lb->k;
  tensor_bytes_[1] = lb->v;
  tensor_bytes_[2] = lb->q_obs;
  tensor_bytes_[3] = lb->q_stats;
  rope_ = header->rope;
  in_place_ = in_place;
  early_scoring_ = !in_place && backend_->CanScoreKeys() && Policy(spec.eviction.policy).scores;
  // Layer-adaptive budgets: every layer is scored whole before any is selected.
  layer_adaptive_ = spec.eviction.layer_adaptive;
  if (layer_adaptive_) early_scoring_ = false;
  {
    // Under the lock with the stages: Cancel may run on another thread meanwhile (the stream's
    // OnCancel, e.g. when a tiny deadline expires while this header is read) and walks them.
    absl::MutexLock lock(&mu_);
    layers_.resize(num_layers);
    max_running_ = concurrent_layers;
    stage_.assign(num_layers, Stage::kReceiving);
    complete_.assign(num_layers, false);
    early_scores_.resize(num_layers);
    compact_.resize(num_layers);
    compressed_.assign(num_layers, false);
    block_checksums_.assign(num_layers, {});
  }
  has_header_ = true;
  declared_bytes_ = total;
  start_ = absl::Now();
  return absl::OkStatus();
}

void Upload::HoldStaging(StagingBudget::Reservation r) {
  absl::MutexLock lock(&mu_);
  staging_reservation_ = std::move(r);
}

bool Upload::LayerComplete(const LayerState& layer) const {
  for (int t = 0; t < kNumTensors; ++t) {
    if (layer.coverage[t].received != tensor_bytes_[t]) return false;
  }
  return true;
}

bool Upload::KeysComplete(const LayerState& layer) const {
  for (int t : {0, 2, 3}) {
    if (layer.coverage[t].received != tensor_bytes_[t]) return false;
  }
  return true;
}

absl::Status Upload::PlaceChunk(const RawPutRequest& req) {
  {
    absl::MutexLock lock(&mu_);
    if (aborted_) return cancel_->status();
    if (!compress_error_.ok()) return compress_error_;
  }
  const auto& c = req.chunk;
  auto invalid = [this](std::string msg) {
    return Reject(RejectReason::kInvalid, absl::InvalidArgumentError(std::move(msg)));
  };
  if (req.data_size > limits_.max_chunk_bytes) {
    return Reject(RejectReason::kTooLarge,
                  absl::ResourceExhaustedError(absl::StrCat(
                      "data: ", req.data_size, " bytes in one chunk, over --max_chunk_bytes ",
                      limits_.max_chunk_bytes)));
  }
  if (c.layer() >= layers_.size()) {
    return invalid(
        absl::StrCat("chunk.layer: ", c.layer(), " is outside [0, ", layers_.size(), ")"));
  }
  int t;
  switch (c.tensor()) {
    case kvcache::v1::TENSOR_K:
      t = 0;
      break;
    case kvcache::v1::TENSOR_V:
      t = 1;
      break;
    case kvcache::v1::TENSOR_Q_OBS:
      t = 2;
      break;
    case kvcache::v1::TENSOR_Q_STATS:
      if (!spec_.eviction.query_stats) {
        return invalid(
            "chunk.tensor: TENSOR_Q_STATS sent but header.compression.eviction."
            "query_stats is not set");
      }
      t = 3;
      break;
    default:
      return invalid(absl::StrCat("chunk.tensor: ", static_cast<int>(c.tensor()),
                                  " is not K, V, Q_OBS or Q_STATS"));
  }
  const uint64_t size = tensor_bytes_[t];
  if (c.offset() > size || req.data_size > size - c.offset()) {
    return invalid(absl::StrCat("chunk.offset: [", c.offset(), ", ", c.offset() + req.data_size,
                                ") is outside layer ", c.layer(), " tensor ", kTensorNames[t],
                                " of ", size, " bytes"));
  }
  LayerState& layer = layers_[c.layer()];
  if (req.data_size == 0) return absl::OkStatus();
  // Coverage first: a complete layer may already be compressing and its staging must not be
  // touched; any further chunk for it overlaps and is rejected here.
  if (!layer.coverage[t].Add(c.offset(), c.offset() + req.data_size)) {
    return invalid(absl::StrCat("chunk.offset: bytes [", c.offset(), ", ",
                                c.offset() + req.data_size, ") of layer ", c.layer(), " tensor ",
                                kTensorNames[t], " were already received"));
  }
  layer.coverage[t].received += req.data_size;
  if (in_place_) {
    // Stored whole: K and V bytes go straight to their place in the blob; Q_obs is not part of
    // a blob that keeps everything, so its bytes are only accounted for.
    if (t < 2) {
      if (!layer.in_place) {
        auto blob =
            InPlaceLayer::Create(shape_, dtype_, layout_, static_cast<int>(c.layer()), spec_);
        if (!blob.ok()) {
          return Reject(RejectReason::kNoSpace,
                        absl::Status(blob.status().code(),
                                     absl::StrCat("chunk: layer ", c.layer(), ": ",
                                                  std::string(blob.status().message()))));
        }
        layer.in_place.emplace(*std::move(blob));
        layer.hashing = std::make_unique<LayerState::Hashing>();
        const uint64_t blocks = NumChecksumBlocks(layer.in_place->blob_bytes());
        layer.hashing->blocks.assign(blocks, 0);
        layer.hashing->done.assign(blocks, 0);
      }
      // Each checksum block lying wholly inside the contiguous blob range this chunk writes is
      // hashed from the received bytes as they are placed, while they are still in this core's
      // cache (the blob is written around the cache: kvc/stream_copy.h). Blocks straddle the
      // received pieces, so each is hashed as a stream. Blocks cut by a chunk boundary wait for
      // the layer's completion.
      const absl::Time start = absl::Now();
      const size_t blob_size = layer.in_place->blob_bytes();
      LayerState::Hashing& hashing = *layer.hashing;
      const uint32_t index = c.layer();
      size_t run_end = SIZE_MAX;    // end of the contiguous range written so far
      bool streaming = false;       // a block is being hashed: `block`, ending at `block_end`
      uint64_t block = 0;
      size_t block_end = 0;
      Xxh3Stream stream;
      auto placed = [&](size_t at, const uint8_t* src, size_t n) {
        if (at != run_end) streaming = false;  // a partial block stays for the completion
        run_end = at + n;
        while (n > 0) {
          if (!streaming) {
            const size_t skip = std::min(n, (kChecksumBlockBytes - at % kChecksumBlockBytes) %
                                                kChecksumBlockBytes);
            at += skip;
            src += skip;
            n -= skip;
            if (n == 0) break;
            block = at / kChecksumBlockBytes;
            block_end = std::min(at + kChecksumBlockBytes, blob_size);
            stream.Reset(ChecksumSeed(index, block));
            streaming = true;
          }
          const size_t take = std::min(n, block_end - at);
          stream.Update(src, take);
          at += take;
          src += take;
          n -= take;
          if (at == block_end) {
            hashing.blocks[block] = stream.Digest();
            hashing.done[block] = 1;
            streaming = false;
          }
        }
      };
      uint64_t offset = c.offset();
      for (const auto& seg : req.data) {
        layer.in_place->Write(t == 1, offset, seg.ptr, seg.size, placed);
        offset += seg.size;
      }
      layer.place_seconds += absl::ToDoubleSeconds(absl::Now() - start);
    }
  } else {
    if (!layer.tensor[t]) {
      layer.tensor[t] = staging_->Acquire(size);
      if (!layer.tensor[t]) {
        return Reject(RejectReason::kNoSpace,
                      absl::ResourceExhaustedError(absl::StrCat(
                          "chunk: cannot allocate ", size, " bytes of staging for layer ",
                          c.layer(), " tensor ", kTensorNames[t])));
      }
    }
    req.CopyDataTo(layer.tensor[t].get() + c.offset());
  }
  payload_bytes_ += req.data_size;
  if (!layer.scheduled && LayerComplete(layer)) {
    layer.scheduled = true;
    const int index = static_cast<int>(c.layer());
    // From here on only the job touches the layer's staging or blob: any further chunk for it
    // overlaps bytes already received and is rejected before reaching them.
    if (in_place_) {
      {
        absl::MutexLock lock(&mu_);
        ++pending_;
      }
      ScheduleJob(io_pool_, [this, index] { CompleteInPlaceLayer(index); });
    } else {
      bool compress_now = false;
      {
        absl::MutexLock lock(&mu_);
        ++pending_;
        complete_[index] = true;
        switch (stage_[index]) {
          case Stage::kScored:  // scored while V arrived: compress now, in the layer's slot
            stage_[index] = Stage::kCompressing;
            compress_now = true;
            break;
          case Stage::kScoring:  // ScoreLayer starts the compression when it ends
            break;
          default:  // not scored (a kKeysQueued entry left in score_ready_ is skipped)
            stage_[index] = Stage::kQueued;
            ready_.push_back(index);
            break;
        }
      }
      if (compress_now) {
        ScheduleJob(pool_, [this, index] { CompressLayer(index); });
      }
      StartReady();
    }
  } else if (early_scoring_ && !layer.keys_queued && !layer.scheduled && KeysComplete(layer)) {
    layer.keys_queued = true;
    const int index = static_cast<int>(c.layer());
    {
      absl::MutexLock lock(&mu_);
      if (stage_[index] == Stage::kReceiving) {
        stage_[index] = Stage::kKeysQueued;
        score_ready_.push_back(index);
      }
    }
    StartReady();
  }
  return absl::OkStatus();
}

void Upload::StartReady() {
  // Scheduled outside the lock: a pool without workers runs the job right here.
  // Complete layers first (they are closest to done), then layers to score early.
  std::vector<std::pair<int, bool>> start;  // (layer, score early)
  {
    absl::MutexLock lock(&mu_);
    while (running_ < max_running_) {
      if (!ready_.empty()) {
        const int index = ready_.front();
        ready_.pop_front();
        stage_[index] = Stage::kCompressing;
        start.emplace_back(index, false);
        ++running_;
        continue;
      }
      // Entries of layers that completed meanwhile went to ready_ instead: skip them.
      while (!score_ready_.empty() && stage_[score_ready_.front()] != Stage::kKeysQueued) {
        score_ready_.pop_front();
      }
      if (score_ready_.empty()) break;
      const int index = score_ready_.front();
      score_ready_.pop_front();
      stage_[index] = Stage::kScoring;
      ++pending_;  // the upload is not final while a layer is being scored
      ++running_;
      start.emplace_back(index, true);
    }
  }
  // Each job goes to the back of the pool's queue: the layers of different uploads take turns.
  for (const auto& [index, score] : start) {
    if (score) {
      ScheduleJob(pool_, [this, index = index] { ScoreLayer(index); });
    } else {
      ScheduleJob(pool_, [this, index = index] { CompressLayer(index); });
    }
  }
}

LayerInput Upload::InputOf(int index, bool values) const {
  const LayerState& layer = layers_[index];
  LayerInput in;
  in.shape = shape_;
  in.dtype = dtype_;
  in.layout = layout_;
  in.layer_index = index;
  in.k = layer.tensor[0].get();
  // V's staging may still be acquired by OnChunk when the keys are scored early: not read then.
  in.v = values ? layer.tensor[1].get() : nullptr;
  in.q_obs = shape_.obs_window > 0 ? layer.tensor[2].get() : nullptr;
  in.rope = rope_ ? &*rope_ : nullptr;
  in.cancel = cancel_.get();
  // Q_stats: float32 little-endian on the wire, read in place from the staging buffer (its
  // memory is aligned for floats).
  if (spec_.eviction.query_stats) in.q_stats = reinterpret_cast<const float*>(layer.tensor[3].get());
  return in;
}

void Upload::ScoreLayer(int index) {
  bool dropped = false;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_ || !compress_error_.ok()) {
      dropped = true;
    } else {
      ArmCompressTimeout();
    }
  }
  absl::StatusOr<KeyScores> out = absl::CancelledError("upload dropped");
  if (!dropped) {
    // Only K, Q_obs and Q_stats are complete (and no longer written): V is not passed.
    const LayerInput in = InputOf(index, /*values=*/false);
    if (compress_observer_) compress_observer_(+1);
    out = CallNoThrow([&]() -> absl::StatusOr<KeyScores> {
      RETURN_IF_ERROR(QueryStatsFinite(in));
      return backend_->ScoreKeys(in, spec_);
    });
    if (compress_observer_) compress_observer_(-1);
  }
  bool compress_now = false;
  {
    absl::MutexLock lock(&mu_);
    if (out.ok()) {
      early_scores_[index] = *std::move(out);
    } else if (!dropped) {
      RecordError(index, out.status());
    }
    --pending_;
    if (complete_[index]) {  // the slot passes to the layer's compression
      stage_[index] = Stage::kCompressing;
      compress_now = true;
    } else {
      stage_[index] = Stage::kScored;  // keeps the slot until V is complete
    }
    MaybeFinalize();
  }
  if (compress_now) {
    ScheduleJob(pool_, [this, index] { CompressLayer(index); });
  }
}

absl::Status Upload::QueryStatsFinite(const LayerInput& in) const {
  if (in.q_stats == nullptr) return absl::OkStatus();
  const size_t n = tensor_bytes_[3] / sizeof(float);
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(in.q_stats[i])) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor Q_stats: entry ", i, " (", in.q_stats[i], ") is not finite"));
    }
  }
  return absl::OkStatus();
}

void Upload::CompleteInPlaceLayer(int index) {
  LayerState& layer = layers_[index];
  // Blocks no single chunk covered (metadata, chunk boundaries, NHD rows) are hashed now.
  const absl::Time start = absl::Now();
  const absl::Span<const uint8_t> blob(layer.in_place->blob(), layer.in_place->blob_bytes());
  std::vector<uint64_t> blocks = std::move(layer.hashing->blocks);
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (layer.hashing->done[i] == 0)
      blocks[i] = ChecksumBlock(static_cast<uint32_t>(index), blob, i);
  }
  CompressTimings t;
  t.pack = layer.place_seconds + absl::ToDoubleSeconds(absl::Now() - start);  // the only work
  t.total = t.pack;
  CompactLayer done = std::move(*layer.in_place).Release();
  layer.in_place.reset();
  layer.hashing.reset();
  absl::MutexLock lock(&mu_);
  LayerDone(index, std::move(done), std::move(blocks), t);
}

void Upload::CompressLayer(int index) {
  bool dropped = false;
  {
    absl::MutexLock lock(&mu_);
    if (aborted_ || !compress_error_.ok()) {
      dropped = true;
      --pending_;
      --running_;
      for (auto& buf : layers_[index].tensor) buf.reset();
      MaybeFinalize();
    } else {
      ArmCompressTimeout();
    }
  }
  if (dropped) {
    StartReady();  // this upload's other ready layers go through the same way
    return;
  }
  LayerState& layer = layers_[index];
  const LayerInput in = InputOf(index);
  std::optional<KeyScores> early;
  {
    absl::MutexLock lock(&mu_);
    early.swap(early_scores_[index]);
  }
  if (layer_adaptive_ && !early) {
    HoldLayerScores(index, in);  // the first pass: scores only
    return;
  }
  CompressTimings t;
  std::vector<uint64_t> blocks;
  // Nothing may escape a pool thread: a failed allocation in the engine (std::bad_alloc) fails
  // this upload with RESOURCE_EXHAUSTED, any other exception with INTERNAL, and kvcd carries on.
  if (compress_observer_) compress_observer_(+1);
  absl::StatusOr<CompactLayer> out = CallNoThrow([&]() -> absl::StatusOr<CompactLayer> {
    // A layer scored early had its Q_stats checked before scoring (ScoreLayer).
    if (!early) RETURN_IF_ERROR(QueryStatsFinite(in));
    ASSIGN_OR_RETURN(CompactLayer compact,
                     early ? backend_->CompressScored(in, spec_, *std::move(early), &t)
                           : backend_->Compress(in, spec_, &t));
    // Hashed here, right after the engine wrote it, on this job's thread.
    blocks = ChecksumLayerBlocks(static_cast<uint32_t>(index), compact.bytes);
    return compact;
  });
  if (compress_observer_) compress_observer_(-1);
  for (auto& buf : layer.tensor) buf.reset();  // staging goes back as soon as the layer is done
  {
    absl::MutexLock lock(&mu_);
    --running_;
    LayerDone(index, std::move(out), std::move(blocks), t);
  }
  StartReady();
}

void Upload::HoldLayerScores(int index, const LayerInput& in) {
  if (compress_observer_) compress_observer_(+1);
  absl::StatusOr<KeyScores> out = CallNoThrow([&]() -> absl::StatusOr<KeyScores> {
    RETURN_IF_ERROR(QueryStatsFinite(in));
    LayerInput keys = in;
    keys.v = nullptr;  // scorers never read V (value weighting is off with layer-adaptive)
    return backend_->ScoreKeys(keys, spec_);
  });
  if (compress_observer_) compress_observer_(-1);
  std::vector<std::optional<KeyScores>> all;  // moved out to allocate without the lock
  {
    absl::MutexLock lock(&mu_);
    --running_;
    if (aborted_ || !compress_error_.ok() || !out.ok()) {
      if (!out.ok()) RecordError(index, out.status());
      DropHeldLayers();
      for (auto& buf : layers_[index].tensor) buf.reset();
      --pending_;
    } else {
      early_scores_[index] = *std::move(out);
      stage_[index] = Stage::kHeld;
      if (++held_layers_ == static_cast<int>(layers_.size())) {
        all.swap(early_scores_);  // this layer stays pending until the allocation is done
      } else {
        --pending_;  // a held layer is not pending: it comes back as a compression job
      }
    }
    MaybeFinalize();
  }
  if (!all.empty()) AllocateHeldLayers(std::move(all));
  StartReady();
}

void Upload::AllocateHeldLayers(std::vector<std::optional<KeyScores>> all) {
  std::vector<const std::vector<float>*> scores(all.size());
  for (size_t l = 0; l < all.size(); ++l) scores[l] = all[l] ? &all[l]->scores : nullptr;
  absl::StatusOr<std::vector<std::vector<int32_t>>> counts =
      CallNoThrow([&] { return AllocateAcrossLayers(spec_.eviction, shape_, scores); });
  absl::MutexLock lock(&mu_);
  early_scores_.swap(all);  // back in place (Cancel may have cleared the empty vector meanwhile)
  if (aborted_ || !compress_error_.ok() || !counts.ok()) {
    if (!counts.ok()) RecordError(-1, counts.status());
    DropHeldLayers();
    --pending_;  // the last scored layer's, held for the allocation
    MaybeFinalize();
    return;
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    early_scores_[l]->head_counts = std::move((*counts)[l]);
    stage_[l] = Stage::kQueued;
    ready_.push_back(static_cast<int>(l));
    ++pending_;
  }
  --pending_;  // the allocation's own (the last scored layer's); each layer is pending again
}

void Upload::DropHeldLayers() {
  // By the stages (guarded by mu_), not by layers_: Cancel may come from another thread while
  // the header is still being accepted. A held layer's state was complete long before.
  for (size_t l = 0; l < stage_.size(); ++l) {
    if (stage_[l] != Stage::kHeld) continue;
    stage_[l] = Stage::kCompressing;  // never scheduled again
    if (l < early_scores_.size()) early_scores_[l].reset();
    for (auto& buf : layers_[l].tensor) buf.reset();
  }
}

void Upload::LayerDone(int index, absl::StatusOr<CompactLayer> out, std::vector<uint64_t> blocks,
                       const CompressTimings& t) {
  if (aborted_) {
    // Results of an abandoned upload are dropped.
  } else if (!out.ok()) {
    RecordError(index, out.status());
  } else {
    compact_[index] = *std::move(out);
    compressed_[index] = true;
    for (uint64_t h : blocks) checksum_ += h;
    block_checksums_[index] = std::move(blocks);
    timings_.score += t.score;
    timings_.select += t.select;
    timings_.pack += t.pack;
    timings_.quantize += t.quantize;
    timings_.total += t.total;
  }
  --pending_;
  MaybeFinalize();
}

void Upload::ArmCompressTimeout() {
  if (timeout_armed_) return;
  timeout_armed_ = true;
  cancel_->SetDeadline(
      absl::Now() + limits_.compress_timeout,
      absl::StrFormat("compression ran past --compress_timeout_seconds=%g: upload discarded",
                      absl::ToDoubleSeconds(limits_.compress_timeout)));
}

void Upload::RecordError(int index, const absl::Status& status) {
  if (aborted_ || !compress_error_.ok()) return;  // the first error wins
  // The engine's refusals and a cancellation keep their code; anything else is a bug.
  const absl::StatusCode code = status.code();
  const bool kept =
      code == absl::StatusCode::kInvalidArgument || code == absl::StatusCode::kResourceExhausted ||
      code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kCancelled ||
      code == absl::StatusCode::kAborted || code == absl::StatusCode::kUnavailable;
  compress_error_ = absl::Status(kept ? code : absl::StatusCode::kInternal,
                                 absl::StrCat(index < 0 ? std::string("layer-adaptive budgets")
                                                        : absl::StrCat("layer ", index),
                                              ": ", std::string(status.message())));
  if (reason_ == RejectReason::kNone) reason_ = RejectReason::kCompress;
}

void Upload::Finish(DoneCallback done) {
  absl::MutexLock lock(&mu_);
  done_ = std::move(done);
  finishing_ = true;
  MaybeFinalize();
}

void Upload::Cancel(absl::Status why) {
  cancel_->Cancel(std::move(why));
  absl::MutexLock lock(&mu_);
  aborted_ = true;  // layers still queued finish through their jobs, which drop them at once
  compact_.clear();
  compressed_.clear();
  DropHeldLayers();  // layer-adaptive layers waiting for the others: nothing will run them
  for (auto& scores : early_scores_) scores.reset();
}

void Upload::Abort() { Cancel(absl::CancelledError("upload cancelled")); }

void Upload::MaybeFinalize() {
  if (!finishing_ || !done_ || (pending_ > 0 && !broken_)) return;
  DoneCallback done = std::move(done_);
  done_ = nullptr;
  // The callback is the only way the stream learns the outcome: an exception (a failed
  // allocation) in Finalize becomes its status, and none may leave the callback, which runs
  // with the lock released (an exception there would unwind through the caller's lock).
  absl::StatusOr<kvcache::v1::PutCacheResponse> result = CallNoThrow([&] { return Finalize(); });
  // The callback may finish the RPC; run it without the lock so it can query this upload.
  mu_.Unlock();
  try {
    done(std::move(result));
  } catch (...) {
    std::fputs("kvcd: an upload's completion callback threw\n", stderr);
  }
  mu_.Lock();
}

std::string Upload::IncompleteMessage() const {
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (int t = 0; t < kNumTensors; ++t) {
      if (layers_[l].coverage[t].received != tensor_bytes_[t]) {
        return absl::StrCat("layer ", l, " tensor ", kTensorNames[t], ": ",
                            layers_[l].coverage[t].received, " of ", tensor_bytes_[t],
                            " bytes received");
      }
    }
  }
  return "";
}

absl::StatusOr<kvcache::v1::PutCacheResponse> Upload::Finalize() {
  if (aborted_) return cancel_->status();
  if (!compress_error_.ok()) return compress_error_;
  if (!has_header_) {
    reason_ = RejectReason::kInvalid;
    return absl::InvalidArgumentError("header: the stream ended without a PutCacheHeader");
  }
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (!compressed_[l]) {
      reason_ = RejectReason::kIncomplete;
      return absl::InvalidArgumentError(IncompleteMessage());
    }
  }
  const absl::Time now = absl::Now();
  auto entry = std::make_shared<CacheEntry>();
  entry->id = store_id_;
  entry->created = now;
  const uint32_t ttl =
      header_.ttl_seconds() > 0 ? header_.ttl_seconds() : limits_.default_ttl_seconds;
  if (ttl > 0) entry->expires = now + absl::Seconds(ttl);
  // OnHeader checked K + V + Q_obs of all layers, so this cannot overflow.
  entry->input_bytes = (tensor_bytes_[0] + tensor_bytes_[1]) * layers_.size();

  kvcache::v1::CacheInfo info;
  info.set_cache_id(header_.cache_id());
  *info.mutable_shape() = header_.shape();
  info.set_dtype(header_.dtype());
  *info.mutable_compression() = header_.compression();
  uint64_t stored = 0;
  entry->layers.reserve(layers_.size());
  for (auto& layer : compact_) {
    auto view = CompactLayerView::Parse(layer.bytes);
    if (!view.ok()) {
      reason_ = RejectReason::kCompress;
      return absl::InternalError(absl::StrCat("engine produced an unreadable layer: ",
                                              std::string(view.status().message())));
    }
    info.add_kept_tokens(view->max_kept());
    stored += layer.bytes.size();
    entry->layers.push_back(std::move(layer.bytes));
  }
  compact_.clear();
  entry->checksum = checksum_;  // each layer's share, summed as the layers finished
  entry->block_checksums = std::move(block_checksums_);
  info.set_input_bytes(entry->input_bytes);
  info.set_stored_bytes(stored);
  info.set_compression_ratio(stored > 0 ? static_cast<double>(entry->input_bytes) / stored : 0);
  info.set_created_unix_ms(absl::ToUnixMillis(entry->created));
  info.set_expires_unix_ms(ttl > 0 ? absl::ToUnixMillis(entry->expires) : 0);
  info.set_checksum(entry->checksum);
  entry->metadata = info.SerializeAsString();

  // Everything that may fail is done before the insert: once the cache is in the store, the
  // client is told so.
  kvcache::v1::PutCacheResponse resp;
  resp.set_cache_id(header_.cache_id());
  resp.set_input_bytes(entry->input_bytes);
  resp.set_stored_bytes(stored);
  resp.set_compression_ratio(info.compression_ratio());
  auto* st = resp.mutable_compress();
  st->set_score_seconds(timings_.score);
  st->set_select_seconds(timings_.select);
  st->set_pack_seconds(timings_.pack);
  st->set_quantize_seconds(timings_.quantize);
  st->set_total_seconds(timings_.total);
  resp.set_elapsed_seconds(absl::ToDoubleSeconds(absl::Now() - start_));
  resp.set_backend(backend_name_);
  absl::StatusOr<kvcache::v1::PutCacheResponse> result(std::move(resp));
  if (absl::Status s = store_->Insert(entry, header_.overwrite()); !s.ok()) {
    reason_ = s.code() == absl::StatusCode::kAlreadyExists ? RejectReason::kExists
                                                           : RejectReason::kNoSpace;
    return absl::Status(s.code(), absl::StrCat("store: ", std::string(s.message())));
  }
  staging_reservation_.Release();  // the staging is freed; the cache is charged to the store
  return result;
}

}  // namespace kvc::server

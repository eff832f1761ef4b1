// GetCache: a server-streaming raw reactor. Holds the store lease for the whole stream (the entry
// cannot be evicted or freed meanwhile), keeps exactly one write in flight and produces the next
// message from OnWriteDone. PACKED chunks reference the stored blob in place; DENSE chunks
// reference the exported layer, which lives until gRPC releases the last slice, or, for a layer
// that needs no export (nothing quantized or pruned: kvc/compact.h DenseRunsOf), the blob's own
// runs of K, V and positions, verified block by block as they go out, as PACKED's are (a ragged
// head's padding comes from constant bytes outside the blob, which have no checksum).
//
// DENSE export runs on the I/O pool, never on a gRPC callback thread, and is sent as it is
// written: the job writes a layer head by head (each head's keys, then each head's values:
// kvc/compact.h DenseExporter) and the reactor sends every finished prefix, so a download's first
// bytes go out after one head's export instead of a whole layer's. Once layer L is written, layer
// L+1 is exported while L streams, so at most two exported layers (plus whatever gRPC still
// holds) exist at a time. When the reactor has sent all that is written it parks, and the export
// job resumes it after its next piece. A layer whose only change is pruned key
// channels (kvc/compact.h DenseValueRunsOf: ThinK on the keys) exports its keys only; V and
// positions go out from the blob. The job verifies every block of such a layer that is not
// wholly inside those runs before it reads the keys. DENSE_CONTIGUOUS
// is DENSE with the keys re-rotated (kvc/contiguous_export.h), its RopeSpec and kept counts
// checked up front (server/contiguous.h); for a layer DenseRunsOf accepts the keys are turned
// straight from the blob.
//
// A client that stops reading leaves a write outstanding (flow control): after
// --stream_idle_seconds the reaper (server/stream_guard.h) ends the stream, which releases the
// lease even if the entry was deleted meanwhile.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/optional.h"
#include "absl/types/span.h"
#include "kvc/compact.h"
#include "kvc/contiguous_export.h"
#include "kvc/status_macros.h"
#include "kvc/thread_pool.h"
#include "server/contiguous.h"
#include "server/convert.h"
#include "server/service_impl.h"
#include "server/wire.h"

namespace kvc::server {
namespace {

class GetCacheReactor final : public grpc::ServerWriteReactor<grpc::ByteBuffer> {
 public:
  GetCacheReactor(ServiceState* state, grpc::CallbackServerContext* context,
                  const grpc::ByteBuffer* request)
      : state_(state), context_(context), rec_(state, "GetCache") {
    StreamWatch::IdleFn on_idle = [this](absl::Duration idle) { OnIdle(idle); };
    watch_ = state_->reaper ? state_->reaper->Watch(std::move(on_idle))
                            : std::make_shared<StreamWatch>(std::move(on_idle));
    // From here on the stream may hold slots and a lease: an exception must end it, so that
    // OnDone runs (gRPC swallows a reactor's exceptions and then never calls OnDone).
    Guarded([&] { Start(*request); });
  }

  void OnWriteDone(bool ok) override {
    Guarded([&] { WriteDone(ok); });
  }

  void OnDone() override {
    watch_->Detach();  // the reaper no longer calls OnIdle
    if (holds_peer_) state_->peer_streams->Release(peer_);
    if (holds_stream_) state_->ReleaseStream();
    delete this;
  }

 private:
  // Runs one of the reactor's steps; an exception escaping it ends the stream with its status
  // (RESOURCE_EXHAUSTED for a failed allocation), which gRPC would otherwise swallow without ever
  // calling OnDone.
  template <typename Step>
  void Guarded(Step&& step) {
    RunNoThrow(step, [this](const absl::Status& s) { FinishOnce(ToGrpc(s, ns_)); });
  }

  // The constructor's work once the stream is watched.
  void Start(const grpc::ByteBuffer& request) {
    if (state_->draining) {
      if (state_->metrics) state_->metrics->RecordRejection(RejectionReason::kDraining);
      FinishOnce(grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvcd is shutting down"));
      return;
    }
    auto ns = state_->Namespace(*context_);
    if (!ns.ok()) {
      FinishOnce(ToGrpc(ns.status()));
      return;
    }
    if (!state_->TryAcquireStream()) {
      if (state_->metrics) state_->metrics->RecordRejection(RejectionReason::kLimit);
      FinishOnce(
          grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                       absl::StrCat("too many concurrent streams (--max_concurrent_",
                                    "streams=", state_->config.max_concurrent_streams, ")")));
      return;
    }
    holds_stream_ = true;
    if (state_->peer_streams) {
      peer_ = PeerKey(context_->peer(), *ns);
      if (!state_->peer_streams->TryAcquire(peer_)) {
        if (state_->metrics) state_->metrics->RecordRejection(RejectionReason::kPeerStreams);
        FinishOnce(grpc::Status(
            grpc::StatusCode::RESOURCE_EXHAUSTED,
            absl::StrCat("too many concurrent streams from ", peer_,
                         " (--max_streams_per_peer=", state_->peer_streams->per_peer(), ")")));
        return;
      }
      holds_peer_ = true;
    }
    ns_ = *ns;
    grpc::Status s = Begin(request, *ns);
    if (!s.ok()) {
      FinishOnce(s);
      return;
    }
    NextWrite();
  }

  void WriteDone(bool ok) {
    // The reaper ended the stream while this write was outstanding: start nothing more (no
    // export either, whose job would outlive this reactor); OnDone follows.
    if (!watch_->Disarm()) return;
    if (!ok) {
      // The client went away or cancelled; nothing more can be sent.
      FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "stream cancelled"));
      return;
    }
    if (state_->metrics && last_data_bytes_ > 0) {
      state_->metrics->AddServedBytes(last_data_bytes_);
    }
    NextWrite();
  }

  // What the slices of an in-flight message keep alive.
  struct Keepalive {
    CacheStore::Lease lease;
  };

  // The export of one layer, written by a pool job while the reactor sends it. The job allocates
  // the layer and then writes it piece by piece (kvc/compact.h DenseExporter: each head's keys,
  // then each head's values); the reactor sends each finished prefix as it comes and parks when
  // it has caught up with the job, which resumes it after its next piece.
  struct Export {
    // Set when the layer is sent from the blob itself: then nothing runs on the pool. With
    // keys_only V and positions are sent from the blob and `layer` holds the keys alone,
    // exported (and for DENSE_CONTIGUOUS turned) on the pool: from `runs->k` when DenseRunsOf
    // gave them (keys_in_place), else by ExportDenseKeys.
    absl::optional<DenseRuns> runs;
    bool keys_only = false;
    bool keys_in_place = false;
    int n_kept = 0, heads = 0;
    absl::Mutex mu;
    // started: `layer` is allocated (or `status` says why not) and its finished prefixes,
    // k_ready and v_ready bytes, may be sent; done: every byte is written (or the export failed).
    bool started ABSL_GUARDED_BY(mu) = false;
    bool done ABSL_GUARDED_BY(mu) = false;
    absl::Status status ABSL_GUARDED_BY(mu);
    std::shared_ptr<const DenseLayer> layer ABSL_GUARDED_BY(mu);
    uint64_t k_ready ABSL_GUARDED_BY(mu) = 0;
    uint64_t v_ready ABSL_GUARDED_BY(mu) = 0;
    bool reactor_waiting ABSL_GUARDED_BY(mu) = false;
  };

  // Starts exporting layer `index` on the pool. The job holds the lease (the blob stays valid)
  // and its own copy of everything else it reads: the reactor may finish and be deleted while
  // the job runs (the client cancels while the layer before streams). It touches the reactor
  // only to resume it when parked on this export, and a parked reactor cannot finish.
  std::shared_ptr<Export> StartExport(uint32_t index) {
    auto ex = std::make_shared<Export>();
    // Parse is safe on unverified bytes; a blob it refuses goes to the job, which names the
    // corrupt block. The runs' blocks, and those of the header they were read from, are verified
    // as they are sent (LoadLayer, NextWrite); the keys a contiguous export turns, by the job
    // before it reads them.
    auto view = CompactLayerView::Parse(keep_->lease.entry().layers[index]);
    DenseRuns runs;
    if (view.ok() && DenseRunsOf(*view, &runs)) {
      ex->keys_in_place = true;
      ex->keys_only = rope_.has_value();
    } else if (view.ok() && DenseValueRunsOf(*view, &runs)) {
      ex->keys_only = true;
    }
    if (ex->keys_in_place || ex->keys_only) {
      ex->runs = std::move(runs);
      ex->n_kept = view->max_kept();
      ex->heads = view->num_kv_heads();
    }
    if (ex->runs && !ex->keys_only) {
      absl::MutexLock lock(&ex->mu);
      ex->started = ex->done = true;
      return ex;
    }
    // On the I/O pool: a download never waits behind compressions.
    ThreadPool* pool = state_->io_pool != nullptr ? state_->io_pool : state_->pool;
    pool->Schedule([this, ex, keep = keep_, index, rope = rope_] {
      // Publishes the job's progress; resumes the reactor when it is parked on this export.
      const auto publish = [this, &ex](auto&& update) {
        bool resume;
        {
          absl::MutexLock lock(&ex->mu);
          update();
          resume = std::exchange(ex->reactor_waiting, false);
        }
        if (resume) NextWrite();  // the reactor is parked: no write in flight, nothing else runs
      };
      const auto fail = [&](absl::Status status) {
        publish([&] {
          ex->status = std::move(status);
          ex->started = ex->done = true;
        });
      };
      // Nothing may escape the job: a parked reactor would wait for it forever.
      try {
        const CacheEntry& entry = keep->lease.entry();
        // Everything an export reads is checked before it is read: the whole blob, or for a
        // keys-only export all but the runs of V and positions (the header, the head table, the
        // key rows, codes, scales and channel indices), which are checked as they are sent.
        if (absl::Status verified =
                ex->keys_only
                    ? VerifyAllButRuns(entry, index, ex->heads, *ex->runs)
                    : VerifyBlocks(entry, index, 0, entry.block_checksums[index].size());
            !verified.ok()) {
          return fail(verified);
        }
        absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(entry.layers[index]);
        if (!view.ok()) {
          return fail(absl::DataLossError(
              absl::StrCat("layer ", index, ": ", std::string(view.status().message()))));
        }
        absl::StatusOr<DenseExporter> exporter =
            ex->keys_in_place ? MakeKeysContiguousExporter(*view, *ex->runs, *rope)
            : rope            ? MakeContiguousExporter(*view, *rope, ex->keys_only)
                              : MakeDenseExporter(*view, /*values=*/!ex->keys_only);
        if (!exporter.ok()) return fail(exporter.status());
        publish([&] {
          ex->layer = exporter->layer();
          ex->started = true;
          ex->done = exporter->pieces() == 0;
        });
        while (exporter->WriteNext()) {
          const int n = exporter->written();
          publish([&] {
            ex->k_ready = exporter->KeyBytesAfter(n);
            ex->v_ready = exporter->ValueBytesAfter(n);
            ex->done = n == exporter->pieces();
          });
        }
      } catch (...) {
        fail(StatusFromException(std::current_exception()));
      }
    });
    return ex;
  }

  // The reaper's IdleFn (watch lock held, on the reaper's thread): the client took no message for
  // `idle`. Finish alone would queue the status behind the unread data, so the call is also
  // cancelled: gRPC drops what it holds and the lease goes with the last slice.
  void OnIdle(absl::Duration idle) {
    const grpc::Status status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrFormat("no bytes taken for %.1f s (--stream_idle_seconds=%g)",
                        absl::ToDoubleSeconds(idle), state_->config.stream_idle_seconds));
    if (state_->metrics) state_->metrics->RecordRejection(RejectionReason::kStreamIdle);
    rec_.Record(status.error_code());
    Finish(status);
    context_->TryCancel();
  }

  // Hands `pending_` to gRPC; the stream is idle until the client takes it.
  void Write() {
    watch_->Arm();
    watch_->Run([this] { StartWrite(&pending_); });  // not run once ended: OnDone follows
  }

  grpc::Status Begin(const grpc::ByteBuffer& buffer, const std::string& ns) {
    kvcache::v1::GetCacheRequest req;
    if (absl::Status s = ParseMessage(buffer, &req); !s.ok()) return ToGrpc(s);
    if (auto s = ValidateCacheId("cache_id", req.cache_id()); !s.ok()) return ToGrpc(s);
    switch (req.format()) {
      case kvcache::v1::FORMAT_UNSPECIFIED:
      case kvcache::v1::FORMAT_PACKED:
        dense_ = false;
        break;
      case kvcache::v1::FORMAT_DENSE:
      case kvcache::v1::FORMAT_DENSE_CONTIGUOUS:
        dense_ = true;
        break;
      default:
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            absl::StrCat("format: ", static_cast<int>(req.format()),
                                         " is not PACKED, DENSE or DENSE_CONTIGUOUS"));
    }
    auto lease = state_->store->Acquire(ns + req.cache_id());
    if (!lease.ok()) return ToGrpc(lease.status(), ns);
    keep_ = std::make_shared<Keepalive>();
    keep_->lease = *std::move(lease);
    const CacheEntry& entry = keep_->lease.entry();
    // The block table is checked against the checksum here (cheap); each block's bytes are
    // hashed just before they are sent (PACKED) or exported (DENSE).
    if (auto s = VerifyBlockTable(entry); !s.ok()) return ToGrpc(s, ns);
    kvcache::v1::GetCacheResponse first;
    if (!first.mutable_info()->ParseFromString(entry.metadata)) {
      return grpc::Status(grpc::StatusCode::DATA_LOSS, "stored metadata is unreadable");
    }
    if (req.format() == kvcache::v1::FORMAT_DENSE_CONTIGUOUS) {
      if (!req.has_rope()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "rope: required with FORMAT_DENSE_CONTIGUOUS (the RoPE the keys were "
                            "stored with: theta, rotary_dims, style)");
      }
      auto rope = RopeFromProto(req.rope(), static_cast<int>(first.info().shape().head_dim()),
                                RopeUse::kContiguous);
      if (!rope.ok()) return ToGrpc(rope.status());
      if (auto s = CheckUniformKept(first.info(), entry); !s.ok()) return ToGrpc(s);
      rope_ = *rope;
    }
    const uint32_t num_layers = static_cast<uint32_t>(entry.layers.size());
    layer_ = req.layer_begin();
    layer_end_ = req.has_layer_end() ? req.layer_end() : num_layers;
    if (layer_end_ > num_layers || layer_ > layer_end_) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("layer_begin/layer_end: [", layer_, ", ", layer_end_,
                                       ") is not a range within [0, ", num_layers, "]"));
    }
    chunk_ = state_->config.max_chunk_bytes;
    if (dense_ && layer_ < layer_end_) next_export_ = StartExport(layer_);
    pending_ = SerializeToByteBuffer(first);
    has_pending_ = true;
    return grpc::Status::OK;
  }

  // Loads the parts of the current layer: the blob for PACKED; for DENSE the blob's runs of K, V
  // and positions (DenseRunsOf) or the three exported arrays. Sets *parked (DENSE only) when the
  // export is still running: the export job calls NextWrite again when it is done.
  grpc::Status LoadLayer(bool* parked) {
    *parked = false;
    const CacheEntry& entry = keep_->lease.entry();
    const auto& blob = entry.layers[layer_];
    parts_.clear();
    verified_.assign(entry.block_checksums[layer_].size(), 0);
    if (!dense_) {
      // Parse is safe on any bytes; its blocks are verified chunk by chunk as they are sent.
      auto view = CompactLayerView::Parse(blob);
      if (!view.ok()) {
        // Only corruption makes a stored blob unreadable: name the block when the hashes can.
        if (absl::Status s = VerifyBlocks(entry, layer_, 0, entry.block_checksums[layer_].size());
            !s.ok()) {
          return ToGrpc(s, ns_);
        }
        return grpc::Status(
            grpc::StatusCode::DATA_LOSS,
            absl::StrCat("layer ", layer_, ": ", std::string(view.status().message())));
      }
      kept_tokens_ = view->max_kept();
      parts_.push_back(BlobPart(kvcache::v1::PART_PACKED, {absl::MakeConstSpan(blob)}));
    } else {
      std::shared_ptr<const DenseLayer> owned;
      std::shared_ptr<Export> in_place;
      bool export_done;
      // Not started yet when the layer before sent no exported byte that would have seen its
      // export done (it kept no token).
      if (next_export_ == nullptr) next_export_ = StartExport(layer_);
      {
        absl::MutexLock lock(&next_export_->mu);
        if (!next_export_->started) {
          next_export_->reactor_waiting = true;
          *parked = true;
          return grpc::Status::OK;
        }
        if (!next_export_->status.ok()) return ToGrpc(next_export_->status, ns_);
        if (next_export_->runs) in_place = next_export_;
        owned = next_export_->layer;  // null when sent from the blob alone
        export_done = next_export_->done;
      }
      // The layer being written is sent as its pieces finish; the next layer's export starts
      // once this one is done (NextWrite), so that the two do not compete for the cores.
      writing_ = std::move(next_export_);
      next_export_ = nullptr;
      if (export_done) StartNextExport();
      if (in_place) {
        // The header and head table the runs were read from are checked before any run goes
        // out; each run's own blocks as it is sent.
        const uint64_t table_end =
            sizeof(LayerHeader) + sizeof(HeadDesc) * static_cast<uint64_t>(in_place->heads);
        if (absl::Status s = VerifyRange(0, table_end); !s.ok()) return ToGrpc(s, ns_);
        kept_tokens_ = in_place->n_kept;
        const DenseRuns& runs = *in_place->runs;
        if (owned != nullptr) {  // the exported (for DENSE_CONTIGUOUS turned) keys
          parts_.push_back(
              ExportedPart(kvcache::v1::PART_K, absl::MakeConstSpan(owned->k), owned));
        } else {
          parts_.push_back(BlobPart(kvcache::v1::PART_K, runs.k));
        }
        parts_.push_back(BlobPart(kvcache::v1::PART_V, runs.v));
        parts_.push_back(BlobPart(kvcache::v1::PART_POSITIONS, runs.positions));
      } else {
        kept_tokens_ = owned->n_kept;
        const auto positions = absl::MakeConstSpan(
            reinterpret_cast<const uint8_t*>(owned->positions.data()),
            owned->positions.size() * sizeof(int32_t));
        parts_.push_back(ExportedPart(kvcache::v1::PART_K, absl::MakeConstSpan(owned->k), owned));
        parts_.push_back(ExportedPart(kvcache::v1::PART_V, absl::MakeConstSpan(owned->v), owned));
        parts_.push_back(ExportedPart(kvcache::v1::PART_POSITIONS, positions, owned));
      }
    }
    part_ = 0;
    offset_ = 0;
    run_ = 0;
    run_offset_ = 0;
    return grpc::Status::OK;
  }

  // Whether bytes [0, end) of exported part `kind` of the layer being sent are written; parks
  // the reactor (*parked) when they are not. The export's error, if any.
  grpc::Status AwaitWritten(kvcache::v1::LayerPart kind, uint64_t end, bool* parked) {
    *parked = false;
    bool done;
    {
      absl::MutexLock lock(&writing_->mu);
      if (!writing_->status.ok()) return ToGrpc(writing_->status, ns_);
      done = writing_->done;
      const uint64_t written = done                         ? end
                               : kind == kvcache::v1::PART_K ? writing_->k_ready
                               : kind == kvcache::v1::PART_V ? writing_->v_ready
                                                             : 0;  // positions: when done
      if (written < end) {
        writing_->reactor_waiting = true;
        *parked = true;
        return grpc::Status::OK;
      }
    }
    if (done) StartNextExport();
    return grpc::Status::OK;
  }

  // Starts the next layer's export (DENSE), once: when the layer being sent is written. (Only
  // LoadLayer takes next_export_, when it moves on to that layer.)
  void StartNextExport() {
    if (next_export_ == nullptr && layer_ + 1 < layer_end_) next_export_ = StartExport(layer_ + 1);
  }

  // Sends the next message, or parks, or ends the stream. Runs on the reactor's callbacks and, to
  // resume a parked reactor, on the export job's thread; an exception ends the stream there too.
  void NextWrite() {
    Guarded([&] { SendNext(); });
  }

  void SendNext() {
    if (has_pending_) {  // the info message
      has_pending_ = false;
      last_data_bytes_ = 0;
      Write();
      return;
    }
    for (;;) {
      if (part_ >= parts_.size()) {
        if (loaded_) ++layer_;
        loaded_ = false;
        if (layer_ >= layer_end_) {
          FinishOnce(grpc::Status::OK);
          return;
        }
        bool parked;
        grpc::Status s = LoadLayer(&parked);
        if (!s.ok()) {
          FinishOnce(s);
          return;
        }
        // Parked: the export job may already be running NextWrite, so touch nothing more. It
        // loads this same layer (loaded_ is false).
        if (parked) return;
        loaded_ = true;
      }
      const Part& p = parts_[part_];
      // An empty part still gets one (empty) message so the client learns its size.
      if (offset_ < p.size || (p.size == 0 && offset_ == 0 && !sent_empty_)) {
        // An exported part goes out as its export writes it, in the same whole messages.
        if (!p.in_blob && p.size > 0) {
          bool parked;
          if (grpc::Status s = AwaitWritten(p.kind, std::min(p.size, offset_ + chunk_), &parked);
              !s.ok()) {
            FinishOnce(s);
            return;
          }
          if (parked) return;  // the export job resumes NextWrite after its next piece
        }
        size_t n = 0;
        const uint8_t* data = nullptr;
        if (p.size > 0) {
          // One message never spans two runs.
          const absl::Span<const uint8_t> run = p.runs[run_];
          n = std::min<uint64_t>(chunk_, run.size() - run_offset_);
          data = run.data() + run_offset_;
          if (p.in_blob && !IsDensePadding(run)) {
            // The blocks this chunk reaches into are verified now, while the kernel is about to
            // read them anyway: a corrupt block ends the stream before any of its bytes go out.
            const uint8_t* blob = keep_->lease.entry().layers[layer_].data();
            const auto at = static_cast<uint64_t>(data - blob);
            if (absl::Status s = VerifyRange(at, at + n); !s.ok()) {
              // The message names the cache by the caller's id, never the tenant-qualified one.
              FinishOnce(ToGrpc(s, ns_));
              return;
            }
          }
          run_offset_ += n;
          if (run_offset_ == run.size()) {
            ++run_;
            run_offset_ = 0;
          }
        }
        kvcache::v1::LayerChunk chunk;
        chunk.set_layer(layer_);
        chunk.set_part(p.kind);
        chunk.set_offset(offset_);
        chunk.set_total_bytes(p.size);
        chunk.set_kept_tokens(kept_tokens_);
        pending_ = MakeChunkResponse(chunk, data, n, p.owner);
        offset_ += n;
        last_data_bytes_ = n;
        sent_empty_ = p.size == 0;
        Write();
        return;
      }
      ++part_;
      offset_ = 0;
      run_ = 0;
      run_offset_ = 0;
      sent_empty_ = false;
    }
  }

  void FinishOnce(const grpc::Status& status) {
    watch_->End([&] {
      rec_.Record(status.error_code());
      Finish(status);
    });
  }

  // One part of a layer: its bytes are `runs`, in order, of `size` bytes in all. in_blob: the
  // runs lie in the stored blob (PACKED, DENSE sent from the blob), whose checksum blocks are
  // verified as they go out, or are DenseRunsOf's constant padding; otherwise they are an
  // exported layer that `owner` keeps alive.
  struct Part {
    kvcache::v1::LayerPart kind;
    std::vector<absl::Span<const uint8_t>> runs;
    size_t size;
    bool in_blob;
    std::shared_ptr<const void> owner;
  };

  Part BlobPart(kvcache::v1::LayerPart kind, std::vector<absl::Span<const uint8_t>> runs) {
    size_t size = 0;
    for (const auto& r : runs) size += r.size();
    return Part{kind, std::move(runs), size, /*in_blob=*/true, keep_};
  }

  static Part ExportedPart(kvcache::v1::LayerPart kind, absl::Span<const uint8_t> bytes,
                           std::shared_ptr<const void> owner) {
    return Part{kind, {bytes}, bytes.size(), /*in_blob=*/false, std::move(owner)};
  }

  // Verifies the blocks of layer `index` that do not lie wholly inside one of the runs of V and
  // positions (those are verified as they are sent): everything a keys-only export reads. The
  // header and head table the runs were read from (`heads` descriptors) are verified always.
  static absl::Status VerifyAllButRuns(const CacheEntry& entry, uint32_t index, int heads,
                                       const DenseRuns& runs) {
    const auto& blob = entry.layers[index];
    const uint64_t blocks = entry.block_checksums[index].size();
    const uint64_t table_end =
        sizeof(LayerHeader) + sizeof(HeadDesc) * static_cast<uint64_t>(heads);
    std::vector<uint8_t> skip(blocks, 0);
    for (const auto* part : {&runs.v, &runs.positions}) {
      for (const auto& run : *part) {
        if (IsDensePadding(run)) continue;
        const auto at = static_cast<uint64_t>(run.data() - blob.data());
        const uint64_t end = at + run.size();
        // Whole blocks only; the blob's last block is whole when the run reaches its end.
        const uint64_t last =
            end == blob.size() ? NumChecksumBlocks(end) : end / kChecksumBlockBytes;
        for (uint64_t b = std::max(NumChecksumBlocks(at), NumChecksumBlocks(table_end));
             b < last && b < blocks; ++b) {
          skip[b] = 1;
        }
      }
    }
    for (uint64_t b = 0; b < blocks;) {
      if (skip[b]) {
        ++b;
        continue;
      }
      uint64_t e = b + 1;
      while (e < blocks && !skip[e]) ++e;
      RETURN_IF_ERROR(VerifyBlocks(entry, index, b, e));
      b = e;
    }
    return absl::OkStatus();
  }

  // Verifies the checksum blocks of the current layer's blob that bytes [begin, end) reach
  // into and that were not verified yet.
  absl::Status VerifyRange(uint64_t begin, uint64_t end) {
    if (end <= begin) return absl::OkStatus();
    const CacheEntry& entry = keep_->lease.entry();
    for (uint64_t b = begin / kChecksumBlockBytes; b < NumChecksumBlocks(end); ++b) {
      if (verified_[b]) continue;
      RETURN_IF_ERROR(VerifyBlocks(entry, layer_, b, b + 1));
      verified_[b] = 1;
    }
    return absl::OkStatus();
  }

  ServiceState* const state_;
  grpc::CallbackServerContext* const context_;
  RpcRecorder rec_;  // recorded under the watch's lock (End, OnIdle)
  std::shared_ptr<StreamWatch> watch_;
  bool holds_stream_ = false;
  bool holds_peer_ = false;
  std::string peer_;  // PeerKey of the caller
  std::string ns_;    // the caller's store-id prefix, removed from every message
  bool dense_ = false;
  absl::optional<RopeParams> rope_;  // DENSE_CONTIGUOUS: keys re-rotated for slots 0..K-1
  std::shared_ptr<Keepalive> keep_;
  uint32_t layer_ = 0, layer_end_ = 0;
  bool loaded_ = false;
  uint64_t chunk_ = 0;
  int kept_tokens_ = 0;
  std::vector<Part> parts_;
  std::shared_ptr<Export> next_export_;  // DENSE: the export of the next layer to load
  std::shared_ptr<Export> writing_;      // DENSE: the export of the layer being sent
  size_t part_ = 0;
  uint64_t offset_ = 0;
  std::vector<uint8_t> verified_;  // which blocks of the current layer's blob are checked
  size_t run_ = 0;                 // the run of the part being sent
  uint64_t run_offset_ = 0;        // and the bytes of it sent
  bool sent_empty_ = false;
  grpc::ByteBuffer pending_;
  bool has_pending_ = false;
  uint64_t last_data_bytes_ = 0;
};

}  // namespace

grpc::ServerWriteReactor<grpc::ByteBuffer>* NewGetCacheReactor(ServiceState* state,
                                                               grpc::CallbackServerContext* context,
                                                               const grpc::ByteBuffer* request) {
  return new GetCacheReactor(state, context, request);
}

}  // namespace kvc::server

// PutCache: a client-streaming raw reactor. Reads one message at a time (gRPC flow control then
// paces the client), hands chunks to the Upload, and answers once the Upload has inserted the
// cache. Compression runs on the pool, so the reactor never blocks a callback thread.
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "kvc/thread_pool.h"
#include "kvc/transfer.h"
#include "server/convert.h"
#include "server/ingest.h"
#include "server/ingest_registry.h"
#include "server/service_impl.h"
#include "server/upload_table.h"
#include "server/wire.h"

namespace kvc::server {
namespace {

absl::optional<RejectionReason> MetricReason(RejectReason r) {
  switch (r) {
    case RejectReason::kInvalid:
    case RejectReason::kIncomplete:
      return RejectionReason::kInvalidArgument;
    case RejectReason::kTooLarge:
      return RejectionReason::kTooLarge;
    case RejectReason::kNoSpace:
      return RejectionReason::kBudget;
    case RejectReason::kWork:
      return RejectionReason::kWork;
    default:
      return absl::nullopt;
  }
}

// The ingest limits kvcd's flags set.
IngestLimits IngestLimitsOf(const ServerConfig& c, const Backend& backend) {
  IngestLimits limits;
  limits.max_chunk_bytes = c.max_chunk_bytes;
  limits.max_cache_bytes = EffectiveMaxCacheBytes(c);
  limits.default_ttl_seconds = c.default_ttl_seconds;
  limits.work_flops_per_byte = c.work_flops_per_byte;
  limits.work_base_flops = c.work_base_flops;
  limits.work_scratch_per_byte = c.work_scratch_per_byte;
  limits.work_base_scratch_bytes = c.work_base_scratch_bytes;
  limits.engine_threads = EffectiveThreads(c);
  limits.whole_layer_statistics = backend.name() == "cuda";
  limits.compress_timeout = absl::Seconds(c.compress_timeout_seconds);
  return limits;
}

class PutCacheReactor;

// How the Upload's callbacks (its done callback, the UploadTable's stop) reach the reactor: they
// run on other threads and may come after the stream ended. OnDone clears `reactor` before the
// reactor is deleted, waiting for a callback that holds the lock.
struct ReactorLink {
  absl::Mutex mu;
  PutCacheReactor* reactor ABSL_GUARDED_BY(mu) = nullptr;
};

class PutCacheReactor final : public grpc::ServerReadReactor<grpc::ByteBuffer> {
 public:
  PutCacheReactor(ServiceState* state, grpc::CallbackServerContext* context,
                  grpc::ByteBuffer* response)
      : state_(state), context_(context), response_(response), rec_(state, "PutCache") {
    {
      absl::MutexLock lock(&link_->mu);
      link_->reactor = this;
    }
    StreamWatch::IdleFn on_idle = [this](absl::Duration idle) { OnIdle(idle); };
    watch_ = state_->reaper ? state_->reaper->Watch(std::move(on_idle))
                            : std::make_shared<StreamWatch>(std::move(on_idle));
    // From here on the stream may hold slots: an exception must end it, so that OnDone runs.
    Guarded([&] { Start(); });
  }

  void OnReadDone(bool ok) override {
    Guarded([&] { ReadDone(ok); });
  }

  void OnCancel() override {
    // A cancelled upload must store nothing, even if its last layer is being finalized now; its
    // compression stops at the next row block, and the stream ends now, not when it has.
    Guarded([&] {
      if (upload_) upload_->Abort();
      EndStream(grpc::Status(grpc::StatusCode::CANCELLED, "upload cancelled"));
    });
  }

  void OnDone() override {
    if (table_key_ != 0) state_->uploads->Remove(table_key_);
    {
      absl::MutexLock lock(&link_->mu);  // waits for a callback using this reactor
      link_->reactor = nullptr;
    }
    watch_->Detach();  // the reaper no longer calls OnIdle
    CloseExternal().IgnoreError();
    if (holds_peer_) state_->peer_streams->Release(peer_);
    if (holds_stream_) state_->ReleaseStream();
    delete this;
  }

  // The Upload finished (from its done callback, link lock held): answer the client.
  void OnUploadDone(absl::StatusOr<kvcache::v1::PutCacheResponse> result) {
    Guarded([&] { UploadDone(std::move(result)); });
  }

  // Ends the stream with `status` unless it has ended already. Safe from any thread (the watch
  // serializes it with the reactor's own operations); the transfer registration, if any, is
  // closed by the reactor itself (OnReadDone, OnDone).
  void EndStream(const grpc::Status& status) {
    watch_->End([&] {
      rec_.Record(status.error_code());
      Finish(status);
    });
  }

 private:
  // The constructor's work once the stream is watched.
  void Start() {
    if (state_->draining) {
      Reject(absl::nullopt, grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvcd is shutting down"),
             RejectionReason::kDraining);
      return;
    }
    auto ns = state_->Namespace(*context_);
    if (!ns.ok()) {
      FinishOnce(ToGrpc(ns.status()));
      return;
    }
    namespace_ = *std::move(ns);
    if (!state_->TryAcquireStream()) {
      Reject(absl::nullopt,
             grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                          absl::StrCat("too many concurrent streams (--max_concurrent_streams=",
                                       state_->config.max_concurrent_streams, ")")),
             RejectionReason::kLimit);
      return;
    }
    holds_stream_ = true;
    if (state_->peer_streams) {
      peer_ = PeerKey(context_->peer(), namespace_);
      if (!state_->peer_streams->TryAcquire(peer_)) {
        Reject(absl::nullopt,
               grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                            absl::StrCat("too many concurrent streams from ", peer_,
                                         " (--max_streams_per_peer=",
                                         state_->peer_streams->per_peer(), ")")),
               RejectionReason::kPeerStreams);
        return;
      }
      holds_peer_ = true;
    }
    upload_ = std::make_shared<Upload>(state_->backend, state_->store, state_->pool,
                                       IngestLimitsOf(state_->config, *state_->backend),
                                       state_->staging, state_->io_pool);
    if (state_->metrics != nullptr) {
      upload_->set_compress_observer(
          [metrics = state_->metrics](int delta) { metrics->AddCompressionsRunning(delta); });
    }
    Read();
  }

  void ReadDone(bool ok) {
    if (!watch_->Disarm()) {
      // The reaper ended the stream while this read was outstanding: discard the upload.
      CloseExternal().IgnoreError();
      upload_->Abort();
      return;
    }
    if (!ok) {
      // External payload: no transfer thread touches the upload after this.
      absl::Status transferred = CloseExternal();
      if (context_->IsCancelled()) {
        upload_->Abort();
        FinishOnce(grpc::Status(grpc::StatusCode::CANCELLED, "upload cancelled"));
        return;
      }
      if (!transferred.ok()) {
        return FinishWithError(ToGrpc(transferred),
                               transferred.code() == absl::StatusCode::kInvalidArgument
                                   ? absl::make_optional(RejectionReason::kInvalidArgument)
                                   : absl::nullopt);
      }
      if (state_->metrics && external_) {
        state_->metrics->AddIngestBytes(external_->delivered_bytes());
      }
      // Clean end of stream: the upload finishes when its last layer is compressed. The
      // callback runs on a pool thread; the stream may have ended meanwhile (cancelled, stopped).
      upload_->Finish([link = link_](absl::StatusOr<kvcache::v1::PutCacheResponse> result) {
        absl::MutexLock lock(&link->mu);
        if (link->reactor != nullptr) link->reactor->OnUploadDone(std::move(result));
      });
      return;
    }
    absl::StatusOr<RawPutRequest> req = ParsePutRequest(&request_);
    if (!req.ok()) return FinishWithError(ToGrpc(req.status()), RejectionReason::kInvalidArgument);
    absl::Status s;
    if (req->kind == RawPutRequest::Kind::kHeader) {
      if (upload_->has_header()) {
        return FinishWithError(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                            "header: a second PutCacheHeader in one stream"),
                               RejectionReason::kInvalidArgument);
      }
      if (req->data_size > 0) {
        return FinishWithError(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                            "data: must be empty in the header message"),
                               RejectionReason::kInvalidArgument);
      }
      s = upload_->OnHeader(req->header, namespace_ + req->header.cache_id());
      if (s.ok() && state_->staging_budget != nullptr) {
        // Reserved from the declared sizes before any byte is staged, so that uploads in flight
        // never stage more than --staging_bytes together.
        // The engine's scratch for this spec is reserved with the staging.
        auto reservation = state_->staging_budget->Reserve(upload_->reserved_bytes());
        if (!reservation.ok()) {
          return FinishWithError(ToGrpc(reservation.status()), RejectionReason::kStaging);
        }
        upload_->HoldStaging(*std::move(reservation));
      }
      if (s.ok() && state_->uploads != nullptr) {
        // DeleteCache of this id and shutdown stop the upload through the table.
        table_key_ =
            state_->uploads->Add(namespace_ + req->header.cache_id(),
                                 [upload = upload_, link = link_](const absl::Status& why) {
                                   upload->Cancel(why);
                                   absl::MutexLock lock(&link->mu);
                                   if (link->reactor != nullptr)
                                     link->reactor->EndStream(ToGrpc(why));
                                 });
      }
      if (s.ok() && req->header.external_payload()) return StartExternal(req->header);
    } else if (req->kind == RawPutRequest::Kind::kChunk) {
      if (!upload_->has_header()) {
        return FinishWithError(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "header: the first message must be a PutCacheHeader, got a chunk"),
            RejectionReason::kInvalidArgument);
      }
      if (external_) {
        return FinishWithError(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "chunk: header.external_payload is set, so this upload's tensors must "
                         "come through KvCacheTransfer, not as chunk messages"),
            RejectionReason::kInvalidArgument);
      }
      s = upload_->OnChunk(*req);
      if (state_->metrics && s.ok()) state_->metrics->AddIngestBytes(req->data_size);
    } else {
      return FinishWithError(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                          "kind: the message has neither header nor chunk"),
                             RejectionReason::kInvalidArgument);
    }
    if (!s.ok()) return FinishWithError(ToGrpc(s));
    Read();
  }

  void UploadDone(absl::StatusOr<kvcache::v1::PutCacheResponse> result) {
    if (!result.ok()) {
      FinishWithError(ToGrpc(result.status(), namespace_));
      return;
    }
    state_->RefreshStoreGauges();
    if (state_->metrics) {
      state_->metrics->ObserveCompressionRatio(result->compression_ratio());
      CompressTimings t;
      t.score = result->compress().score_seconds();
      t.select = result->compress().select_seconds();
      t.pack = result->compress().pack_seconds();
      t.quantize = result->compress().quantize_seconds();
      t.total = result->compress().total_seconds();
      state_->metrics->ObserveCompressTimings(t);
    }
    *response_ = SerializeToByteBuffer(*result);
    FinishOnce(grpc::Status::OK);
  }

  // Waits for the client's next message; the stream is idle until it arrives.
  void Read() {
    watch_->Arm();
    if (!watch_->Run([this] { StartRead(&request_); })) {
      // Ended by the reaper just now: nothing is outstanding, so OnDone follows.
      CloseExternal().IgnoreError();
      upload_->Abort();
    }
  }

  // The reaper's IdleFn (watch lock held, on the reaper's thread): the client sent nothing for
  // `idle`. The outstanding read then fails, and OnReadDone discards the upload.
  void OnIdle(absl::Duration idle) {
    const grpc::Status status(
        grpc::StatusCode::DEADLINE_EXCEEDED,
        absl::StrFormat("no bytes for %.1f s (--stream_idle_seconds=%g): upload discarded",
                        absl::ToDoubleSeconds(idle), state_->config.stream_idle_seconds));
    if (state_->metrics) state_->metrics->RecordRejection(RejectionReason::kStreamIdle);
    rec_.Record(status.error_code());
    Finish(status);
  }

  // Runs one of the reactor's steps (a reaction, the constructor's work, the upload's answer).
  // An exception escaping it (a failed allocation: RESOURCE_EXHAUSTED, anything else: INTERNAL)
  // would be swallowed by gRPC, which then never calls OnDone: FailFromException ends the stream.
  template <typename Step>
  void Guarded(Step&& step) {
    RunNoThrow(step, [this](const absl::Status& s) { FailFromException(s); });
  }

  // Ends the stream after an exception, before anything else that could throw again, and drops
  // the upload.
  void FailFromException(const absl::Status& s) {
    EndStream(ToGrpc(s));
    CloseExternal().IgnoreError();
    if (upload_) upload_->Abort();
  }

  // Fails the stream; the reason for the metric is the explicit one or the upload's.
  void FinishWithError(const grpc::Status& status,
                       absl::optional<RejectionReason> reason = absl::nullopt) {
    if (upload_) {
      // Stop transfer deliveries first: the Upload takes one caller at a time.
      CloseExternal().IgnoreError();
      upload_->Abort();
      if (!reason) reason = MetricReason(upload_->reject_reason());
    }
    Reject(reason, status, absl::nullopt);
  }

  void Reject(absl::optional<RejectionReason> reason, const grpc::Status& status,
              absl::optional<RejectionReason> early) {
    if (state_->metrics) {
      if (reason) state_->metrics->RecordRejection(*reason);
      if (early) state_->metrics->RecordRejection(*early);
    }
    FinishOnce(status);
  }

  // Registers the upload for the transfer service, then tells the client (initial metadata)
  // that tensors may be transferred; the stream stays open until the client closes it.
  void StartExternal(const kvcache::v1::PutCacheHeader& header) {
    if (state_->ingest == nullptr) {
      return FinishWithError(
          grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                       "header.external_payload: kvcd serves no KvCacheTransfer service "
                       "(--transfer=off, or authentication is on)"),
          RejectionReason::kInvalidArgument);
    }
    store_id_ = namespace_ + header.cache_id();
    // A tensor delivered by the transfer service is activity of this stream.
    auto entry =
        state_->ingest->Register(store_id_, upload_, header, state_->config.max_chunk_bytes,
                                 [watch = watch_] { watch->Touch(); });
    if (!entry.ok()) return FinishWithError(ToGrpc(entry.status()));
    external_ = *std::move(entry);
    context_->AddInitialMetadata(transfer::kExternalPayloadMetadataKey, "registered");
    watch_->Arm();
    if (!watch_->Run([this] { StartSendInitialMetadata(); })) return;
    Read();
  }

  // Ends transfer delivery into this upload and unregisters it; returns the first error a
  // transferred tensor caused. OK (and a no-op) for ordinary uploads. Idempotent.
  absl::Status CloseExternal() {
    if (external_ == nullptr) return absl::OkStatus();
    absl::Status s = external_->Close();
    state_->ingest->Unregister(store_id_, external_);
    return s;
  }

  void FinishOnce(const grpc::Status& status) {
    CloseExternal().IgnoreError();
    EndStream(status);
  }

  ServiceState* const state_;
  grpc::CallbackServerContext* const context_;
  grpc::ByteBuffer* const response_;
  RpcRecorder rec_;  // recorded under the watch's lock (End, OnIdle)
  std::shared_ptr<StreamWatch> watch_;
  bool holds_stream_ = false;
  bool holds_peer_ = false;
  std::string peer_;       // PeerKey of the caller
  std::string namespace_;  // store-id prefix of the caller's tenant
  std::shared_ptr<Upload> upload_;
  grpc::ByteBuffer request_;
  // Set once an external_payload header was registered (reactor thread, before any other use).
  std::string store_id_;
  std::shared_ptr<IngestRegistry::Entry> external_;
  const std::shared_ptr<ReactorLink> link_ = std::make_shared<ReactorLink>();
  uint64_t table_key_ = 0;  // in state_->uploads once the header was accepted; 0: not there
};

}  // namespace

grpc::ServerReadReactor<grpc::ByteBuffer>* NewPutCacheReactor(ServiceState* state,
                                                              grpc::CallbackServerContext* context,
                                                              grpc::ByteBuffer* response) {
  return new PutCacheReactor(state, context, response);
}

}  // namespace kvc::server

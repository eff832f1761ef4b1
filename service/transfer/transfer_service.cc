#include <algorithm>
#include <atomic>
#include <map>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvc/transfer.h"
#include "kvc/thread_pool.h"
#include "transfer/transfer_sessions.h"

namespace kvc::transfer {
namespace {

using kvcache::v1::CloseTransferSessionRequest;
using kvcache::v1::CloseTransferSessionResponse;
using kvcache::v1::FetchRequest;
using kvcache::v1::FetchResponse;
using kvcache::v1::OpenTransferSessionRequest;
using kvcache::v1::OpenTransferSessionResponse;
using kvcache::v1::TransferAck;
using kvcache::v1::TransferAnnouncement;

// Records one RPC in the per-method series: started now, handled (with its code and time) once,
// by Done.
class Recorded {
 public:
  Recorded(Metrics* metrics, const char* method)
      : metrics_(metrics), method_(method), start_(absl::Now()) {
    if (metrics_ != nullptr) metrics_->RecordRpcStarted(method_);
  }
  grpc::Status Done(grpc::Status status) {
    if (metrics_ != nullptr && !done_) {
      metrics_->RecordRpc(method_, status.error_code(),
                          absl::ToDoubleSeconds(absl::Now() - start_));
    }
    done_ = true;
    return status;
  }

 private:
  Metrics* const metrics_;
  const char* const method_;
  const absl::Time start_;
  bool done_ = false;
};

// One outstanding read or write of a reactor, awaited by a worker thread: Arm before starting
// the operation, Complete from its OnReadDone/OnWriteDone, Wait on the worker.
class Pending {
 public:
  void Arm() {
    absl::MutexLock lock(&mu_);
    done_ = false;
    armed_ = true;
  }
  // False when nobody armed it (the completion is the reactor's own).
  bool Complete(bool ok) {
    absl::MutexLock lock(&mu_);
    if (!armed_) return false;
    armed_ = false;
    done_ = true;
    ok_ = ok;
    return true;
  }
  // The operation's ok; DEADLINE_EXCEEDED after `timeout`, once `cancel` has made the operation
  // complete (it must not outlive the wait: the buffers are the caller's).
  absl::StatusOr<bool> Wait(absl::Duration timeout, const std::function<void()>& cancel) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) return ok_;
    }
    cancel();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return absl::DeadlineExceededError(
        absl::StrCat("transfer: the client did not keep up for ", absl::FormatDuration(timeout)));
  }

 private:
  absl::Mutex mu_;
  bool armed_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  bool ok_ ABSL_GUARDED_BY(mu_) = false;
};

// Ends streams whose client stays silent too long: a stream waiting for its client's next
// message is armed with a deadline; past it, the watch cancels the call (the pending read then
// completes, and the reactor finishes with DEADLINE_EXCEEDED). One thread for all streams.
// TryCancel may run the call's callbacks inline, OnDone included, so the watch holds no lock
// while it cancels; instead a reactor disarms itself before its call can go away, and Disarm
// waits while the watch is cancelling that call from its own thread.
class IdleWatch {
 public:
  explicit IdleWatch(absl::Duration idle) : idle_(idle) {
    thread_ = std::thread([this] { Loop(); });
  }
  ~IdleWatch() {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    thread_.join();
  }
  absl::Duration idle() const { return idle_; }
  void Arm(grpc::CallbackServerContext* ctx, std::atomic<bool>* fired) {
    absl::MutexLock lock(&mu_);
    armed_[ctx] = {absl::Now() + idle_, fired};
  }
  void Disarm(grpc::CallbackServerContext* ctx) {
    absl::MutexLock lock(&mu_);
    if (std::this_thread::get_id() != thread_.get_id()) {  // inline in TryCancel: no wait
      struct Args {
        IdleWatch* w;
        grpc::CallbackServerContext* ctx;
      } args{this, ctx};
      mu_.Await(absl::Condition(
          +[](Args* a) ABSL_NO_THREAD_SAFETY_ANALYSIS { return a->w->cancelling_ != a->ctx; },
          &args));
    }
    armed_.erase(ctx);
  }

 private:
  struct Entry {
    absl::Time deadline;
    std::atomic<bool>* fired;
  };
  void Loop() {
    const absl::Duration period = std::clamp(idle_ / 8, absl::Milliseconds(20), absl::Seconds(1));
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stopping_), period)) {
      for (;;) {
        const absl::Time now = absl::Now();
        auto it = std::find_if(armed_.begin(), armed_.end(),
                               [now](const auto& e) { return e.second.deadline <= now; });
        if (it == armed_.end()) break;
        grpc::CallbackServerContext* ctx = it->first;
        it->second.fired->store(true);
        armed_.erase(it);
        cancelling_ = ctx;
        mu_.Unlock();
        ctx->TryCancel();  // valid: its reactor's Disarm waits for cancelling_ to move on
        mu_.Lock();
        cancelling_ = nullptr;
      }
    }
  }

  const absl::Duration idle_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::map<grpc::CallbackServerContext*, Entry> armed_ ABSL_GUARDED_BY(mu_);
  grpc::CallbackServerContext* cancelling_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::thread thread_;
};

class TransferServiceImpl;

// What the stream reactors share: admission, the metrics, the idle watch and finishing once.
template <typename Base>
class StreamReactor : public Base {
 protected:
  StreamReactor(TransferServiceImpl* service, grpc::CallbackServerContext* ctx, const char* method);
  ~StreamReactor() override;
  bool admitted() const { return admitted_; }
  // Finishes the stream once (a second call does nothing). Nothing of the reactor may be touched
  // once Finish has returned: a worker's call may be followed at once by OnDone, which deletes it.
  void FinishWith(const grpc::Status& status) {
    if (finished_) return;
    finished_ = true;
    try {
      this->Finish(rec_.Done(status));
    } catch (...) {  // not finished after all: a retry may still end the stream
      finished_ = false;
      throw;
    }
  }
  // Runs one step of the stream (a reaction, or a worker's job): an exception escaping it ends
  // the stream with its status. gRPC swallows a reaction's exception and then never calls
  // OnDone, and the pool only logs a job's, so either would leave the stream open for good.
  template <typename Step>
  void Guarded(Step&& step) {
    RunNoThrow(step, [this](const absl::Status& s) { FinishWith(ToGrpcStatus(s)); });
  }
  void OnDone() override { delete this; }
  // Around each wait for the client's next message.
  void ArmIdle();
  void DisarmIdle();
  // The status for a read that failed: DEADLINE_EXCEEDED when the idle watch ended the stream.
  grpc::Status ReadFailed(const grpc::Status& otherwise) const;

  TransferServiceImpl* const service_;
  grpc::CallbackServerContext* const ctx_;
  Recorded rec_;
  grpc::Status rejected_;
  std::atomic<bool> idled_out_{false};

 private:
  bool admitted_ = false;
  // Set by FinishWith; the reactions and the worker take turns (one read or write at a time).
  bool finished_ = false;
};

class TransferServiceImpl final : public kvcache::v1::KvCacheTransfer::CallbackService {
 public:
  TransferServiceImpl(const TransferServiceOptions& o, std::unique_ptr<CommunicatorFactory> owned)
      : owned_factory_(std::move(owned)),
        metrics_(o.metrics),
        limits_(o.limits),
        admit_(o.admit_stream),
        release_(o.release_stream),
        sessions_(o.limits,
                  !o.enable_nccl ? nullptr : (o.factory ? o.factory : owned_factory_.get()), o.sink,
                  o.source, o.clock),
        idle_watch_(o.limits.session_idle_timeout),
        pool_(o.worker_threads + 1) {}  // + 1: ThreadPool counts a ParallelFor caller

  grpc::ServerUnaryReactor* OpenTransferSession(grpc::CallbackServerContext* ctx,
                                                const OpenTransferSessionRequest* req,
                                                OpenTransferSessionResponse* resp) override {
    Recorded rpc(metrics_, "OpenTransferSession");
    grpc::Status status;
    absl::StatusOr<OpenTransferSessionResponse> r = sessions_.Open(*req);
    if (r.ok()) {
      *resp = *std::move(r);
    } else {
      status = ToGrpcStatus(r.status());
    }
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(rpc.Done(status));
    return reactor;
  }
  grpc::ServerBidiReactor<TransferAnnouncement, TransferAck>* Transfer(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerBidiReactor<FetchRequest, FetchResponse>* Fetch(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* CloseTransferSession(grpc::CallbackServerContext* ctx,
                                                 const CloseTransferSessionRequest* req,
                                                 CloseTransferSessionResponse*) override {
    Recorded rpc(metrics_, "CloseTransferSession");
    const grpc::Status status =
        ToGrpcStatus(sessions_.Close(req->client_id(), req->session_id(), req->session_secret()));
    grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
    reactor->Finish(rpc.Done(status));
    return reactor;
  }

  Metrics* metrics() const { return metrics_; }
  IdleWatch& idle_watch() { return idle_watch_; }
  const TransferLimits& limits() const { return limits_; }
  TransferSessions& sessions() { return sessions_; }
  kvc::ThreadPool& pool() { return pool_; }
  absl::Status Admit() { return admit_ ? admit_() : absl::OkStatus(); }
  void Release() {
    if (release_) release_();
  }

 private:
  std::unique_ptr<CommunicatorFactory> owned_factory_;
  Metrics* const metrics_;
  const TransferLimits limits_;
  const std::function<absl::Status()> admit_;
  const std::function<void()> release_;
  TransferSessions sessions_;
  IdleWatch idle_watch_;
  // Last: destroyed first, after every reactor is done (the server is shut down before the
  // service is destroyed), running what is queued.
  kvc::ThreadPool pool_;
};

template <typename Base>
StreamReactor<Base>::StreamReactor(TransferServiceImpl* service, grpc::CallbackServerContext* ctx,
                                   const char* method)
    : service_(service), ctx_(ctx), rec_(service->metrics(), method) {
  if (absl::Status s = service_->Admit(); !s.ok()) {
    rejected_ = ToGrpcStatus(s);
    return;
  }
  admitted_ = true;
}

template <typename Base>
StreamReactor<Base>::~StreamReactor() {
  DisarmIdle();
  if (admitted_) service_->Release();
}

template <typename Base>
void StreamReactor<Base>::ArmIdle() {
  service_->idle_watch().Arm(ctx_, &idled_out_);
}

template <typename Base>
void StreamReactor<Base>::DisarmIdle() {
  service_->idle_watch().Disarm(ctx_);
}

template <typename Base>
grpc::Status StreamReactor<Base>::ReadFailed(const grpc::Status& otherwise) const {
  if (idled_out_.load()) {
    return grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED,
                        absl::StrCat("transfer: the client sent nothing for ",
                                     absl::FormatDuration(service_->idle_watch().idle())));
  }
  if (ctx_->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  return otherwise;
}

// Transfer: reads an announcement, hands it to a worker (Handle may block on the data plane),
// writes its acks and reads the next one. While it waits for the client it holds no thread.
class TransferReactor final
    : public StreamReactor<grpc::ServerBidiReactor<TransferAnnouncement, TransferAck>> {
 public:
  TransferReactor(TransferServiceImpl* service, grpc::CallbackServerContext* ctx)
      : StreamReactor(service, ctx, "Transfer") {
    if (!admitted()) {
      FinishWith(rejected_);
      return;
    }
    ArmIdle();
    StartRead(&announcement_);
  }

  void OnReadDone(bool ok) override {
    Guarded([&] {
      DisarmIdle();
      if (!ok) {
        FinishWith(ReadFailed(grpc::Status::OK));
        return;
      }
      service_->pool().Schedule([this] { Guarded([this] { HandleOne(); }); });
    });
  }

  void OnWriteDone(bool ok) override {
    if (posted_.Complete(ok)) return;  // the POSTED ack, awaited by the worker
    Guarded([&] {
      if (!ok) {
        FinishWith(grpc::Status(grpc::StatusCode::CANCELLED, "client gone"));
        return;
      }
      ArmIdle();
      StartRead(&announcement_);
    });
  }

 private:
  // On a worker thread (Guarded: an allocation the announcement asks for may fail).
  void HandleOne() {
    const TransferAnnouncement& a = announcement_;
    auto posted = [&]() -> absl::Status {
      ack_.Clear();
      ack_.set_sequence(a.sequence());
      ack_.set_state(TransferAck::STATE_POSTED);
      posted_.Arm();
      StartWrite(&ack_);
      absl::StatusOr<bool> ok =
          posted_.Wait(service_->limits().recv_timeout, [this] { ctx_->TryCancel(); });
      if (!ok.ok()) return ok.status();
      if (!*ok) return absl::CancelledError("transfer: the client went away");
      return absl::OkStatus();
    };
    absl::StatusOr<uint64_t> n = service_->sessions().Handle(a, posted);
    if (!n.ok()) {
      FinishWith(ToGrpcStatus(n.status()));
      return;
    }
    ack_.Clear();
    ack_.set_sequence(a.sequence());
    ack_.set_state(TransferAck::STATE_RECEIVED);
    ack_.set_received_bytes(*n);
    StartWrite(&ack_);  // OnWriteDone reads the next announcement
  }

  TransferAnnouncement announcement_;
  TransferAck ack_;
  Pending posted_;
};

// Fetch: reads `start`, then runs the whole fetch on a worker, which writes and reads the
// stream through Pending waits (each bounded by recv_timeout: a client that stops reading or
// posting is cancelled rather than holding the worker).
class FetchReactor final
    : public StreamReactor<grpc::ServerBidiReactor<FetchRequest, FetchResponse>> {
 public:
  FetchReactor(TransferServiceImpl* service, grpc::CallbackServerContext* ctx)
      : StreamReactor(service, ctx, "Fetch") {
    if (!admitted()) {
      FinishWith(rejected_);
      return;
    }
    ArmIdle();
    StartRead(&request_);
  }

  void OnReadDone(bool ok) override {
    if (io_.Complete(ok)) return;  // a read of the fetch, awaited by the worker
    Guarded([&] { StartDone(ok); });
  }

  void OnWriteDone(bool ok) override { io_.Complete(ok); }

 private:
  // The start message arrived (or the stream ended first).
  void StartDone(bool ok) {
    DisarmIdle();
    if (!ok) {
      // A message that does not parse (e.g. a cache_id that is not UTF-8) also ends the reads.
      FinishWith(ReadFailed(grpc::Status(
          grpc::StatusCode::INVALID_ARGUMENT,
          "fetch: the stream ended before a start message (or it did not parse: string fields "
          "such as cache_id must be UTF-8)")));
      return;
    }
    if (!request_.has_start()) {
      FinishWith(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                              "fetch: the first message must be start"));
      return;
    }
    start_ = request_.start();
    service_->pool().Schedule([this] { Guarded([this] { Run(); }); });
  }

  // On a worker thread (Guarded). One read or write is outstanding at a time, so one Pending
  // serves both.
  void Run() {
    const absl::Duration timeout = service_->limits().recv_timeout;
    const auto cancel = [this] { ctx_->TryCancel(); };
    TransferSessions::FetchIo io;
    io.write = [&](const FetchResponse& r) -> absl::Status {
      io_.Arm();
      StartWrite(&r);  // `r` outlives the wait
      absl::StatusOr<bool> ok = io_.Wait(timeout, cancel);
      if (!ok.ok()) return ok.status();
      if (!*ok) return absl::CancelledError("fetch: the client went away");
      return absl::OkStatus();
    };
    io.read = [&]() -> absl::StatusOr<FetchRequest> {
      io_.Arm();
      StartRead(&request_);
      absl::StatusOr<bool> ok = io_.Wait(timeout, cancel);
      if (!ok.ok()) return ok.status();
      if (!*ok) {
        return absl::CancelledError("fetch: the client ended the stream before posting a layer");
      }
      return request_;
    };
    FinishWith(ToGrpcStatus(service_->sessions().Fetch(start_, io)));
  }

  FetchRequest request_;
  kvcache::v1::FetchStart start_;
  Pending io_;
};

grpc::ServerBidiReactor<TransferAnnouncement, TransferAck>* TransferServiceImpl::Transfer(
    grpc::CallbackServerContext* ctx) {
  return new TransferReactor(this, ctx);
}

grpc::ServerBidiReactor<FetchRequest, FetchResponse>* TransferServiceImpl::Fetch(
    grpc::CallbackServerContext* ctx) {
  return new FetchReactor(this, ctx);
}

}  // namespace

absl::StatusOr<std::unique_ptr<grpc::Service>> CreateTransferService(
    const TransferServiceOptions& options) {
  if (options.sink == nullptr) return absl::InvalidArgumentError("sink: required");
  const TransferLimits& l = options.limits;
  if (l.max_tensor_bytes == 0) {
    return absl::InvalidArgumentError("limits.max_tensor_bytes: must be > 0");
  }
  if (l.max_sessions < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("limits.max_sessions: ", l.max_sessions, " must be >= 1"));
  }
  if (l.fetch_chunk_bytes == 0) {
    return absl::InvalidArgumentError("limits.fetch_chunk_bytes: must be > 0");
  }
  if (l.join_timeout <= absl::ZeroDuration() || l.recv_timeout <= absl::ZeroDuration() ||
      l.session_idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "limits.join_timeout/recv_timeout/session_idle_timeout: must be > 0");
  }
  if (options.worker_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("worker_threads: ", options.worker_threads, " must be >= 1"));
  }
  std::unique_ptr<CommunicatorFactory> owned;
  if (options.enable_nccl && options.factory == nullptr) {
    owned = CreateNcclCommunicatorFactory(options.device);
  }
  return std::unique_ptr<grpc::Service>(new TransferServiceImpl(options, std::move(owned)));
}

bool NcclTransportAvailable(int device, std::string* why) {
  const absl::Status s = CreateNcclCommunicatorFactory(device)->Available();
  if (!s.ok() && why != nullptr) *why = std::string(s.message());
  return s.ok();
}

}  // namespace kvc::transfer

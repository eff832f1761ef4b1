#include "kvc/transfer_client.h"

#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"

namespace kvc::transfer {

using kvcache::v1::FetchRequest;
using kvcache::v1::FetchResponse;
using kvcache::v1::FetchStart;
using kvcache::v1::OpenTransferSessionRequest;
using kvcache::v1::OpenTransferSessionResponse;
using kvcache::v1::TransferAck;
using kvcache::v1::TransferAnnouncement;
using kvcache::v1::TransferTransport;

// Bounds one blocking operation of a sync gRPC stream, which gRPC can only bound for the whole
// call (a Transfer stream lives for many tensors): Arm before the operation, Disarm after; when
// the deadline comes first the call is cancelled, which ends the operation, and Disarm says so.
// One thread, asleep while nothing is armed.
class TransferClient::StreamTimer {
 public:
  StreamTimer() : thread_([this] { Loop(); }) {}
  ~StreamTimer() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
      cv_.Signal();
    }
    thread_.join();
  }
  void Arm(grpc::ClientContext* ctx, absl::Duration timeout) {
    absl::MutexLock lock(&mu_);
    ctx_ = ctx;
    deadline_ = absl::Now() + timeout;
    fired_ = false;
    cv_.Signal();
  }
  // Whether the deadline came first (the call was cancelled).
  bool Disarm() {
    absl::MutexLock lock(&mu_);
    ctx_ = nullptr;
    return fired_;
  }

 private:
  void Loop() {
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      if (ctx_ != nullptr && absl::Now() >= deadline_) {
        ctx_->TryCancel();
        ctx_ = nullptr;
        fired_ = true;
      }
      cv_.WaitWithDeadline(&mu_, ctx_ != nullptr ? deadline_ : absl::InfiniteFuture());
    }
  }

  absl::Mutex mu_;
  absl::CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  grpc::ClientContext* ctx_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Time deadline_ ABSL_GUARDED_BY(mu_);
  bool fired_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after the members it reads
};

TransferClient::TransferClient(std::shared_ptr<grpc::Channel> channel, Options options)
    : stub_(kvcache::v1::KvCacheTransfer::NewStub(channel)), options_(std::move(options)) {}

TransferClient::~TransferClient() {
  FinishStream().IgnoreError();
  if (comm_ != nullptr) comm_->Close();
}

bool TransferClient::Bounded(grpc::ClientContext* ctx, bool* late,
                             const std::function<bool()>& op) {
  if (timer_ == nullptr) timer_ = std::make_unique<StreamTimer>();
  timer_->Arm(ctx, options_.message_timeout);
  const bool ok = op();
  *late = timer_->Disarm();
  return ok && !*late;
}

absl::Status TransferClient::LateError(const char* what) const {
  return absl::DeadlineExceededError(
      absl::StrCat("transfer: kvcd took longer than ", absl::FormatDuration(options_.message_timeout),
                   " (message_timeout) over ", what, "; the stream was cancelled"));
}

absl::Status TransferClient::OpenSession(TransferTransport t, OpenTransferSessionResponse* resp) {
  OpenTransferSessionRequest req;
  req.set_client_id(options_.client_id);
  req.set_transport(t);
  req.set_session_secret(session_secret_);  // "" unless this client opened the session
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.message_timeout));
  return FromGrpcStatus(stub_->OpenTransferSession(&ctx, req, resp));
}

absl::Status TransferClient::Open() {
  if (stream_ != nullptr) return absl::FailedPreconditionError("transfer client: already open");
  if (options_.message_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("message_timeout: ", absl::FormatDuration(options_.message_timeout),
                     " must be > 0"));
  }
  OpenTransferSessionResponse resp;
  transport_ = kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES;
  fallback_reason_.clear();
  if (options_.factory == nullptr) {
    fallback_reason_ = "this client has no NCCL communicator factory";
  } else if (absl::Status a = options_.factory->Available(); !a.ok()) {
    fallback_reason_ = std::string(a.message());
  } else {
    absl::Status s = OpenSession(kvcache::v1::TRANSFER_TRANSPORT_NCCL, &resp);
    if (s.ok() && resp.reused() && comm_ == nullptr) {
      // The server's cached group was joined by an earlier client object: replace it.
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.message_timeout));
      kvcache::v1::CloseTransferSessionRequest close;
      close.set_client_id(options_.client_id);
      close.set_session_id(resp.session_id());
      close.set_session_secret(resp.session_secret());
      kvcache::v1::CloseTransferSessionResponse ignored;
      stub_->CloseTransferSession(&ctx, close, &ignored);
      s = OpenSession(kvcache::v1::TRANSFER_TRANSPORT_NCCL, &resp);
    }
    if (s.ok()) {
      transport_ = kvcache::v1::TRANSFER_TRANSPORT_NCCL;
      if (!resp.reused()) {
        if (comm_ != nullptr) comm_->Close();  // a group the server no longer has
        comm_.reset();
        absl::StatusOr<std::unique_ptr<Communicator>> c = options_.factory->Join(
            resp.nccl_unique_id(), resp.client_rank(), options_.join_timeout, nullptr);
        if (!c.ok()) return c.status();
        comm_ = *std::move(c);
      }
    } else if (s.code() == absl::StatusCode::kUnavailable ||
               s.code() == absl::StatusCode::kFailedPrecondition) {
      fallback_reason_ = std::string(s.message());
    } else {
      return s;
    }
  }
  if (transport_ == kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES) {
    if (absl::Status s = OpenSession(transport_, &resp); !s.ok()) return s;
  }
  session_id_ = resp.session_id();
  session_secret_ = resp.session_secret();
  next_sequence_ = resp.next_sequence();
  ctx_ = std::make_unique<grpc::ClientContext>();
  stream_ = stub_->Transfer(ctx_.get());
  return absl::OkStatus();
}

absl::Status TransferClient::FinishStream() {
  if (stream_ == nullptr) return absl::OkStatus();
  bool late = false;
  Bounded(ctx_.get(), &late, [&] {
    stream_->WritesDone();
    TransferAck drain;
    while (stream_->Read(&drain)) {
    }
    return true;
  });
  const grpc::Status s = stream_->Finish();  // at once after the reads ended or a cancel
  stream_.reset();
  ctx_.reset();
  if (late) return LateError("the end of the stream");
  return FromGrpcStatus(s);
}

absl::Status TransferClient::ReadAck(uint64_t sequence, TransferAck::State state, uint64_t* bytes) {
  TransferAck ack;
  bool late = false;
  if (!Bounded(ctx_.get(), &late, [&] { return stream_->Read(&ack); })) {
    absl::Status s = FinishStream();
    if (late) return LateError("an ack");
    return s.ok() ? absl::UnavailableError("transfer: stream ended without an ack") : s;
  }
  if (ack.sequence() != sequence || ack.state() != state) {
    FinishStream().IgnoreError();
    return absl::InternalError(
        absl::StrCat("transfer: expected ack ", sequence, "/", TransferAck::State_Name(state),
                     ", got ", ack.sequence(), "/", TransferAck::State_Name(ack.state())));
  }
  if (bytes != nullptr) *bytes = ack.received_bytes();
  return absl::OkStatus();
}

absl::Status TransferClient::Send(const std::string& cache_id, uint32_t layer,
                                  kvcache::v1::TensorKind tensor, const void* data, uint64_t bytes,
                                  const void* ready_event) {
  if (stream_ == nullptr) return absl::FailedPreconditionError("transfer client: not open");
  if (data == nullptr && bytes > 0) return absl::InvalidArgumentError("data: null");
  const bool nccl = transport_ == kvcache::v1::TRANSFER_TRANSPORT_NCCL;
  TransferAnnouncement a;
  a.set_session_id(session_id_);
  a.set_session_secret(session_secret_);
  a.set_sequence(next_sequence_);
  a.set_cache_id(cache_id);
  a.set_layer(layer);
  a.set_tensor(tensor);
  a.set_num_bytes(bytes);
  if (!nccl) a.set_payload(static_cast<const char*>(data), bytes);
  bool late = false;
  if (!Bounded(ctx_.get(), &late, [&] { return stream_->Write(a); })) {
    absl::Status s = FinishStream();
    if (late) return LateError("the announcement");
    return s.ok() ? absl::UnavailableError("transfer: the stream closed") : s;
  }
  if (nccl) {
    // Only after POSTED: a rejected announcement must never leave a send without a receive.
    if (absl::Status s = ReadAck(a.sequence(), TransferAck::STATE_POSTED, nullptr); !s.ok()) {
      return s;
    }
    if (absl::Status s = comm_->SendAfter(data, bytes, ready_event, options_.send_timeout);
        !s.ok()) {
      FinishStream().IgnoreError();
      return s;
    }
  }
  uint64_t received = 0;
  if (absl::Status s = ReadAck(a.sequence(), TransferAck::STATE_RECEIVED, &received); !s.ok()) {
    return s;
  }
  ++next_sequence_;
  if (received != bytes) {
    return absl::InternalError(
        absl::StrCat("transfer: kvcd received ", received, " bytes of ", bytes));
  }
  return absl::OkStatus();
}

absl::Status TransferClient::Fetch(const std::string& cache_id, uint32_t layer_begin,
                                   std::optional<uint32_t> layer_end, const FetchInfoFn& on_info,
                                   const FetchLayerFn& on_layer) {
  if (stream_ == nullptr) return absl::FailedPreconditionError("transfer client: not open");
  const bool nccl = transport_ == kvcache::v1::TRANSFER_TRANSPORT_NCCL;
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<FetchRequest, FetchResponse>> stream =
      stub_->Fetch(&ctx);
  // Ends the stream with `s`; kvcd's status when kvcd ended it first.
  auto fail = [&](absl::Status s) -> absl::Status {
    ctx.TryCancel();
    const grpc::Status g = stream->Finish();
    return g.ok() || g.error_code() == grpc::StatusCode::CANCELLED ? s : FromGrpcStatus(g);
  };
  // Each read and write within message_timeout (Bounded); `late` once one was not.
  bool late = false;
  auto read = [&](FetchResponse* r) {
    return Bounded(&ctx, &late, [&] { return stream->Read(r); });
  };
  auto write = [&](const FetchRequest& r) {
    return Bounded(&ctx, &late, [&] { return stream->Write(r); });
  };
  // The stream ended or broke where a message was due: kvcd's status says why (or the timeout).
  auto ended = [&](const std::string& what) -> absl::Status {
    const grpc::Status g = stream->Finish();
    if (late) return LateError(what.c_str());
    if (!g.ok()) return FromGrpcStatus(g);
    return absl::InternalError(absl::StrCat("fetch: the stream ended before ", what));
  };
  FetchRequest req;
  FetchStart* start = req.mutable_start();
  start->set_session_id(session_id_);
  start->set_session_secret(session_secret_);
  start->set_sequence(next_sequence_);
  start->set_cache_id(cache_id);
  start->set_layer_begin(layer_begin);
  if (layer_end.has_value()) start->set_layer_end(*layer_end);
  if (!write(req)) return ended("the header");
  FetchResponse resp;
  if (!read(&resp)) return ended("the header");
  if (!resp.has_header()) return fail(absl::InternalError("fetch: the first message is no header"));
  ++next_sequence_;  // kvcd accepted the fetch
  const uint32_t begin = resp.header().layer_begin(), end = resp.header().layer_end();
  if (absl::Status s = on_info(resp.header().info(), begin, end); !s.ok()) return fail(s);
  std::vector<uint8_t> blob;
  for (uint32_t layer = begin; layer < end; ++layer) {
    if (!read(&resp)) return ended(absl::StrCat("layer ", layer));
    if (!resp.has_layer() || resp.layer().layer() != layer) {
      return fail(
          absl::InternalError(absl::StrCat("fetch: expected the announcement of layer ", layer)));
    }
    const uint64_t n = resp.layer().num_bytes();
    // One buffer for all layers; every byte of the layer is overwritten by the receive.
    if (blob.size() < n) blob.resize(n);
    if (n > 0 && nccl) {
      FetchRequest posted;
      posted.mutable_posted()->set_layer(layer);
      // Only after the announcement: kvcd sends nothing before it reads this, so a fetch that
      // fails before it never leaves a receive without a send.
      if (!write(posted)) return ended(absl::StrCat("layer ", layer));
      if (absl::Status s = comm_->Recv(blob.data(), n, options_.send_timeout); !s.ok()) {
        // The data plane's state is unknown: this client must be opened again.
        FinishStream().IgnoreError();
        return fail(s);
      }
    } else {
      for (uint64_t offset = 0; offset < n;) {
        if (!read(&resp)) return ended(absl::StrCat("layer ", layer));
        const auto& p = resp.payload();
        if (!resp.has_payload() || p.layer() != layer || p.offset() != offset ||
            p.data().size() > n - offset || p.data().empty()) {
          return fail(absl::InternalError(
              absl::StrCat("fetch: bad payload piece for layer ", layer, " at offset ", offset)));
        }
        std::memcpy(blob.data() + offset, p.data().data(), p.data().size());
        offset += p.data().size();
      }
    }
    if (absl::Status s = on_layer(layer, absl::MakeConstSpan(blob.data(), n)); !s.ok()) {
      return fail(s);
    }
  }
  grpc::Status g;
  Bounded(&ctx, &late, [&] {
    stream->WritesDone();
    g = stream->Finish();
    return true;
  });
  if (late) return LateError("the end of the fetch");
  return FromGrpcStatus(g);
}

absl::StatusOr<TransferClient::FetchedCache> TransferClient::Fetch(
    const std::string& cache_id, uint32_t layer_begin, std::optional<uint32_t> layer_end) {
  FetchedCache out;
  absl::Status s = Fetch(
      cache_id, layer_begin, layer_end,
      [&](const kvcache::v1::CacheInfo& info, uint32_t begin, uint32_t end) {
        out.info = info;
        out.layer_begin = begin;
        out.layers.reserve(end - begin);
        return absl::OkStatus();
      },
      [&](uint32_t, absl::Span<const uint8_t> blob) {
        out.layers.emplace_back(blob.begin(), blob.end());
        return absl::OkStatus();
      });
  if (!s.ok()) return s;
  return out;
}

absl::Status TransferClient::Close() {
  absl::Status s = FinishStream();
  if (session_id_.empty()) return s;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.message_timeout));
  kvcache::v1::CloseTransferSessionRequest req;
  req.set_client_id(options_.client_id);
  req.set_session_id(session_id_);
  req.set_session_secret(session_secret_);
  kvcache::v1::CloseTransferSessionResponse resp;
  absl::Status c = FromGrpcStatus(stub_->CloseTransferSession(&ctx, req, &resp));
  session_id_.clear();
  session_secret_.clear();
  if (comm_ != nullptr) {
    comm_->Close();
    comm_.reset();
  }
  return s.ok() ? c : s;
}

}  // namespace kvc::transfer

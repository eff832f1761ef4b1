#include "transfer/transfer_sessions.h"

#include <atomic>
#include <memory>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"

namespace kvc::transfer {

using kvcache::v1::OpenTransferSessionRequest;
using kvcache::v1::OpenTransferSessionResponse;
using kvcache::v1::TransferAnnouncement;
using kvcache::v1::TransferTransport;

namespace {

constexpr size_t kMaxClientIdBytes = 128;
constexpr size_t kMaxCacheIdBytes = 256;

std::string RandomSessionId() {
  static absl::Mutex mu(absl::kConstInit);
  static std::mt19937_64* rng = new std::mt19937_64(std::random_device{}());
  absl::MutexLock lock(&mu);
  std::string raw(16, '\0');
  for (char& c : raw) c = static_cast<char>((*rng)() & 0xff);
  return absl::BytesToHexString(raw);
}

}  // namespace

struct TransferSessions::Session {
  std::string id, client_id;
  TransferTransport transport = kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES;
  std::string unique_id;

  // NCCL group: set once by the background join; cancel_join aborts a join still waiting.
  absl::Notification cancel_join;
  absl::Notification joined;
  absl::Status join_status;  // written before `joined` is notified
  std::unique_ptr<Communicator> comm;

  // Serializes the tensors of this session (concurrent streams cannot interleave sequences).
  absl::Mutex io_mu;
  // Written under io_mu; read without it by Open, which must not wait for a tensor in flight.
  std::atomic<uint64_t> next_sequence{0};
  // NCCL receive buffer of staging_bytes, reused by every tensor (at most max_tensor_bytes).
  // Nothing else of a session grows with the tensors it carries: a repeated tensor is the sink's to
  // refuse (see TransferSink), as only the sink knows where one upload ends and the next begins.
  std::unique_ptr<uint8_t[]> staging ABSL_GUARDED_BY(io_mu);
  uint64_t staging_bytes ABSL_GUARDED_BY(io_mu) = 0;

  absl::Mutex state_mu;
  bool closed ABSL_GUARDED_BY(state_mu) = false;

  bool IsClosed() {
    absl::MutexLock lock(&state_mu);
    return closed;
  }
  // Closes the communicator once the join is over (joins are bounded by join_timeout).
  void CloseNow() {
    {
      absl::MutexLock lock(&state_mu);
      if (closed) return;
      closed = true;
    }
    if (!cancel_join.HasBeenNotified()) cancel_join.Notify();
    if (joined.HasBeenNotified() && comm != nullptr) comm->Close();
  }
};

TransferSessions::TransferSessions(TransferLimits limits, CommunicatorFactory* factory,
                                   TransferSink* sink)
    : limits_(limits), factory_(factory), sink_(sink) {}

TransferSessions::~TransferSessions() {
  std::vector<std::thread> joiners;
  std::map<std::string, std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    joiners.swap(joiners_);
    sessions.swap(by_id_);
    by_client_.clear();
  }
  for (auto& [id, s] : sessions) s->CloseNow();
  for (std::thread& t : joiners) t.join();
  // Pending joins were cancelled by CloseNow(); ones that finished after it closed their
  // communicator themselves.
}

int TransferSessions::size() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(by_id_.size());
}

absl::StatusOr<uint64_t> TransferSessions::RetainedBytes(const std::string& session_id) const {
  std::shared_ptr<Session> s = Find(session_id);
  if (s == nullptr) {
    return absl::NotFoundError(absl::StrCat("session_id: unknown session '", session_id, "'"));
  }
  absl::MutexLock io(&s->io_mu);
  return s->staging_bytes;
}

std::shared_ptr<TransferSessions::Session> TransferSessions::Find(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : it->second;
}

void TransferSessions::Drop(const std::shared_ptr<Session>& s) {
  {
    absl::MutexLock lock(&mu_);
    auto it = by_id_.find(s->id);
    if (it != by_id_.end() && it->second == s) by_id_.erase(it);
    auto jt = by_client_.find(s->client_id);
    if (jt != by_client_.end() && jt->second == s) by_client_.erase(jt);
  }
  s->CloseNow();
}

absl::StatusOr<OpenTransferSessionResponse> TransferSessions::Open(
    const OpenTransferSessionRequest& request) {
  const std::string& client = request.client_id();
  if (client.empty() || client.size() > kMaxClientIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("client_id: must be 1 to ", kMaxClientIdBytes, " bytes, got ", client.size()));
  }
  TransferTransport transport = request.transport();
  if (transport == kvcache::v1::TRANSFER_TRANSPORT_UNSPECIFIED) {
    transport = kvcache::v1::TRANSFER_TRANSPORT_NCCL;
  }
  if (transport != kvcache::v1::TRANSFER_TRANSPORT_NCCL &&
      transport != kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES) {
    return absl::InvalidArgumentError(
        absl::StrCat("transport: unknown value ", static_cast<int>(transport)));
  }
  const bool nccl = transport == kvcache::v1::TRANSFER_TRANSPORT_NCCL;
  if (nccl) {
    if (factory_ == nullptr) {
      return absl::UnavailableError("nccl transport unavailable: disabled on this server");
    }
    if (absl::Status s = factory_->Available(); !s.ok()) return s;
  }

  std::shared_ptr<Session> old;
  {
    absl::MutexLock lock(&mu_);
    auto it = by_client_.find(client);
    if (it != by_client_.end()) old = it->second;
  }
  if (old != nullptr) {
    const bool healthy =
        !old->IsClosed() && (!old->joined.HasBeenNotified() || old->join_status.ok());
    if (old->transport == transport && healthy) {
      OpenTransferSessionResponse r;
      r.set_session_id(old->id);
      r.set_transport(old->transport);
      r.set_nccl_unique_id(old->unique_id);
      r.set_server_rank(0);
      r.set_client_rank(1);
      r.set_reused(true);
      r.set_max_tensor_bytes(limits_.max_tensor_bytes);
      r.set_next_sequence(old->next_sequence.load());
      return r;
    }
    Drop(old);  // another transport, or a broken group: replace it
  }

  auto s = std::make_shared<Session>();
  s->id = RandomSessionId();
  s->client_id = client;
  s->transport = transport;
  if (nccl) {
    absl::StatusOr<std::string> uid = factory_->NewUniqueId();
    if (!uid.ok()) return uid.status();
    s->unique_id = *std::move(uid);
  }
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int>(by_id_.size()) >= limits_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "transfer sessions: ", by_id_.size(), " open, the limit is ", limits_.max_sessions));
    }
    by_id_[s->id] = s;
    by_client_[client] = s;
    if (nccl) {
      // Rank 0 joins in the background: the join completes only when the client joins as rank 1
      // after reading this response.
      joiners_.emplace_back([s, factory = factory_, timeout = limits_.join_timeout] {
        absl::StatusOr<std::unique_ptr<Communicator>> c =
            factory->Join(s->unique_id, 0, timeout, &s->cancel_join);
        if (c.ok()) {
          s->comm = *std::move(c);
        } else {
          s->join_status = c.status();
        }
        s->joined.Notify();
        if (s->IsClosed() && s->comm != nullptr) s->comm->Close();
      });
    }
  }
  OpenTransferSessionResponse r;
  r.set_session_id(s->id);
  r.set_transport(transport);
  r.set_nccl_unique_id(s->unique_id);
  r.set_server_rank(0);
  r.set_client_rank(1);
  r.set_reused(false);
  r.set_max_tensor_bytes(limits_.max_tensor_bytes);
  r.set_next_sequence(0);
  return r;
}

absl::StatusOr<uint64_t> TransferSessions::Handle(const TransferAnnouncement& a,
                                                  const std::function<absl::Status()>& posted) {
  std::shared_ptr<Session> s = Find(a.session_id());
  if (s == nullptr) {
    return absl::NotFoundError(absl::StrCat("session_id: unknown session '", a.session_id(), "'"));
  }
  absl::MutexLock io(&s->io_mu);
  if (s->IsClosed()) {
    return absl::NotFoundError(
        absl::StrCat("session_id: session '", a.session_id(), "' is closed"));
  }
  const uint64_t expected = s->next_sequence.load();
  if (a.sequence() < expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence: ", a.sequence(), " was already handled (duplicate); expected ", expected));
  }
  if (a.sequence() > expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence: ", a.sequence(), " is out of order; expected ", expected));
  }
  if (a.cache_id().empty() || a.cache_id().size() > kMaxCacheIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cache_id: must be 1 to ", kMaxCacheIdBytes,
                                                   " bytes, got ", a.cache_id().size()));
  }
  if (a.tensor() != kvcache::v1::TENSOR_K && a.tensor() != kvcache::v1::TENSOR_V &&
      a.tensor() != kvcache::v1::TENSOR_Q_OBS) {
    return absl::InvalidArgumentError(absl::StrCat("tensor: ", static_cast<int>(a.tensor()),
                                                   " is not TENSOR_K, TENSOR_V or TENSOR_Q_OBS"));
  }
  if (a.num_bytes() == 0 || a.num_bytes() > limits_.max_tensor_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("num_bytes: ", a.num_bytes(), " is outside [1, ",
                                                   limits_.max_tensor_bytes, "]"));
  }
  const bool nccl = s->transport == kvcache::v1::TRANSFER_TRANSPORT_NCCL;
  absl::Span<const uint8_t> bytes;
  if (!nccl) {
    if (a.payload().size() != a.num_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("payload: ", a.payload().size(),
                                                     " bytes, but num_bytes says ", a.num_bytes()));
    }
    bytes = absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(a.payload().data()),
                                a.payload().size());
  } else {
    if (!a.payload().empty()) {
      return absl::InvalidArgumentError("payload: must be empty in an NCCL session");
    }
    if (!s->joined.WaitForNotificationWithTimeout(limits_.join_timeout)) {
      Drop(s);
      return absl::DeadlineExceededError("nccl: the client did not join the group in time");
    }
    if (!s->join_status.ok()) {
      Drop(s);
      return absl::FailedPreconditionError(
          absl::StrCat("nccl: joining the group failed: ", s->join_status.message()));
    }
    if (absl::Status p = posted(); !p.ok()) return p;
    if (s->staging_bytes < a.num_bytes()) {
      // Grows to exactly the largest tensor so far (never past max_tensor_bytes); the bytes are
      // overwritten by the receive, so they are not initialized.
      s->staging = std::make_unique_for_overwrite<uint8_t[]>(a.num_bytes());
      s->staging_bytes = a.num_bytes();
    }
    if (absl::Status r = s->comm->Recv(s->staging.get(), a.num_bytes(), limits_.recv_timeout);
        !r.ok()) {
      Drop(s);  // the group's state is unknown now
      return r;
    }
    bytes = absl::MakeConstSpan(s->staging.get(), a.num_bytes());
  }
  // The bytes are consumed from the data plane either way, so the sequence advances.
  s->next_sequence.store(expected + 1);
  TensorHeader h{s->client_id, a.cache_id(), a.layer(), a.tensor(), a.sequence()};
  if (absl::Status c = sink_->Consume(h, bytes); !c.ok()) return c;
  return static_cast<uint64_t>(bytes.size());
}

absl::Status TransferSessions::Close(const std::string& client_id, const std::string& session_id) {
  std::shared_ptr<Session> s = Find(session_id);
  if (s == nullptr || s->client_id != client_id) {
    return absl::NotFoundError(
        absl::StrCat("session_id: no session '", session_id, "' of client '", client_id, "'"));
  }
  Drop(s);
  return absl::OkStatus();
}

}  // namespace kvc::transfer

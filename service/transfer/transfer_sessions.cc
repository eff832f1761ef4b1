#include "transfer/transfer_sessions.h"

#include <sys/random.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "kvc/thread_pool.h"

namespace kvc::transfer {

using kvcache::v1::FetchRequest;
using kvcache::v1::FetchResponse;
using kvcache::v1::FetchStart;
using kvcache::v1::OpenTransferSessionRequest;
using kvcache::v1::OpenTransferSessionResponse;
using kvcache::v1::TransferAnnouncement;
using kvcache::v1::TransferTransport;

namespace {

constexpr size_t kMaxClientIdBytes = 128;
constexpr size_t kMaxCacheIdBytes = 256;

// Session ids and secrets come from the kernel's CSPRNG: a secret is the only proof of owning a
// session, so it must not be predictable from ids or secrets seen before.
std::string RandomBytes(size_t n) {
  std::string raw(n, '\0');
  size_t got = 0;
  while (got < n) {
    const ssize_t r = getrandom(raw.data() + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      // getrandom only fails on kernels older than 3.17 or with bad arguments; never hand out
      // a guessable secret.
      std::fprintf(stderr, "kvcd: getrandom failed: %s\n", std::strerror(errno));
      std::abort();
    }
    got += static_cast<size_t>(r);
  }
  return raw;
}

// Compares in time that depends only on the lengths (which are not secret: always 16 bytes).
bool SecretEquals(const std::string& a, const std::string& b) {
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  }
  return diff == 0;
}

constexpr size_t kSecretBytes = 16;

}  // namespace

// A stream's turn at its session's data plane (io_mu): the stream doing I/O and at most one
// waiting for it. Every stream waits on a transfer worker, so without the cap one client could
// open stream after stream on its own session and park every worker behind its own transfer,
// while every other client's tensors queued behind them; the streams past the cap are refused
// at once (UNAVAILABLE: the session is busy; a client uses one stream at a time anyway, as
// sequences must follow each other).
class TransferSessions::IoTurn {
 public:
  explicit IoTurn(std::atomic<int>* streams)
      : streams_(streams), ok_(streams->fetch_add(1) < kMaxStreams) {}
  ~IoTurn() { streams_->fetch_sub(1); }
  IoTurn(const IoTurn&) = delete;
  IoTurn& operator=(const IoTurn&) = delete;
  absl::Status status(const std::string& session_id) const {
    if (ok_) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(
        "session_id: session '", session_id, "' is busy: another stream of it is transferring "
        "and one more is waiting; send one tensor at a time per session"));
  }

 private:
  static constexpr int kMaxStreams = 2;
  std::atomic<int>* const streams_;
  const bool ok_;
};

struct TransferSessions::Session {
  std::string id, client_id;
  std::string secret;  // kSecretBytes random bytes, known only to the opener
  // Expiry: the last time the session was used (unix ns), and the uses in flight (a session
  // with one in flight never expires).
  std::atomic<int64_t> last_used_ns{0};
  std::atomic<int> in_flight{0};
  TransferTransport transport = kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES;
  std::string unique_id;

  // NCCL group: set once by the background join; cancel_join aborts a join still waiting.
  absl::Notification cancel_join;
  absl::Notification joined;
  absl::Status join_status;  // written before `joined` is notified
  std::unique_ptr<Communicator> comm;

  // Serializes the tensors of this session (concurrent streams cannot interleave sequences).
  absl::Mutex io_mu;
  // Streams holding or waiting for io_mu (IoTurn): one does I/O, at most one more waits.
  std::atomic<int> io_streams{0};
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

// One use of a session (an announcement, a fetch): holds off expiry while it runs and counts as
// use when it ends.
class TransferSessions::Use {
 public:
  Use(Session* s, const std::function<absl::Time()>& clock) : s_(s), clock_(clock) {
    s_->in_flight.fetch_add(1);
  }
  ~Use() {
    s_->last_used_ns.store(absl::ToUnixNanos(clock_()));
    s_->in_flight.fetch_sub(1);
  }
  Use(const Use&) = delete;
  Use& operator=(const Use&) = delete;

 private:
  Session* const s_;
  const std::function<absl::Time()>& clock_;
};

TransferSessions::TransferSessions(TransferLimits limits, CommunicatorFactory* factory,
                                   TransferSink* sink, TransferSource* source,
                                   std::function<absl::Time()> clock)
    : limits_(limits),
      factory_(factory),
      sink_(sink),
      source_(source),
      clock_(clock ? std::move(clock) : std::function<absl::Time()>([] { return absl::Now(); })) {
  sweeper_ = std::thread([this] { SweepLoop(); });
}

TransferSessions::~TransferSessions() {
  std::vector<std::thread> joiners;
  std::map<std::string, std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  sweeper_.join();
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

bool TransferSessions::Expired(const Session& s, absl::Time now) const {
  return s.in_flight.load() == 0 &&
         now - absl::FromUnixNanos(s.last_used_ns.load()) >= limits_.session_idle_timeout;
}

absl::StatusOr<std::shared_ptr<TransferSessions::Session>> TransferSessions::Authorize(
    const std::string& session_id, const std::string& secret) {
  std::shared_ptr<Session> s = Find(session_id);
  if (s != nullptr && Expired(*s, clock_())) {
    Drop(s);
    s = nullptr;
  }
  if (s == nullptr) {
    return absl::NotFoundError(absl::StrCat("session_id: unknown session '", session_id,
                                            "' (closed, expired or never opened)"));
  }
  if (!SecretEquals(s->secret, secret)) {
    return absl::PermissionDeniedError(absl::StrCat("session_secret: not the secret of session '",
                                                    session_id, "' (only its opener has it)"));
  }
  return s;
}

std::vector<std::shared_ptr<TransferSessions::Session>> TransferSessions::TakeExpiredLocked(
    absl::Time now) {
  std::vector<std::shared_ptr<Session>> expired;
  for (auto it = by_id_.begin(); it != by_id_.end();) {
    if (!Expired(*it->second, now)) {
      ++it;
      continue;
    }
    auto jt = by_client_.find(it->second->client_id);
    if (jt != by_client_.end() && jt->second == it->second) by_client_.erase(jt);
    expired.push_back(it->second);
    it = by_id_.erase(it);
  }
  return expired;
}

int TransferSessions::Sweep() {
  std::vector<std::shared_ptr<Session>> expired;
  {
    absl::MutexLock lock(&mu_);
    expired = TakeExpiredLocked(clock_());
  }
  for (const auto& s : expired) s->CloseNow();
  return static_cast<int>(expired.size());
}

void TransferSessions::SweepLoop() {
  // Often enough that an expired session's communicator and staging buffer do not linger much
  // past its timeout, rarely enough to cost nothing.
  const absl::Duration period =
      std::clamp(limits_.session_idle_timeout / 4, absl::Milliseconds(100), absl::Seconds(10));
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), period)) return;
    }
    // A failed sweep (memory is out) is reported and the next one tries again.
    RunOrReport("kvcd: the transfer session sweep failed", [&] { Sweep(); });
  }
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
  std::vector<std::shared_ptr<Session>> expired;
  {
    absl::MutexLock lock(&mu_);
    expired = TakeExpiredLocked(clock_());
    auto it = by_client_.find(client);
    if (it != by_client_.end()) old = it->second;
  }
  for (const auto& e : expired) e->CloseNow();
  if (old != nullptr) {
    // Only the opener may reuse or replace a session: anyone else learns nothing of it (not its
    // id, not whether it is healthy) and cannot take the client id over.
    if (!SecretEquals(old->secret, request.session_secret())) {
      return AlreadyOpen(client);
    }
    const bool healthy =
        !old->IsClosed() && (!old->joined.HasBeenNotified() || old->join_status.ok());
    if (old->transport == transport && healthy) {
      old->last_used_ns.store(absl::ToUnixNanos(clock_()));
      return Response(*old, /*reused=*/true);
    }
    Drop(old);  // another transport, or a broken group: replace it
  }

  auto s = std::make_shared<Session>();
  s->id = absl::BytesToHexString(RandomBytes(16));
  s->secret = RandomBytes(kSecretBytes);
  s->client_id = client;
  s->transport = transport;
  s->last_used_ns.store(absl::ToUnixNanos(clock_()));
  if (nccl) {
    absl::StatusOr<std::string> uid = factory_->NewUniqueId();
    if (!uid.ok()) return uid.status();
    s->unique_id = *std::move(uid);
  }
  {
    absl::MutexLock lock(&mu_);
    if (by_client_.count(client) > 0) return AlreadyOpen(client);  // a concurrent Open won
    if (static_cast<int>(by_id_.size()) >= limits_.max_sessions) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "transfer sessions: ", by_id_.size(), " open, the limit is ", limits_.max_sessions,
          " (idle ones expire after ", absl::FormatDuration(limits_.session_idle_timeout), ")"));
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
  return Response(*s, /*reused=*/false);
}

absl::Status TransferSessions::AlreadyOpen(const std::string& client_id) const {
  return absl::AlreadyExistsError(absl::StrCat(
      "client_id: '", client_id,
      "' has an open transfer session; only its opener can reuse or close it (with its "
      "session_secret), else it expires after ",
      absl::FormatDuration(limits_.session_idle_timeout), " unused"));
}

OpenTransferSessionResponse TransferSessions::Response(const Session& s, bool reused) const {
  OpenTransferSessionResponse r;
  r.set_session_id(s.id);
  r.set_session_secret(s.secret);
  r.set_transport(s.transport);
  r.set_nccl_unique_id(s.unique_id);
  r.set_server_rank(0);
  r.set_client_rank(1);
  r.set_reused(reused);
  r.set_max_tensor_bytes(limits_.max_tensor_bytes);
  r.set_next_sequence(s.next_sequence.load());
  r.set_fetch_chunk_bytes(limits_.fetch_chunk_bytes);
  r.set_idle_timeout_seconds(
      static_cast<uint64_t>(absl::ToInt64Seconds(limits_.session_idle_timeout)));
  return r;
}

absl::StatusOr<uint64_t> TransferSessions::Handle(const TransferAnnouncement& a,
                                                  const std::function<absl::Status()>& posted) {
  absl::StatusOr<std::shared_ptr<Session>> found = Authorize(a.session_id(), a.session_secret());
  if (!found.ok()) return found.status();
  const std::shared_ptr<Session>& s = *found;
  Use use(s.get(), clock_);
  const IoTurn turn(&s->io_streams);
  if (absl::Status t = turn.status(a.session_id()); !t.ok()) return t;
  absl::MutexLock io(&s->io_mu);
  if (absl::Status q = CheckNext(*s, a.session_id(), a.sequence(), a.cache_id()); !q.ok()) {
    return q;
  }
  if (a.tensor() != kvcache::v1::TENSOR_K && a.tensor() != kvcache::v1::TENSOR_V &&
      a.tensor() != kvcache::v1::TENSOR_Q_OBS && a.tensor() != kvcache::v1::TENSOR_Q_STATS) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor: ", static_cast<int>(a.tensor()),
                     " is not TENSOR_K, TENSOR_V, TENSOR_Q_OBS or TENSOR_Q_STATS"));
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
    if (absl::Status g = AwaitGroup(s); !g.ok()) return g;
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
  // The bytes are consumed from the data plane either way, so the sequence advances (CheckNext
  // made sure it was the next one).
  s->next_sequence.store(a.sequence() + 1);
  TensorHeader h{s->client_id, a.cache_id(), a.layer(), a.tensor(), a.sequence()};
  if (absl::Status c = sink_->Consume(h, bytes); !c.ok()) return c;
  return static_cast<uint64_t>(bytes.size());
}

absl::Status TransferSessions::CheckNext(Session& s, const std::string& session_id,
                                         uint64_t sequence, const std::string& cache_id) {
  if (s.IsClosed()) {
    return absl::NotFoundError(absl::StrCat("session_id: session '", session_id, "' is closed"));
  }
  const uint64_t expected = s.next_sequence.load();
  if (sequence < expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "sequence: ", sequence, " was already handled (duplicate); expected ", expected));
  }
  if (sequence > expected) {
    return absl::InvalidArgumentError(
        absl::StrCat("sequence: ", sequence, " is out of order; expected ", expected));
  }
  if (cache_id.empty() || cache_id.size() > kMaxCacheIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("cache_id: must be 1 to ", kMaxCacheIdBytes, " bytes, got ", cache_id.size()));
  }
  return absl::OkStatus();
}

absl::Status TransferSessions::AwaitGroup(const std::shared_ptr<Session>& s) {
  if (!s->joined.WaitForNotificationWithTimeout(limits_.join_timeout)) {
    Drop(s);
    return absl::DeadlineExceededError("nccl: the client did not join the group in time");
  }
  if (!s->join_status.ok()) {
    Drop(s);
    return absl::FailedPreconditionError(
        absl::StrCat("nccl: joining the group failed: ", s->join_status.message()));
  }
  return absl::OkStatus();
}

absl::Status TransferSessions::Fetch(const FetchStart& f, const FetchIo& io) {
  absl::StatusOr<std::shared_ptr<Session>> found = Authorize(f.session_id(), f.session_secret());
  if (!found.ok()) return found.status();
  const std::shared_ptr<Session>& s = *found;
  Use use(s.get(), clock_);
  if (source_ == nullptr) {
    return absl::FailedPreconditionError("fetch: this server has no cache store to fetch from");
  }
  // The whole fetch holds the session: its data-plane operations must not interleave with
  // another stream's, or the two ranks would match sends and receives in different orders.
  const IoTurn turn(&s->io_streams);
  if (absl::Status t = turn.status(f.session_id()); !t.ok()) return t;
  absl::MutexLock io_lock(&s->io_mu);
  if (absl::Status q = CheckNext(*s, f.session_id(), f.sequence(), f.cache_id()); !q.ok()) {
    return q;
  }
  // The reader holds the entry (kvcd: a store read lease) until the fetch ends.
  absl::StatusOr<std::unique_ptr<CacheReader>> reader = source_->Open(s->client_id, f.cache_id());
  if (!reader.ok()) return reader.status();
  const uint32_t num_layers = (*reader)->num_layers();
  const uint32_t begin = f.layer_begin();
  const uint32_t end = f.has_layer_end() ? f.layer_end() : num_layers;
  if (end > num_layers || begin > end) {
    return absl::InvalidArgumentError(absl::StrCat("layer_begin/layer_end: [", begin, ", ", end,
                                                   ") is not a range within [0, ", num_layers,
                                                   "] of cache '", f.cache_id(), "'"));
  }
  const bool nccl = s->transport == kvcache::v1::TRANSFER_TRANSPORT_NCCL;
  if (nccl && begin < end) {
    if (absl::Status g = AwaitGroup(s); !g.ok()) return g;
  }
  FetchResponse header;
  *header.mutable_header()->mutable_info() = (*reader)->info();
  header.mutable_header()->set_layer_begin(begin);
  header.mutable_header()->set_layer_end(end);
  if (absl::Status w = io.write(header); !w.ok()) return w;
  s->next_sequence.store(f.sequence() + 1);  // CheckNext: it was the next one

  for (uint32_t layer = begin; layer < end; ++layer) {
    // Every block is hashed before the layer is announced: a corrupt layer never reaches the
    // data plane, so the group stays usable after DATA_LOSS.
    absl::StatusOr<absl::Span<const uint8_t>> blob = (*reader)->Layer(layer);
    if (!blob.ok()) return blob.status();
    FetchResponse announce;
    announce.mutable_layer()->set_layer(layer);
    announce.mutable_layer()->set_num_bytes(blob->size());
    if (absl::Status w = io.write(announce); !w.ok()) return w;
    if (blob->empty()) {
      (*reader)->Delivered(0);
      continue;
    }
    if (nccl) {
      absl::StatusOr<FetchRequest> next = io.read();
      if (!next.ok()) return next.status();
      if (!next->has_posted()) {
        return absl::InvalidArgumentError(
            absl::StrCat("fetch: expected posted for layer ", layer, ", got ",
                         next->has_start() ? "a second start" : "an empty request"));
      }
      if (next->posted().layer() != layer) {
        return absl::InvalidArgumentError(absl::StrCat("posted.layer: ", next->posted().layer(),
                                                       " is not the announced layer ", layer));
      }
      if (s->IsClosed()) {
        return absl::NotFoundError(
            absl::StrCat("session_id: session '", f.session_id(), "' is closed"));
      }
      // Stored blobs are host memory; the communicator stages them through its device buffer.
      if (absl::Status r = s->comm->Send(blob->data(), blob->size(), limits_.recv_timeout);
          !r.ok()) {
        Drop(s);  // the group's state is unknown now
        return r;
      }
    } else {
      for (uint64_t offset = 0; offset < blob->size();) {
        const uint64_t n = std::min<uint64_t>(limits_.fetch_chunk_bytes, blob->size() - offset);
        FetchResponse piece;
        piece.mutable_payload()->set_layer(layer);
        piece.mutable_payload()->set_offset(offset);
        piece.mutable_payload()->set_data(reinterpret_cast<const char*>(blob->data() + offset), n);
        if (absl::Status w = io.write(piece); !w.ok()) return w;
        offset += n;
      }
    }
    (*reader)->Delivered(blob->size());
  }
  return absl::OkStatus();
}

absl::Status TransferSessions::Close(const std::string& client_id, const std::string& session_id,
                                     const std::string& secret) {
  std::shared_ptr<Session> s = Find(session_id);
  if (s == nullptr || s->client_id != client_id) {
    return absl::NotFoundError(
        absl::StrCat("session_id: no session '", session_id, "' of client '", client_id, "'"));
  }
  if (!SecretEquals(s->secret, secret)) {
    return absl::PermissionDeniedError(absl::StrCat("session_secret: not the secret of session '",
                                                    session_id, "' (only its opener has it)"));
  }
  Drop(s);
  return absl::OkStatus();
}

}  // namespace kvc::transfer

// The transfer control plane without gRPC: sessions cached per client id, NCCL group setup (kvcd
// makes the unique id and joins as rank 0 in the background), and the per-tensor protocol of
// kvcache/v1/transfer.proto (sequencing, validation, receive, hand-off to a sink) and of its
// fetches (layers of a stored cache read from a source and sent to the client).
// Sessions belong to their opener, who alone gets the session's random 128-bit secret; every
// use of a session must present it (compared in constant time). A session unused for
// limits.session_idle_timeout (nothing in flight) expires: a background sweep closes it, and so
// does the next Open or use that finds it.
// Thread-safe: Open/Close/Handle/Fetch may be called concurrently; the tensors and fetches of one
// session are handled one at a time, in sequence order.
#ifndef KVC_SERVICE_TRANSFER_TRANSFER_SESSIONS_H_
#define KVC_SERVICE_TRANSFER_TRANSFER_SESSIONS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvc/transfer.h"

namespace kvc::transfer {

class TransferSessions {
 public:
  // `factory` may be null (NCCL sessions then answer UNAVAILABLE); `sink` must outlive this;
  // `source` (may be null: fetches answer FAILED_PRECONDITION) too. `clock` (null: absl::Now)
  // decides expiry; tests inject one.
  TransferSessions(TransferLimits limits, CommunicatorFactory* factory, TransferSink* sink,
                   TransferSource* source = nullptr, std::function<absl::Time()> clock = nullptr);
  ~TransferSessions();  // closes every session, stops the sweep and joins the background joins
  TransferSessions(const TransferSessions&) = delete;
  TransferSessions& operator=(const TransferSessions&) = delete;

  // INVALID_ARGUMENT for a bad client_id or transport; UNAVAILABLE / FAILED_PRECONDITION (with
  // the reason) when NCCL is asked for and cannot be used; RESOURCE_EXHAUSTED at max_sessions
  // live ones (expired ones are reclaimed first). A client id's open session is returned again
  // (reused = true, same transport) or replaced (another transport, or a broken group) only
  // when the request carries its session_secret; otherwise ALREADY_EXISTS, and nothing about
  // that session is revealed. A new session's response carries its secret.
  absl::StatusOr<kvcache::v1::OpenTransferSessionResponse> Open(
      const kvcache::v1::OpenTransferSessionRequest& request);

  // Handles one announcement: validates it against the session (NOT_FOUND for an unknown or
  // expired session, PERMISSION_DENIED for a wrong session_secret; INVALID_ARGUMENT naming the
  // field for a duplicate or out-of-order sequence, a bad cache_id, tensor kind or size, or a
  // payload that does not match the transport or num_bytes), then NCCL: waits for the group, calls
  // `posted()` (which sends the POSTED ack; its error aborts) and receives; GRPC_BYTES: takes the
  // payload. Then the sink, which alone decides whether a (cache_id, layer, tensor) was already
  // received by the upload it belongs to: a session keeps no record of the tensors it carried, so
  // it serves any number of uploads (and re-uploads of one cache id) in constant memory. Returns
  // the bytes received. A data-plane failure closes the session (the next Open makes a new group).
  absl::StatusOr<uint64_t> Handle(const kvcache::v1::TransferAnnouncement& a,
                                  const std::function<absl::Status()>& posted);

  // The stream side of one Fetch: `write` sends a response (its error aborts the fetch),
  // `read` waits for the client's next request (an error: the client ended the stream).
  struct FetchIo {
    std::function<absl::Status(const kvcache::v1::FetchResponse&)> write;
    std::function<absl::StatusOr<kvcache::v1::FetchRequest>()> read;
  };

  // Serves one fetch (kvcache/v1/transfer.proto): validates `start` like an announcement
  // (session, secret, sequence, cache_id), opens the cache through the source, checks the layer
  // range, writes the header (the sequence then advances), then each layer: announced once the
  // source verified it, then sent over the data plane after the client's FetchPosted (NCCL) or in
  // pieces of fetch_chunk_bytes (GRPC_BYTES). Holds the session for the whole fetch (its
  // announcements wait). Errors as the proto file says; a data-plane failure closes the session.
  absl::Status Fetch(const kvcache::v1::FetchStart& start, const FetchIo& io);

  // NOT_FOUND when no such session belongs to client_id; PERMISSION_DENIED for a wrong secret.
  absl::Status Close(const std::string& client_id, const std::string& session_id,
                     const std::string& secret);

  // Closes every expired session now (the background sweep calls it too); returns how many.
  int Sweep();

  int size() const;  // sessions held, expired ones not yet swept included

  // Memory a session holds besides its fixed fields: the size of its NCCL receive buffer, which
  // is the largest tensor it received (so at most max_tensor_bytes; 0 for GRPC_BYTES).
  // It does not grow with the number of tensors or uploads carried. NOT_FOUND for an unknown
  // session. Waits for a tensor of that session in flight.
  absl::StatusOr<uint64_t> RetainedBytes(const std::string& session_id) const;

 private:
  struct Session;
  class IoTurn;
  class Use;
  std::shared_ptr<Session> Find(const std::string& session_id) const;
  // The session, if `secret` is its own and it has not expired: NOT_FOUND / PERMISSION_DENIED.
  absl::StatusOr<std::shared_ptr<Session>> Authorize(const std::string& session_id,
                                                     const std::string& secret);
  bool Expired(const Session& s, absl::Time now) const;
  absl::Status AlreadyOpen(const std::string& client_id) const;
  kvcache::v1::OpenTransferSessionResponse Response(const Session& s, bool reused) const;
  // Removes the expired sessions from the maps (mu_ held) and returns them, to be closed after.
  std::vector<std::shared_ptr<Session>> TakeExpiredLocked(absl::Time now)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepLoop();
  void Drop(const std::shared_ptr<Session>& s);
  // NCCL: waits for the session's group; a failed or late join drops the session.
  absl::Status AwaitGroup(const std::shared_ptr<Session>& s);
  // What an announcement and a fetch both need, checked in this order with s.io_mu held:
  // NOT_FOUND when the session is closed; INVALID_ARGUMENT unless `sequence` is its next one and
  // cache_id is 1 to 256 bytes.
  static absl::Status CheckNext(Session& s, const std::string& session_id, uint64_t sequence,
                                const std::string& cache_id);

  const TransferLimits limits_;
  CommunicatorFactory* const factory_;
  TransferSink* const sink_;
  TransferSource* const source_;
  const std::function<absl::Time()> clock_;
  mutable absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;
  std::map<std::string, std::shared_ptr<Session>> by_id_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<Session>> by_client_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> joiners_ ABSL_GUARDED_BY(mu_);
};

}  // namespace kvc::transfer

#endif  // KVC_SERVICE_TRANSFER_TRANSFER_SESSIONS_H_

// The data plane of kvcd's transfer path (server side kvc/transfer.h, client side
// kvc/transfer_client.h): a 2-rank point-to-point channel between kvcd (rank 0) and one client
// (rank 1), behind an interface so that the control plane can be tested with an in-process fake.
// No gRPC here: GPU test binaries use it alone.
#ifndef KVC_COMMUNICATOR_H_
#define KVC_COMMUNICATOR_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"

namespace kvc::transfer {

// One endpoint of a joined 2-rank group. Send and Recv move exactly `bytes` bytes and must be
// matched by the peer's Recv/Send of the same size, in the same order. Buffers may be host or
// device memory (an implementation that needs device memory stages host buffers itself).
//
// Device memory is read (Send) and written (Recv) by work the communicator orders on its own
// stream. Bytes that GPU work on another stream produces must be complete before that read:
// either the producer finished before Send is called (its stream or the device synchronized), or
// the caller passes SendAfter an event recorded on the producing stream after that work, which
// the communicator's stream waits on (no host synchronization). When Recv returns OK the bytes
// are in place, device or host.
//
// Thread-compatible: one operation at a time. Close may be called from any thread: an operation
// in flight ends with CANCELLED soon after (NCCL: the group is aborted with ncclCommAbort). The
// destructor closes and waits until an operation in flight has returned.
class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // DEADLINE_EXCEEDED when the peer does not match (or a peer that died does not finish) within
  // `timeout`, an error status when the data plane reports the peer gone (the communicator is
  // unusable after either); CANCELLED after Close.
  virtual absl::Status Send(const void* src, size_t bytes, absl::Duration timeout) = 0;
  virtual absl::Status Recv(void* dst, size_t bytes, absl::Duration timeout) = 0;
  // Send once `ready_event` (a cudaEvent_t, as void* so that this header needs no CUDA; null:
  // none) has completed. Implementations that read only host memory (the test fake) have nothing
  // to wait for; the default forwards to Send.
  virtual absl::Status SendAfter(const void* src, size_t bytes, const void* ready_event,
                                 absl::Duration timeout) {
    return Send(src, bytes, timeout);
  }
  // Aborts pending operations and releases the group; later calls fail with CANCELLED.
  // Idempotent.
  virtual void Close() = 0;
  virtual std::string_view kind() const = 0;  // "nccl", "fake"

 protected:
  Communicator() = default;
};

// Makes groups. Thread-safe.
class CommunicatorFactory {
 public:
  virtual ~CommunicatorFactory() = default;

  // OK when communicators can be made on this machine; otherwise UNAVAILABLE or
  // FAILED_PRECONDITION with the reason (e.g. "libnccl.so.2 not found", "no CUDA device").
  virtual absl::Status Available() = 0;
  // A fresh group id (for NCCL the 128 bytes of an ncclUniqueId).
  virtual absl::StatusOr<std::string> NewUniqueId() = 0;
  // Joins group `unique_id` as `rank` (0 or 1) of 2. Blocks until the peer has joined too, or
  // fails with DEADLINE_EXCEEDED after `timeout`, or with CANCELLED soon after `cancel` (may be
  // null) is notified. INVALID_ARGUMENT for a malformed id or rank.
  virtual absl::StatusOr<std::unique_ptr<Communicator>> Join(const std::string& unique_id, int rank,
                                                             absl::Duration timeout,
                                                             const absl::Notification* cancel) = 0;
};

// Communicators on CUDA device `device`. Send/Recv accept host pointers and device pointers of
// that device (another device's memory is INVALID_ARGUMENT). With both ranks in one process NCCL
// may access a device buffer from the peer GPU directly: cudaMalloc memory is fine once NCCL has
// enabled peer access, memory from a cudaMemPool needs cudaMemPoolSetAccess for the peer device
// (or NCCL_P2P_DIRECT_DISABLE=1 in the environment). Host buffers are staged through a
// device buffer owned by the communicator, grown on demand with stream-ordered allocation
// (cudaMallocFromPoolAsync / cudaFreeAsync on the communicator's stream, from its own pool), so
// that growing it never waits for the whole device (cudaFree would, and with another session's
// NCCL kernel waiting on the same GPU it would wait for that peer's timeout).
std::unique_ptr<CommunicatorFactory> CreateNcclCommunicatorFactory(int device);

// Initial-metadata key kvcd sets (value "registered") on a PutCache stream with external_payload
// once the upload accepts transferred tensors.
inline constexpr char kExternalPayloadMetadataKey[] = "kvc-external-payload";

}  // namespace kvc::transfer

#endif  // KVC_COMMUNICATOR_H_

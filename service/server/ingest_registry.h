// Uploads whose tensors arrive through the transfer service (PutCacheHeader.external_payload):
// while such a PutCache stream is open its Upload is registered here under its store id (the
// tenant-qualified cache id), and the transfer service's sink (TransferIngestSink) writes each
// received tensor into it through the Upload's ordinary chunk path, so a transferred tensor is
// validated exactly like chunks (layer range, tensor kind, size, no byte twice).
//
// Lifecycle of one entry: Register (after the header was accepted) -> any number of Deliver
// calls from transfer threads -> Close (the PutCache stream ended, cleanly or not; later Deliver
// calls answer NOT_FOUND) -> Unregister. After Close returns no transfer thread touches the
// Upload any more, so the stream may Finish or Abort it.
//
// Thread-safety: all methods may be called concurrently. Calls into one Upload are serialized by
// the entry's mutex (Upload requires one caller at a time).
#ifndef KVC_SERVICE_SERVER_INGEST_REGISTRY_H_
#define KVC_SERVICE_SERVER_INGEST_REGISTRY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "kvc/transfer.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/ingest.h"

namespace kvc::server {

class IngestRegistry {
 public:
  class Entry {
   public:
    // Ends delivery: waits for a Deliver in progress, then refuses further ones. Returns the
    // first error a delivered tensor caused (OK if none). Idempotent.
    absl::Status Close();
    uint64_t delivered_bytes() const;

   private:
    friend class IngestRegistry;
    Entry(std::shared_ptr<Upload> upload, const kvcache::v1::PutCacheHeader& header,
          uint64_t max_chunk_bytes);

    const std::shared_ptr<Upload> upload_;
    std::function<void()> on_delivery_;
    uint64_t tensor_bytes_[4] = {0, 0, 0, 0};  // K, V, Q_obs, Q_stats bytes of one layer
    uint32_t num_layers_ = 0;
    const uint64_t max_chunk_bytes_;
    mutable absl::Mutex mu_;
    bool open_ ABSL_GUARDED_BY(mu_) = true;
    absl::Status error_ ABSL_GUARDED_BY(mu_);
    uint64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
  };

  // Registers `upload`, whose OnHeader(header, store_id) succeeded. ABORTED when an upload with
  // the same store id is already registered (two external uploads of one id cannot share the
  // transfer announcements). `max_chunk_bytes` is the Upload's chunk limit: a tensor is handed
  // over in pieces of at most that size. `on_delivery` (optional) runs after each tensor the
  // upload accepted, e.g. to count it as activity of the PutCache stream.
  absl::StatusOr<std::shared_ptr<Entry>> Register(const std::string& store_id,
                                                  std::shared_ptr<Upload> upload,
                                                  const kvcache::v1::PutCacheHeader& header,
                                                  uint64_t max_chunk_bytes,
                                                  std::function<void()> on_delivery = nullptr);
  // Removes `entry` if it is still the one registered under `store_id`; closes it first.
  void Unregister(const std::string& store_id, const std::shared_ptr<Entry>& entry);

  // Writes one whole tensor into the upload registered under `store_id`. NOT_FOUND when none is
  // (never registered, or its stream already ended); INVALID_ARGUMENT when `bytes` is not the
  // tensor's size or the chunk path refuses it (layer, kind, bytes already received);
  // FAILED_PRECONDITION when an earlier tensor of this upload already failed. Any error but
  // NOT_FOUND aborts the upload: its PutCache stream then ends with the first error.
  absl::Status Deliver(const std::string& store_id, uint32_t layer, kvcache::v1::TensorKind tensor,
                       absl::Span<const uint8_t> bytes);

  int size() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

// The transfer service's sink in kvcd: routes every received tensor to the registered upload
// of its cache id. Tensors are looked up without a tenant prefix (kvcd registers the transfer
// service only without authentication). Thread-safe.
class TransferIngestSink final : public transfer::TransferSink {
 public:
  explicit TransferIngestSink(IngestRegistry* registry) : registry_(registry) {}
  absl::Status Consume(const transfer::TensorHeader& header,
                       absl::Span<const uint8_t> bytes) override;

 private:
  IngestRegistry* const registry_;
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_INGEST_REGISTRY_H_

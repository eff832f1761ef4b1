#include "server/transfer_source.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "kvc/compact.h"
#include "server/convert.h"

namespace kvc::server {
namespace {

class LeasedCacheReader final : public transfer::CacheReader {
 public:
  LeasedCacheReader(CacheStore::Lease lease, kvcache::v1::CacheInfo info, Metrics* metrics)
      : lease_(std::move(lease)), info_(std::move(info)), metrics_(metrics) {}

  const kvcache::v1::CacheInfo& info() const override { return info_; }
  uint32_t num_layers() const override {
    return static_cast<uint32_t>(lease_.entry().layers.size());
  }

  absl::StatusOr<absl::Span<const uint8_t>> Layer(uint32_t layer) override {
    const CacheEntry& entry = lease_.entry();
    if (layer >= entry.layers.size()) {
      return absl::OutOfRangeError(
          absl::StrCat("layer ", layer, " is not below ", entry.layers.size()));
    }
    // The whole layer is hashed before any of it goes out: unlike GetCache's chunks, a layer
    // on the data plane is one send, which cannot be cut short at a corrupt block.
    if (absl::Status s = VerifyBlocks(entry, layer, 0, entry.block_checksums[layer].size());
        !s.ok()) {
      return s;
    }
    const auto& blob = entry.layers[layer];
    const absl::Span<const uint8_t> bytes(blob.data(), blob.size());
    // As GetCache PACKED: a blob that hashes right but does not parse was stored unreadable.
    if (absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(bytes); !view.ok()) {
      return absl::DataLossError(absl::StrCat("cache '", entry.id, "': layer ", layer, ": ",
                                              std::string(view.status().message())));
    }
    return bytes;
  }

  void Delivered(uint64_t bytes) override {
    if (metrics_ != nullptr && bytes > 0) metrics_->AddServedBytes(bytes);
  }

 private:
  const CacheStore::Lease lease_;
  const kvcache::v1::CacheInfo info_;
  Metrics* const metrics_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<transfer::CacheReader>> StoreTransferSource::Open(
    const std::string& /*client_id*/, const std::string& cache_id) {
  // Exactly GetCache's rules, so a fetch cannot reach what GetCache would refuse to name.
  if (absl::Status s = ValidateCacheId("start.cache_id", cache_id); !s.ok()) return s;
  absl::StatusOr<CacheStore::Lease> lease = store_->Acquire(cache_id);
  if (!lease.ok()) return lease.status();
  const CacheEntry& entry = lease->entry();
  // Cheap (no hashing): the table must match the entry's checksum before any block is trusted.
  if (absl::Status s = VerifyBlockTable(entry); !s.ok()) return s;
  kvcache::v1::CacheInfo info;
  if (!info.ParseFromString(entry.metadata)) {
    return absl::DataLossError(
        absl::StrCat("cache '", cache_id, "': stored metadata is unreadable"));
  }
  return std::unique_ptr<transfer::CacheReader>(
      new LeasedCacheReader(*std::move(lease), std::move(info), metrics_));
}

void ShareStreamSlots(ServiceState* state, transfer::TransferServiceOptions* options) {
  options->admit_stream = [state]() -> absl::Status {
    if (state->draining) {
      if (state->metrics) state->metrics->RecordRejection(RejectionReason::kDraining);
      return absl::UnavailableError("kvcd is shutting down");
    }
    if (!state->TryAcquireStream()) {
      if (state->metrics) state->metrics->RecordRejection(RejectionReason::kLimit);
      return absl::ResourceExhaustedError(
          absl::StrCat("too many concurrent streams (--max_concurrent_streams=",
                       state->config.max_concurrent_streams, ")"));
    }
    return absl::OkStatus();
  };
  options->release_stream = [state] { state->ReleaseStream(); };
}

}  // namespace kvc::server

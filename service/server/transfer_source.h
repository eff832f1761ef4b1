// The transfer service's source in kvcd (kvc/transfer.h, TransferSource): fetches read stored
// caches from the CacheStore with the guarantees of GetCache FORMAT_PACKED (and its cache id
// rules: a cache_id GetCache refuses is INVALID_ARGUMENT). A fetch holds a read
// lease for its whole duration (the entry is neither evicted nor freed meanwhile), the block
// table is checked when it opens and every checksum block of a layer is hashed before the layer
// is handed out; corruption is DATA_LOSS. Delivered bytes count as kvc_served_bytes_total, as
// GetCache counts its data bytes. Cache ids are used without a tenant prefix (kvcd registers the
// transfer service only without authentication). Thread-safe.
#ifndef KVC_SERVICE_SERVER_TRANSFER_SOURCE_H_
#define KVC_SERVICE_SERVER_TRANSFER_SOURCE_H_

#include <memory>
#include <string>

#include "kvc/cache_store.h"
#include "kvc/metrics.h"
#include "kvc/transfer.h"
#include "server/service_impl.h"

namespace kvc::server {

class StoreTransferSource final : public transfer::TransferSource {
 public:
  // `store` must outlive this and every reader it opens' use of it; `metrics` may be null.
  StoreTransferSource(CacheStore* store, Metrics* metrics) : store_(store), metrics_(metrics) {}

  absl::StatusOr<std::unique_ptr<transfer::CacheReader>> Open(const std::string& client_id,
                                                              const std::string& cache_id) override;

 private:
  CacheStore* const store_;
  Metrics* const metrics_;
};

// Makes the transfer service's Transfer and Fetch streams take --max_concurrent_streams slots
// of `state` (shared with PutCache and GetCache: RESOURCE_EXHAUSTED beyond them, UNAVAILABLE
// while draining, each counted as a rejection). `state` must outlive the service.
void ShareStreamSlots(ServiceState* state, transfer::TransferServiceOptions* options);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_TRANSFER_SOURCE_H_

// CacheStore: the compact caches kvcd holds, under a byte budget, with LRU eviction, TTL expiry,
// read leases and per-entry checksums.
//
// Thread-safety: every method may be called concurrently. Entries are immutable once inserted and
// shared by pointer; a Lease keeps its entry alive and unevictable until the Lease is destroyed.
// A Lease may outlive the store that issued it (its bookkeeping keeps the shared state alive).
//
// Expiry: an entry is expired once `now() >= entry.expires`. Expired entries are invisible
// (Acquire, Peek, List and Delete behave as if they were absent) but keep their bytes until
// ExpireNow sweeps them or Insert evicts them (expired entries are evicted before live ones).
//
// Complexity: Insert, Acquire, Peek, Delete and lease release are O(log n) plus the entries they
// evict; List is O(log n + entries visited); with Options::verify_on_insert, Insert also hashes
// the entry once (outside the lock).
#ifndef KVC_CACHE_STORE_H_
#define KVC_CACHE_STORE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "kvc/bytes.h"

namespace kvc {

// One stored cache. Built by the ingest path, then frozen.
struct CacheEntry {
  std::string id;                  // unique key (already tenant-qualified by the caller)
  std::vector<ByteVector> layers;  // compact layer blobs (kvc/compact.h), in order
  std::string metadata;            // opaque to the store (kvcd keeps a serialized CacheInfo)
  uint64_t input_bytes = 0;        // uncompressed K+V bytes, for ratios and metrics
  absl::Time created;
  absl::Time expires = absl::InfiniteFuture();
  uint64_t checksum = 0;  // set by FinalizeEntry
  // The hash of every checksum block, [layer][block]; they sum to `checksum`. Readers verify the
  // blocks they are about to serve against it (VerifyBlocks), so a GetCache hashes each block
  // just before sending it instead of the whole cache up front. Set by FinalizeEntry.
  std::vector<std::vector<uint64_t>> block_checksums;

  // Bytes charged against the budget: layer blobs + metadata + id.
  uint64_t ChargedBytes() const;
};

// The checksum of a cache (CacheEntry::checksum, CacheInfo.checksum): each layer blob is cut into
// consecutive blocks of kChecksumBlockBytes (the last may be shorter; an empty blob has none);
// block i of layer l hashes to XXH3-64 with seed (l << 32) + i; the checksum is the sum of all
// block hashes modulo 2^64. The seeds tie each block to its place, and a sum can be accumulated
// in any order, so ingest hashes every block as soon as it is written, while it is still in
// cache, and layers that finish out of order need not wait for each other.
inline constexpr size_t kChecksumBlockBytes = size_t{64} << 10;
// The seed of block `block` of layer `layer`.
inline uint64_t ChecksumSeed(uint32_t layer, uint64_t block) {
  return (uint64_t{layer} << 32) + block;
}
// The hash of block `block` of `blob` (layer `layer`); requires block * kChecksumBlockBytes <
// blob.size().
uint64_t ChecksumBlock(uint32_t layer, absl::Span<const uint8_t> blob, uint64_t block);
// The hash of every block of one layer, in order (its entry of CacheEntry::block_checksums).
std::vector<uint64_t> ChecksumLayerBlocks(uint32_t layer, absl::Span<const uint8_t> blob);
// Number of checksum blocks of a blob of `bytes` bytes.
inline uint64_t NumChecksumBlocks(uint64_t bytes) {
  return (bytes + kChecksumBlockBytes - 1) / kChecksumBlockBytes;
}

// Computes and stores the block table and the checksum.
void FinalizeEntry(CacheEntry& entry);
// OK when the blobs hash to the stored checksum (and to the block table, when there is one);
// DATA_LOSS otherwise.
absl::Status VerifyEntry(const CacheEntry& entry);
// OK when the block table has a row per layer and an entry per block and sums to the checksum
// (cheap: no hashing); DATA_LOSS otherwise. Readers check it once before VerifyBlocks.
absl::Status VerifyBlockTable(const CacheEntry& entry);
// OK when blocks [begin, end) of layer `layer` hash to the block table (which VerifyBlockTable
// accepted); DATA_LOSS naming the layer and block otherwise.
absl::Status VerifyBlocks(const CacheEntry& entry, size_t layer, uint64_t begin, uint64_t end);

enum class EvictionReason { kCapacity, kTtl, kOverwrite, kDeleted };
const char* EvictionReasonName(EvictionReason r);  // "capacity", "ttl", "overwrite", "deleted"

class CacheStore {
 public:
  struct Options {
    uint64_t capacity_bytes = uint64_t{1} << 30;  // must be > 0
    // Called (without locks held, on the thread of the call that removed the entry) for each
    // entry removed other than by Delete: kCapacity and kTtl from Insert, kOverwrite from Insert
    // with overwrite, kTtl from ExpireNow. May call back into the store. Optional.
    std::function<void(const CacheEntry&, EvictionReason)> on_evict;
    // Clock, replaceable in tests; must not be empty. Called without locks held.
    std::function<absl::Time()> now = [] { return absl::Now(); };
    // Whether Insert recomputes the checksum and rejects a mismatch. false trusts `checksum` as
    // given: only for callers that computed it from the very bytes they insert (kvcd's ingest
    // hashes each layer as it finishes), sparing a serial pass over the entry. Readers that must
    // not serve corrupt data still call VerifyEntry before serving.
    bool verify_on_insert = true;
  };

  struct Stats {
    uint64_t used_bytes = 0;  // includes deleted/evicted entries still held by a lease
    uint64_t capacity_bytes = 0;
    uint64_t entries = 0;       // entries in the index, expired-but-unswept included
    uint64_t leased_bytes = 0;  // part of used_bytes held by leases (not evictable now)
  };

  // A read lease: while it lives, the entry is neither evicted nor freed.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = default;
    ~Lease();
    const CacheEntry& entry() const { return *entry_; }
    const CacheEntry* operator->() const { return entry_.get(); }

   private:
    friend class CacheStoreImpl;
    std::shared_ptr<const CacheEntry> entry_;
    std::shared_ptr<void> release_;  // runs the store's bookkeeping on destruction
  };

  // INVALID_ARGUMENT when capacity_bytes is 0 or `now` is empty.
  static absl::StatusOr<std::unique_ptr<CacheStore>> Create(const Options& options);
  virtual ~CacheStore() = default;
  CacheStore(const CacheStore&) = delete;
  CacheStore& operator=(const CacheStore&) = delete;

  // Inserts a finalized entry, evicting least-recently-used unleased entries (and expired ones
  // first) to make room. Errors change nothing:
  //   ALREADY_EXISTS      the id exists and !overwrite
  //   RESOURCE_EXHAUSTED  the entry exceeds the capacity, or cannot fit without evicting leased
  //                       entries
  //   INVALID_ARGUMENT    null entry, empty id, checksum mismatch (checked only with
  //                       Options::verify_on_insert), or `expires` not in the future
  // An expired entry with the same id does not count as existing (it is evicted with kTtl).
  // Overwriting a leased entry is allowed: it leaves the index at once, but its bytes stay
  // charged until its last lease ends, so they cannot make room for the new entry.
  virtual absl::Status Insert(std::shared_ptr<const CacheEntry> entry, bool overwrite) = 0;

  // Whether an entry of `bytes` could be inserted now (for early rejection before an upload):
  // OK or RESOURCE_EXHAUSTED. Advisory: concurrent calls may change the answer.
  virtual absl::Status CheckCanFit(uint64_t bytes) const = 0;

  // Leases an entry and marks it most recently used. NOT_FOUND when absent or expired.
  virtual absl::StatusOr<Lease> Acquire(const std::string& id) = 0;

  // Metadata access without touching LRU order. NOT_FOUND when absent or expired.
  virtual absl::StatusOr<std::shared_ptr<const CacheEntry>> Peek(const std::string& id) const = 0;

  // Removes an entry; returns the bytes it was charged. Memory is released when the last lease
  // ends. NOT_FOUND when absent or expired. Does not call on_evict.
  virtual absl::StatusOr<uint64_t> Delete(const std::string& id) = 0;

  // Entries with ids starting with `prefix` and greater than `start_after`, ordered by id, at most
  // `limit` of them (0 yields none). Expired entries are skipped.
  virtual std::vector<std::shared_ptr<const CacheEntry>> List(const std::string& prefix,
                                                              const std::string& start_after,
                                                              size_t limit) const = 0;

  // Drops expired entries (leased ones leave the index; their bytes stay charged until released);
  // returns how many. kvcd calls it periodically.
  virtual size_t ExpireNow() = 0;

  virtual Stats GetStats() const = 0;

 protected:
  CacheStore() = default;
};

}  // namespace kvc

#endif  // KVC_CACHE_STORE_H_

// CacheStore implementation.
//
// Every indexed entry lives in exactly one of two groups:
//   idle    (no lease): in the LRU list and the idle expiry set; its bytes count as evictable.
//   leased  (>= 1 lease): only in the leased expiry set; never a victim.
// Moving an entry between groups on the first lease / last release is O(log n), so choosing a
// victim never scans past leased entries. Entries removed from the index while leased (Delete,
// overwrite, TTL sweep) stay alive through their leases, and their bytes stay in `used` until the
// last lease ends: that memory really is still held.
#include "kvc/cache_store.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <list>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "kvc/status_macros.h"
#include "kvc/xxh3.h"
#include "store/annotated_lock.h"

namespace kvc {

uint64_t CacheEntry::ChargedBytes() const {
  uint64_t total = id.size() + metadata.size();
  for (const auto& layer : layers) total += layer.size();
  return total;
}

uint64_t ChecksumBlock(uint32_t layer, absl::Span<const uint8_t> blob, uint64_t block) {
  const size_t at = block * kChecksumBlockBytes;
  return Xxh3(blob.data() + at, std::min(kChecksumBlockBytes, blob.size() - at),
              ChecksumSeed(layer, block));
}

std::vector<uint64_t> ChecksumLayerBlocks(uint32_t layer, absl::Span<const uint8_t> blob) {
  std::vector<uint64_t> blocks(NumChecksumBlocks(blob.size()));
  for (uint64_t i = 0; i < blocks.size(); ++i) blocks[i] = ChecksumBlock(layer, blob, i);
  return blocks;
}

void FinalizeEntry(CacheEntry& entry) {
  entry.block_checksums.clear();
  entry.checksum = 0;
  for (size_t l = 0; l < entry.layers.size(); ++l) {
    entry.block_checksums.push_back(ChecksumLayerBlocks(static_cast<uint32_t>(l), entry.layers[l]));
    for (uint64_t h : entry.block_checksums.back()) entry.checksum += h;
  }
}

absl::Status VerifyEntry(const CacheEntry& entry) {
  if (!entry.block_checksums.empty()) {
    // Blocks matching a table that sums to the checksum sum to the checksum too.
    RETURN_IF_ERROR(VerifyBlockTable(entry));
    for (size_t l = 0; l < entry.layers.size(); ++l) {
      RETURN_IF_ERROR(VerifyBlocks(entry, l, 0, entry.block_checksums[l].size()));
    }
    return absl::OkStatus();
  }
  uint64_t actual = 0;
  for (size_t l = 0; l < entry.layers.size(); ++l) {
    for (uint64_t h : ChecksumLayerBlocks(static_cast<uint32_t>(l), entry.layers[l])) actual += h;
  }
  if (actual != entry.checksum) {
    return absl::DataLossError(absl::StrCat("cache '", entry.id, "': checksum mismatch (stored ",
                                            absl::Hex(entry.checksum), ", computed ",
                                            absl::Hex(actual), ")"));
  }
  return absl::OkStatus();
}

absl::Status VerifyBlockTable(const CacheEntry& entry) {
  uint64_t sum = 0;
  bool shaped = entry.block_checksums.size() == entry.layers.size();
  for (size_t l = 0; shaped && l < entry.layers.size(); ++l) {
    shaped = entry.block_checksums[l].size() == NumChecksumBlocks(entry.layers[l].size());
    for (uint64_t h : entry.block_checksums[l]) sum += h;
  }
  if (!shaped || sum != entry.checksum) {
    return absl::DataLossError(absl::StrCat("cache '", entry.id,
                                            "': the block checksum table does not match the "
                                            "layers or the checksum ",
                                            absl::Hex(entry.checksum)));
  }
  return absl::OkStatus();
}

absl::Status VerifyBlocks(const CacheEntry& entry, size_t layer, uint64_t begin, uint64_t end) {
  const std::vector<uint64_t>& table = entry.block_checksums[layer];
  for (uint64_t i = begin; i < end; ++i) {
    if (ChecksumBlock(static_cast<uint32_t>(layer), entry.layers[layer], i) != table[i]) {
      return absl::DataLossError(absl::StrCat("cache '", entry.id, "': layer ", layer, " block ", i,
                                              ": checksum mismatch"));
    }
  }
  return absl::OkStatus();
}

const char* EvictionReasonName(EvictionReason r) {
  switch (r) {
    case EvictionReason::kCapacity:
      return "capacity";
    case EvictionReason::kTtl:
      return "ttl";
    case EvictionReason::kOverwrite:
      return "overwrite";
    case EvictionReason::kDeleted:
      return "deleted";
  }
  return "unknown";
}

CacheStore::Lease::~Lease() = default;  // release_'s deleter does the bookkeeping

namespace {

struct Node {
  std::shared_ptr<const CacheEntry> entry;
  uint64_t bytes = 0;
  int leases = 0;
  bool indexed = false;
  std::list<Node*>::iterator lru_pos;  // valid while indexed and idle
};

using ExpiryKey = std::pair<absl::Time, Node*>;
using Index = std::map<std::string, std::shared_ptr<Node>, std::less<>>;

struct Evicted {
  std::shared_ptr<const CacheEntry> entry;
  EvictionReason reason;
};

// The mutable state, shared with outstanding leases so a lease may outlive the store.
class Core {
 public:
  explicit Core(uint64_t capacity) : capacity_(capacity) {}

  absl::Mutex mu;

  const uint64_t capacity_;
  uint64_t used ABSL_GUARDED_BY(mu) = 0;
  uint64_t evictable ABSL_GUARDED_BY(mu) = 0;  // bytes of idle indexed entries
  Index index ABSL_GUARDED_BY(mu);
  std::list<Node*> lru ABSL_GUARDED_BY(mu);  // idle entries, most recently used first
  std::set<ExpiryKey> idle_expiry ABSL_GUARDED_BY(mu);
  std::set<ExpiryKey> leased_expiry ABSL_GUARDED_BY(mu);

  void LinkIdle(Node* n, bool most_recent) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    n->lru_pos = most_recent ? lru.insert(lru.begin(), n) : lru.insert(lru.end(), n);
    idle_expiry.emplace(n->entry->expires, n);
    evictable += n->bytes;
  }

  void UnlinkIdle(Node* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    lru.erase(n->lru_pos);
    idle_expiry.erase({n->entry->expires, n});
    evictable -= n->bytes;
  }

  // Removes an indexed entry. Its bytes are freed now when idle, else at its last release.
  void RemoveFromIndex(Index::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    Node* n = it->second.get();
    if (n->leases == 0) {
      UnlinkIdle(n);
      used -= n->bytes;
    } else {
      leased_expiry.erase({n->entry->expires, n});
    }
    n->indexed = false;
    index.erase(it);
  }

  void RemoveFromIndex(Node* n) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    RemoveFromIndex(index.find(n->entry->id));
  }

  void Release(Node* n) {
    internal::WriterLock lock(&mu);
    if (--n->leases > 0) return;
    if (n->indexed) {
      leased_expiry.erase({n->entry->expires, n});
      LinkIdle(n, /*most_recent=*/true);  // it was just read
    } else {
      used -= n->bytes;
    }
  }
};

bool Expired(const CacheEntry& e, absl::Time now) { return now >= e.expires; }

}  // namespace

class CacheStoreImpl final : public CacheStore {
 public:
  explicit CacheStoreImpl(const Options& options)
      : options_(options), core_(std::make_shared<Core>(options.capacity_bytes)) {}

  ~CacheStoreImpl() override = default;

  absl::Status Insert(std::shared_ptr<const CacheEntry> entry, bool overwrite) override {
    if (entry == nullptr) return absl::InvalidArgumentError("entry: must not be null");
    if (entry->id.empty()) return absl::InvalidArgumentError("entry.id: must not be empty");
    if (options_.verify_on_insert) {
      if (absl::Status s = VerifyEntry(*entry); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("entry.checksum: ", s.message()));
      }
    }
    const uint64_t bytes = entry->ChargedBytes();
    if (bytes > core_->capacity_) {
      return absl::ResourceExhaustedError(absl::StrCat("cache '", entry->id, "': ", bytes,
                                                       " bytes exceed the store capacity of ",
                                                       core_->capacity_, " bytes"));
    }
    const absl::Time now = options_.now();
    if (Expired(*entry, now)) {
      return absl::InvalidArgumentError(
          absl::StrCat("entry.expires: ", absl::FormatTime(entry->expires), " is not after now (",
                       absl::FormatTime(now), ")"));
    }

    std::vector<Evicted> evicted;
    {
      Core& c = *core_;
      internal::WriterLock lock(&c.mu);
      auto it = c.index.find(entry->id);
      const bool live = it != c.index.end() && !Expired(*it->second->entry, now);
      if (live && !overwrite) {
        return absl::AlreadyExistsError(
            absl::StrCat("cache '", entry->id, "' already exists (overwrite not requested)"));
      }
      // All idle entries, including an idle old version of this id, can be evicted; leased bytes
      // (including a leased old version) cannot. Check before touching anything.
      const uint64_t pinned = c.used - c.evictable;
      if (pinned + bytes > c.capacity_) {
        return absl::ResourceExhaustedError(
            absl::StrCat("cache '", entry->id, "': ", bytes, " bytes do not fit: capacity ",
                         c.capacity_, " bytes, ", pinned, " bytes held by leases"));
      }
      if (it != c.index.end()) {
        evicted.push_back(
            {it->second->entry, live ? EvictionReason::kOverwrite : EvictionReason::kTtl});
        c.RemoveFromIndex(it);
      }
      while (c.used + bytes > c.capacity_) {
        // pinned + bytes <= capacity guarantees an idle entry remains while this holds.
        Node* victim;
        EvictionReason reason;
        if (!c.idle_expiry.empty() && c.idle_expiry.begin()->first <= now) {
          victim = c.idle_expiry.begin()->second;
          reason = EvictionReason::kTtl;
        } else {
          victim = c.lru.back();
          reason = EvictionReason::kCapacity;
        }
        evicted.push_back({victim->entry, reason});
        c.RemoveFromIndex(victim);
      }
      auto node = std::make_shared<Node>();
      node->entry = entry;
      node->bytes = bytes;
      node->indexed = true;
      Node* raw = node.get();
      c.index.emplace(entry->id, std::move(node));
      c.used += bytes;
      c.LinkIdle(raw, /*most_recent=*/true);
    }
    Notify(evicted);
    return absl::OkStatus();
  }

  absl::Status CheckCanFit(uint64_t bytes) const override {
    if (bytes > core_->capacity_) {
      return absl::ResourceExhaustedError(
          absl::StrCat(bytes, " bytes exceed the store capacity of ", core_->capacity_, " bytes"));
    }
    internal::ReaderLock lock(&core_->mu);
    const uint64_t pinned = core_->used - core_->evictable;
    if (pinned + bytes > core_->capacity_) {
      return absl::ResourceExhaustedError(absl::StrCat(bytes, " bytes do not fit: capacity ",
                                                       core_->capacity_, " bytes, ", pinned,
                                                       " bytes held by leases"));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<Lease> Acquire(const std::string& id) override {
    const absl::Time now = options_.now();
    Core& c = *core_;
    std::shared_ptr<Node> node;
    {
      internal::WriterLock lock(&c.mu);
      auto it = c.index.find(id);
      if (it == c.index.end() || Expired(*it->second->entry, now)) return NotFound(id);
      node = it->second;
      if (node->leases++ == 0) {
        c.UnlinkIdle(node.get());
        c.leased_expiry.emplace(node->entry->expires, node.get());
      }
    }
    Lease lease;
    lease.entry_ = node->entry;
    // The deleter owns the node and the core, so releasing after the store is gone is safe.
    std::shared_ptr<Core> core = core_;
    lease.release_ =
        std::shared_ptr<void>(static_cast<void*>(node.get()),
                              [core = std::move(core), node](void*) { core->Release(node.get()); });
    return lease;
  }

  absl::StatusOr<std::shared_ptr<const CacheEntry>> Peek(const std::string& id) const override {
    const absl::Time now = options_.now();
    internal::ReaderLock lock(&core_->mu);
    auto it = core_->index.find(id);
    if (it == core_->index.end() || Expired(*it->second->entry, now)) return NotFound(id);
    return it->second->entry;
  }

  absl::StatusOr<uint64_t> Delete(const std::string& id) override {
    const absl::Time now = options_.now();
    // Holds the entry until after the lock is released, so a large blob is freed outside it.
    std::shared_ptr<const CacheEntry> removed;
    internal::WriterLock lock(&core_->mu);
    auto it = core_->index.find(id);
    if (it == core_->index.end() || Expired(*it->second->entry, now)) return NotFound(id);
    const uint64_t bytes = it->second->bytes;
    removed = it->second->entry;
    core_->RemoveFromIndex(it);
    return bytes;
  }

  std::vector<std::shared_ptr<const CacheEntry>> List(const std::string& prefix,
                                                      const std::string& start_after,
                                                      size_t limit) const override {
    std::vector<std::shared_ptr<const CacheEntry>> out;
    if (limit == 0) return out;
    const absl::Time now = options_.now();
    internal::ReaderLock lock(&core_->mu);
    const auto& index = core_->index;
    auto it = start_after < prefix ? index.lower_bound(prefix) : index.upper_bound(start_after);
    for (; it != index.end() && out.size() < limit; ++it) {
      if (!absl::StartsWith(it->first, prefix)) break;  // ids with the prefix are contiguous
      if (!Expired(*it->second->entry, now)) out.push_back(it->second->entry);
    }
    return out;
  }

  size_t ExpireNow() override {
    const absl::Time now = options_.now();
    std::vector<Evicted> evicted;
    {
      Core& c = *core_;
      internal::WriterLock lock(&c.mu);
      for (std::set<ExpiryKey>* set : {&c.idle_expiry, &c.leased_expiry}) {
        while (!set->empty() && set->begin()->first <= now) {
          Node* n = set->begin()->second;
          evicted.push_back({n->entry, EvictionReason::kTtl});
          c.RemoveFromIndex(n);  // erases the set element
        }
      }
    }
    Notify(evicted);
    return evicted.size();
  }

  Stats GetStats() const override {
    internal::ReaderLock lock(&core_->mu);
    Stats s;
    s.used_bytes = core_->used;
    s.capacity_bytes = core_->capacity_;
    s.entries = core_->index.size();
    s.leased_bytes = core_->used - core_->evictable;
    return s;
  }

 private:
  static absl::Status NotFound(const std::string& id) {
    return absl::NotFoundError(absl::StrCat("cache '", id, "' not found"));
  }

  void Notify(const std::vector<Evicted>& evicted) const {
    if (!options_.on_evict) return;
    for (const Evicted& e : evicted) options_.on_evict(*e.entry, e.reason);
  }

  const Options options_;
  const std::shared_ptr<Core> core_;
};

absl::StatusOr<std::unique_ptr<CacheStore>> CacheStore::Create(const Options& options) {
  if (options.capacity_bytes == 0) {
    return absl::InvalidArgumentError("capacity_bytes: must be > 0");
  }
  if (!options.now) return absl::InvalidArgumentError("now: clock must be set");
  return std::unique_ptr<CacheStore>(new CacheStoreImpl(options));
}

}  // namespace kvc

#include <xxhash.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/cache_store.h"

namespace kvc {
namespace {

using ::testing::ElementsAre;
using ::testing::Pair;

// An entry whose charged size is exactly `charged` bytes (id + one layer blob).
std::shared_ptr<CacheEntry> MakeEntry(const std::string& id, uint64_t charged,
                                      absl::Time expires = absl::InfiniteFuture()) {
  auto e = std::make_shared<CacheEntry>();
  e->id = id;
  const uint64_t payload = charged - id.size();
  e->layers.emplace_back(payload);
  for (uint64_t i = 0; i < payload; ++i) e->layers[0][i] = static_cast<uint8_t>(i * 31 + id.size());
  e->expires = expires;
  FinalizeEntry(*e);
  return e;
}

struct Clock {
  absl::Time now = absl::FromUnixSeconds(1'000'000);
};

struct Recorder {
  absl::Mutex mu;
  std::vector<std::pair<std::string, EvictionReason>> events;
  std::vector<std::pair<std::string, EvictionReason>> Take() {
    absl::MutexLock l(&mu);
    return std::exchange(events, {});
  }
};

std::unique_ptr<CacheStore> MakeStore(uint64_t capacity, Clock* clock = nullptr,
                                      Recorder* rec = nullptr) {
  CacheStore::Options o;
  o.capacity_bytes = capacity;
  if (clock != nullptr) o.now = [clock] { return clock->now; };
  if (rec != nullptr) {
    o.on_evict = [rec](const CacheEntry& e, EvictionReason r) {
      absl::MutexLock l(&rec->mu);
      rec->events.emplace_back(e.id, r);
    };
  }
  auto store = CacheStore::Create(o);
  EXPECT_TRUE(store.ok()) << store.status();
  return std::move(store).value();
}

std::vector<std::string> Ids(const CacheStore& s, const std::string& prefix = "",
                             const std::string& after = "", size_t limit = 1000) {
  std::vector<std::string> ids;
  for (const auto& e : s.List(prefix, after, limit)) ids.push_back(e->id);
  return ids;
}

// Everything observable about a store, to assert that an error changed nothing.
struct Snapshot {
  uint64_t used, capacity, entries, leased;
  std::vector<std::string> ids;
  bool operator==(const Snapshot&) const = default;
};
Snapshot Snap(const CacheStore& s) {
  const CacheStore::Stats st = s.GetStats();
  return {st.used_bytes, st.capacity_bytes, st.entries, st.leased_bytes, Ids(s)};
}

TEST(CacheStoreTest, CreateValidatesOptions) {
  CacheStore::Options o;
  o.capacity_bytes = 0;
  auto s = CacheStore::Create(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), ::testing::HasSubstr("capacity_bytes"));
  o.capacity_bytes = 100;
  o.now = nullptr;
  s = CacheStore::Create(o);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), ::testing::HasSubstr("now"));
}

TEST(CacheStoreTest, InsertAcquirePeekDelete) {
  auto store = MakeStore(1000);
  auto e = MakeEntry("a", 100);
  e->metadata = "meta";
  FinalizeEntry(*e);
  EXPECT_EQ(e->ChargedBytes(), 104u);
  ASSERT_TRUE(store->Insert(e, false).ok());
  EXPECT_EQ(store->GetStats().used_bytes, 104u);
  EXPECT_EQ(store->GetStats().entries, 1u);
  EXPECT_EQ(store->GetStats().capacity_bytes, 1000u);

  auto peek = store->Peek("a");
  ASSERT_TRUE(peek.ok());
  EXPECT_EQ((*peek)->metadata, "meta");
  {
    auto lease = store->Acquire("a");
    ASSERT_TRUE(lease.ok());
    EXPECT_EQ(lease->entry().layers, e->layers);
    EXPECT_EQ((*lease)->id, "a");
    EXPECT_EQ(store->GetStats().leased_bytes, 104u);
  }
  EXPECT_EQ(store->GetStats().leased_bytes, 0u);

  EXPECT_EQ(store->Acquire("b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Peek("b").status().code(), absl::StatusCode::kNotFound);
  const Snapshot before = Snap(*store);
  EXPECT_EQ(store->Delete("b").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(Snap(*store), before);

  auto deleted = store->Delete("a");
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(*deleted, 104u);
  EXPECT_EQ(store->GetStats().used_bytes, 0u);
  EXPECT_EQ(store->GetStats().entries, 0u);
  EXPECT_EQ(store->Peek("a").status().code(), absl::StatusCode::kNotFound);
}

TEST(CacheStoreTest, InvalidInsertsChangeNothing) {
  Clock clock;
  auto store = MakeStore(1000, &clock);
  ASSERT_TRUE(store->Insert(MakeEntry("keep", 300), false).ok());
  const Snapshot before = Snap(*store);

  EXPECT_EQ(store->Insert(nullptr, false).code(), absl::StatusCode::kInvalidArgument);
  auto no_id = MakeEntry("", 10);
  absl::Status s = store->Insert(no_id, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("entry.id"));

  auto bad_sum = MakeEntry("bad", 10);
  bad_sum->checksum ^= 1;
  s = store->Insert(bad_sum, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("entry.checksum"));

  auto past = MakeEntry("past", 10, clock.now);
  s = store->Insert(past, false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("entry.expires"));

  EXPECT_EQ(store->Insert(MakeEntry("huge", 1001), false).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snap(*store), before);
}

TEST(CacheStoreTest, EntryOfExactlyCapacityFitsByEvictingAll) {
  Recorder rec;
  auto store = MakeStore(1000, nullptr, &rec);
  ASSERT_TRUE(store->Insert(MakeEntry("a", 400), false).ok());
  ASSERT_TRUE(store->Insert(MakeEntry("b", 400), false).ok());
  ASSERT_TRUE(store->CheckCanFit(1000).ok());
  EXPECT_EQ(store->CheckCanFit(1001).code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(store->Insert(MakeEntry("c", 1000), false).ok());
  EXPECT_THAT(Ids(*store), ElementsAre("c"));
  EXPECT_EQ(store->GetStats().used_bytes, 1000u);
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("a", EvictionReason::kCapacity),
                                      Pair("b", EvictionReason::kCapacity)));
}

TEST(CacheStoreTest, ListByPrefixWithPagination) {
  auto store = MakeStore(100000);
  for (const char* id : {"t1/a", "t1/b", "t1/c", "t1/d", "t2/a", "t0/z", "t1"}) {
    ASSERT_TRUE(store->Insert(MakeEntry(id, 50), false).ok());
  }
  EXPECT_THAT(Ids(*store, "t1/"), ElementsAre("t1/a", "t1/b", "t1/c", "t1/d"));
  EXPECT_THAT(Ids(*store, "t1/", "", 2), ElementsAre("t1/a", "t1/b"));
  EXPECT_THAT(Ids(*store, "t1/", "t1/b", 2), ElementsAre("t1/c", "t1/d"));
  EXPECT_THAT(Ids(*store, "t1/", "t1/d", 2), ElementsAre());
  EXPECT_THAT(Ids(*store, "t1/", "t0/zz", 1), ElementsAre("t1/a"));  // start_after < prefix
  EXPECT_THAT(Ids(*store, "t1/", "t1/bb", 10), ElementsAre("t1/c", "t1/d"));  // absent cursor
  EXPECT_THAT(Ids(*store, "t1/", "", 0), ElementsAre());
  EXPECT_THAT(Ids(*store, "t3/"), ElementsAre());
  EXPECT_EQ(Ids(*store).size(), 7u);
}

TEST(CacheStoreTest, EvictsLeastRecentlyUsedAndAcquireTouches) {
  Recorder rec;
  auto store = MakeStore(300, nullptr, &rec);
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(store->Insert(MakeEntry(id, 100), false).ok());
  { ASSERT_TRUE(store->Acquire("a").ok()); }  // a becomes most recent; b is now the oldest
  ASSERT_TRUE(store->Peek("b").ok());         // Peek does not touch
  ASSERT_TRUE(store->Insert(MakeEntry("d", 100), false).ok());
  EXPECT_THAT(Ids(*store), ElementsAre("a", "c", "d"));
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("b", EvictionReason::kCapacity)));
  ASSERT_TRUE(store->Insert(MakeEntry("e", 200), false).ok());  // evicts c then a
  EXPECT_THAT(Ids(*store), ElementsAre("d", "e"));
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("c", EvictionReason::kCapacity),
                                      Pair("a", EvictionReason::kCapacity)));
  EXPECT_EQ(store->GetStats().used_bytes, 300u);
}

TEST(CacheStoreTest, TtlHidesExpiredAndExpireNowSweeps) {
  Clock clock;
  Recorder rec;
  auto store = MakeStore(1000, &clock, &rec);
  ASSERT_TRUE(store->Insert(MakeEntry("short", 100, clock.now + absl::Seconds(10)), false).ok());
  ASSERT_TRUE(store->Insert(MakeEntry("long", 100, clock.now + absl::Seconds(100)), false).ok());
  ASSERT_TRUE(store->Insert(MakeEntry("never", 100), false).ok());
  clock.now += absl::Seconds(9);
  EXPECT_TRUE(store->Acquire("short").ok());
  clock.now += absl::Seconds(1);  // exactly at `expires`: expired
  EXPECT_EQ(store->Acquire("short").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Peek("short").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->Delete("short").status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Ids(*store), ElementsAre("long", "never"));
  EXPECT_EQ(store->GetStats().entries, 3u);  // not swept yet
  EXPECT_EQ(store->GetStats().used_bytes, 300u);

  EXPECT_EQ(store->ExpireNow(), 1u);
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("short", EvictionReason::kTtl)));
  EXPECT_EQ(store->GetStats().entries, 2u);
  EXPECT_EQ(store->GetStats().used_bytes, 200u);
  EXPECT_EQ(store->ExpireNow(), 0u);
  clock.now += absl::Hours(1);
  EXPECT_EQ(store->ExpireNow(), 1u);
  EXPECT_THAT(Ids(*store), ElementsAre("never"));
}

TEST(CacheStoreTest, ExpiredLeasedEntryLeavesIndexButKeepsBytesUntilRelease) {
  Clock clock;
  Recorder rec;
  auto store = MakeStore(300, &clock, &rec);
  ASSERT_TRUE(store->Insert(MakeEntry("a", 200, clock.now + absl::Seconds(1)), false).ok());
  auto lease = store->Acquire("a");
  ASSERT_TRUE(lease.ok());
  clock.now += absl::Seconds(1);
  // Expired and leased: nothing can be evicted to make room.
  EXPECT_EQ(store->Insert(MakeEntry("b", 200), false).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store->ExpireNow(), 1u);
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("a", EvictionReason::kTtl)));
  EXPECT_EQ(store->GetStats().entries, 0u);
  EXPECT_EQ(store->GetStats().used_bytes, 200u);
  // Re-inserting the id is allowed; the old bytes are still held by the reader.
  ASSERT_TRUE(store->Insert(MakeEntry("a", 100), false).ok());
  EXPECT_EQ(store->GetStats().used_bytes, 300u);
  EXPECT_EQ((*lease)->layers[0].size(), 199u);
  *lease = CacheStore::Lease();
  EXPECT_EQ(store->GetStats().used_bytes, 100u);
  EXPECT_EQ(store->GetStats().entries, 1u);
}

TEST(CacheStoreTest, ExpiredEntriesAreEvictedBeforeLruVictims) {
  Clock clock;
  Recorder rec;
  auto store = MakeStore(300, &clock, &rec);
  ASSERT_TRUE(store->Insert(MakeEntry("old", 100), false).ok());  // LRU tail, never expires
  ASSERT_TRUE(store->Insert(MakeEntry("mid", 100), false).ok());
  ASSERT_TRUE(store->Insert(MakeEntry("ttl", 100, clock.now + absl::Seconds(5)), false).ok());
  clock.now += absl::Seconds(5);
  ASSERT_TRUE(store->Insert(MakeEntry("new", 100), false).ok());
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("ttl", EvictionReason::kTtl)));
  EXPECT_THAT(Ids(*store), ElementsAre("mid", "new", "old"));
}

TEST(CacheStoreTest, ExpiredIdMayBeReinsertedWithoutOverwrite) {
  Clock clock;
  Recorder rec;
  auto store = MakeStore(1000, &clock, &rec);
  ASSERT_TRUE(store->Insert(MakeEntry("a", 100, clock.now + absl::Seconds(1)), false).ok());
  clock.now += absl::Seconds(2);
  ASSERT_TRUE(store->Insert(MakeEntry("a", 200), false).ok());
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("a", EvictionReason::kTtl)));
  EXPECT_EQ(store->GetStats().used_bytes, 200u);
  EXPECT_EQ(store->GetStats().entries, 1u);
}

TEST(CacheStoreTest, LeasedEntriesAreNeverEvicted) {
  Recorder rec;
  auto store = MakeStore(300, nullptr, &rec);
  for (const char* id : {"a", "b", "c"}) ASSERT_TRUE(store->Insert(MakeEntry(id, 100), false).ok());
  auto la = store->Acquire("a");
  auto lb = store->Acquire("b");
  ASSERT_TRUE(la.ok() && lb.ok());
  EXPECT_EQ(store->GetStats().leased_bytes, 200u);

  // Only c (100 bytes) is evictable: 150 cannot fit, and the failure changes nothing.
  const Snapshot before = Snap(*store);
  EXPECT_EQ(store->CheckCanFit(150).code(), absl::StatusCode::kResourceExhausted);
  absl::Status s = store->Insert(MakeEntry("d", 150), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snap(*store), before);
  EXPECT_TRUE(rec.Take().empty());

  // 100 fits by evicting c even though a and b are older.
  ASSERT_TRUE(store->CheckCanFit(100).ok());
  ASSERT_TRUE(store->Insert(MakeEntry("d", 100), false).ok());
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("c", EvictionReason::kCapacity)));

  // After release, a is evictable again and b (released later) is more recent than a.
  *la = CacheStore::Lease();
  *lb = CacheStore::Lease();
  EXPECT_EQ(store->GetStats().leased_bytes, 0u);
  ASSERT_TRUE(store->Insert(MakeEntry("e", 100), false).ok());
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("d", EvictionReason::kCapacity)));
  ASSERT_TRUE(store->Insert(MakeEntry("f", 100), false).ok());
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("a", EvictionReason::kCapacity)));
}

TEST(CacheStoreTest, DeletedLeasedEntryStaysChargedUntilLastRelease) {
  auto store = MakeStore(300);
  ASSERT_TRUE(store->Insert(MakeEntry("a", 200), false).ok());
  auto l1 = store->Acquire("a");
  auto l2 = store->Acquire("a");
  ASSERT_TRUE(l1.ok() && l2.ok());
  auto deleted = store->Delete("a");
  ASSERT_TRUE(deleted.ok());
  EXPECT_EQ(*deleted, 200u);
  EXPECT_EQ(store->Peek("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store->GetStats().entries, 0u);
  EXPECT_EQ(store->GetStats().used_bytes, 200u);
  EXPECT_EQ(store->GetStats().leased_bytes, 200u);
  // The bytes are still held, so a 200-byte entry cannot fit yet; the lease still reads.
  EXPECT_EQ(store->Insert(MakeEntry("b", 200), false).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(l1->entry().layers[0].size(), 199u);
  *l1 = CacheStore::Lease();
  EXPECT_EQ(store->GetStats().used_bytes, 200u);
  *l2 = CacheStore::Lease();
  EXPECT_EQ(store->GetStats().used_bytes, 0u);
  EXPECT_TRUE(store->Insert(MakeEntry("b", 200), false).ok());
}

TEST(CacheStoreTest, OverwriteRules) {
  Recorder rec;
  auto store = MakeStore(300, nullptr, &rec);
  ASSERT_TRUE(store->Insert(MakeEntry("a", 200), false).ok());
  const Snapshot before = Snap(*store);
  absl::Status s = store->Insert(MakeEntry("a", 50), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(Snap(*store), before);

  // The old entry's bytes count as free: 250 fits in 300 only because "a" (200) goes.
  ASSERT_TRUE(store->Insert(MakeEntry("a", 250), true).ok());
  EXPECT_EQ(store->GetStats().used_bytes, 250u);
  EXPECT_EQ(store->GetStats().entries, 1u);
  EXPECT_EQ((*store->Peek("a"))->layers[0].size(), 249u);
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("a", EvictionReason::kOverwrite)));
}

TEST(CacheStoreTest, OverwriteOfLeasedEntryKeepsOldBytesUntilRelease) {
  Recorder rec;
  auto store = MakeStore(300, nullptr, &rec);
  ASSERT_TRUE(store->Insert(MakeEntry("a", 200), false).ok());
  auto lease = store->Acquire("a");
  ASSERT_TRUE(lease.ok());
  const Snapshot before = Snap(*store);
  EXPECT_EQ(store->Insert(MakeEntry("a", 150), true).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(Snap(*store), before);
  EXPECT_TRUE(rec.Take().empty());

  ASSERT_TRUE(store->Insert(MakeEntry("a", 100), true).ok());
  EXPECT_THAT(rec.Take(), ElementsAre(Pair("a", EvictionReason::kOverwrite)));
  EXPECT_EQ(store->GetStats().used_bytes, 300u);
  EXPECT_EQ(store->GetStats().entries, 1u);
  EXPECT_EQ((*lease)->layers[0].size(), 199u);  // the reader still sees the old version
  EXPECT_EQ((*store->Peek("a"))->layers[0].size(), 99u);
  *lease = CacheStore::Lease();
  EXPECT_EQ(store->GetStats().used_bytes, 100u);
  // Releasing the old version must not disturb the new one.
  ASSERT_TRUE(store->Acquire("a").ok());
  EXPECT_EQ(store->GetStats().leased_bytes, 0u);
}

// A layer of several blocks: the checksum changes when blocks trade places, within a layer or
// across layers, and when a byte changes in the short last block.
TEST(CacheStoreTest, ChecksumTiesEachBlockToItsPlace) {
  constexpr size_t kBlock = kChecksumBlockBytes;
  auto e = std::make_shared<CacheEntry>();
  e->id = "b";
  for (int l = 0; l < 2; ++l) {
    ByteVector layer(2 * kBlock + 100);
    for (size_t i = 0; i < layer.size(); ++i) layer[i] = static_cast<uint8_t>((i / kBlock) * 7 + l);
    e->layers.push_back(std::move(layer));
  }
  FinalizeEntry(*e);
  ASSERT_TRUE(VerifyEntry(*e).ok());
  CacheEntry swapped = *e;  // blocks 0 and 1 of layer 0 trade places
  std::swap_ranges(swapped.layers[0].begin(), swapped.layers[0].begin() + kBlock,
                   swapped.layers[0].begin() + kBlock);
  EXPECT_EQ(VerifyEntry(swapped).code(), absl::StatusCode::kDataLoss);
  CacheEntry layers_swapped = *e;
  std::swap(layers_swapped.layers[0], layers_swapped.layers[1]);
  EXPECT_EQ(VerifyEntry(layers_swapped).code(), absl::StatusCode::kDataLoss);
  CacheEntry tail = *e;
  tail.layers[1].back() ^= 1;
  EXPECT_EQ(VerifyEntry(tail).code(), absl::StatusCode::kDataLoss);
  // The block table: one row per layer, one hash per block, summing to the checksum.
  ASSERT_EQ(e->block_checksums.size(), 2u);
  EXPECT_EQ(e->block_checksums[0], ChecksumLayerBlocks(0, e->layers[0]));
  EXPECT_EQ(e->block_checksums[1].size(), 3u);
  uint64_t sum = 0;
  for (const auto& row : e->block_checksums) {
    for (uint64_t h : row) sum += h;
  }
  EXPECT_EQ(sum, e->checksum);
  EXPECT_TRUE(VerifyBlockTable(*e).ok());
  EXPECT_TRUE(VerifyBlocks(*e, 1, 0, 3).ok());
}

// Readers check the table once (no hashing), then only the blocks they serve: a corrupt block is
// found by the range that covers it and named; a tampered table is caught by its sum.
TEST(CacheStoreTest, BlockVerificationFindsTheCorruptBlock) {
  constexpr size_t kBlock = kChecksumBlockBytes;
  auto e = std::make_shared<CacheEntry>();
  e->id = "c";
  ByteVector layer(3 * kBlock);
  for (size_t i = 0; i < layer.size(); ++i) layer[i] = static_cast<uint8_t>(i * 7);
  e->layers.push_back(std::move(layer));
  FinalizeEntry(*e);
  CacheEntry bad = *e;
  bad.layers[0][kBlock + 5] ^= 1;                // block 1
  EXPECT_TRUE(VerifyBlockTable(bad).ok());       // the table itself is intact
  EXPECT_TRUE(VerifyBlocks(bad, 0, 0, 1).ok());  // block 0 is fine
  absl::Status s = VerifyBlocks(bad, 0, 0, 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("layer 0 block 1"));
  EXPECT_EQ(VerifyEntry(bad).code(), absl::StatusCode::kDataLoss);
  CacheEntry table = *e;
  table.block_checksums[0][2] += 1;  // the table no longer sums to the checksum
  EXPECT_EQ(VerifyBlockTable(table).code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(VerifyEntry(table).code(), absl::StatusCode::kDataLoss);
  CacheEntry shape = *e;
  shape.block_checksums[0].pop_back();
  EXPECT_EQ(VerifyBlockTable(shape).code(), absl::StatusCode::kDataLoss);
}

TEST(CacheStoreTest, ChecksumDetectsCorruption) {
  auto e = MakeEntry("a", 64);
  e->layers.push_back({1, 2, 3});
  e->layers.push_back({});
  FinalizeEntry(*e);
  EXPECT_TRUE(VerifyEntry(*e).ok());
  CacheEntry copy = *e;
  copy.layers[0][17] ^= 0x40;
  absl::Status s = VerifyEntry(copy);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("'a'"));
  // The wire contract (CacheInfo.checksum), computed here straight from its definition: the sum
  // of XXH3-64 over 64 KiB blocks of each layer, seeded with (layer << 32) + block.
  uint64_t expected = 0;
  for (size_t l = 0; l < e->layers.size(); ++l) {
    const auto& layer = e->layers[l];
    for (size_t at = 0, i = 0; at < layer.size(); at += 65536, ++i) {
      expected += XXH3_64bits_withSeed(
          layer.data() + at, std::min<size_t>(65536, layer.size() - at), (uint64_t{l} << 32) + i);
    }
  }
  EXPECT_EQ(e->checksum, expected);
  copy = *e;
  copy.layers[1][2] = 9;
  EXPECT_EQ(VerifyEntry(copy).code(), absl::StatusCode::kDataLoss);
}

// verify_on_insert = false: Insert trusts the caller's checksum (it does not hash), stores the
// entry unchanged, and VerifyEntry (what readers call before serving) still catches a mismatch.
// Every other check still applies.
TEST(CacheStoreTest, TrustingInsertSkipsOnlyTheChecksum) {
  CacheStore::Options o;
  o.capacity_bytes = 1000;
  o.verify_on_insert = false;
  auto store = CacheStore::Create(o);
  ASSERT_TRUE(store.ok()) << store.status();

  auto good = MakeEntry("good", 100);
  ASSERT_TRUE((*store)->Insert(good, false).ok());
  auto lease = (*store)->Acquire("good");
  ASSERT_TRUE(lease.ok());
  EXPECT_EQ(lease->entry().checksum, good->checksum);
  EXPECT_TRUE(VerifyEntry(lease->entry()).ok());

  auto bad_sum = MakeEntry("bad", 100);
  bad_sum->checksum ^= 1;
  ASSERT_TRUE((*store)->Insert(bad_sum, false).ok());  // accepted: not hashed on insert
  auto bad = (*store)->Acquire("bad");
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ(VerifyEntry(bad->entry()).code(), absl::StatusCode::kDataLoss);

  const Snapshot before = Snap(**store);
  absl::Status s = (*store)->Insert(MakeEntry("", 10), false);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("entry.id"));
  EXPECT_EQ((*store)->Insert(MakeEntry("huge", 1001), false).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*store)->Insert(MakeEntry("good", 100), false).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(Snap(**store), before);
}

TEST(CacheStoreTest, OnEvictRunsWithoutLocksHeld) {
  std::unique_ptr<CacheStore> store;
  std::vector<uint64_t> used_seen;
  CacheStore::Options o;
  o.capacity_bytes = 200;
  o.on_evict = [&](const CacheEntry& e, EvictionReason) {
    used_seen.push_back(store->GetStats().used_bytes);  // would deadlock under the lock
    EXPECT_TRUE(store->Peek(e.id).status().code() == absl::StatusCode::kNotFound);
  };
  store = std::move(CacheStore::Create(o)).value();
  ASSERT_TRUE(store->Insert(MakeEntry("a", 100), false).ok());
  ASSERT_TRUE(store->Insert(MakeEntry("b", 100), false).ok());
  ASSERT_TRUE(store->Insert(MakeEntry("c", 150), false).ok());
  EXPECT_THAT(used_seen, ElementsAre(150u, 150u));
}

TEST(CacheStoreTest, LeaseMayOutliveStore) {
  auto store = MakeStore(100);
  ASSERT_TRUE(store->Insert(MakeEntry("a", 50), false).ok());
  auto lease = store->Acquire("a");
  ASSERT_TRUE(lease.ok());
  store.reset();
  EXPECT_EQ((*lease)->id, "a");
  *lease = CacheStore::Lease();  // runs the release against the still-alive shared state
}

// Random concurrent operations; checks the accounting identities that must hold at every step
// and at the end. Run under -DKVC_SANITIZE=thread to check for races.
TEST(CacheStoreTest, ConcurrentRandomOperationsKeepInvariants) {
  constexpr uint64_t kCapacity = 20000;
  constexpr int kThreads = 4;
  constexpr int kOpsPerThread = 4000;
  std::atomic<int64_t> inserted{0}, evicted{0}, deleted{0};
  CacheStore::Options o;
  o.capacity_bytes = kCapacity;
  o.on_evict = [&](const CacheEntry&, EvictionReason r) {
    EXPECT_NE(r, EvictionReason::kTtl);  // nothing expires in this test
    evicted.fetch_add(1);
  };
  auto store = std::move(CacheStore::Create(o)).value();

  std::vector<std::thread> threads;
  std::atomic<int> violations{0};
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(1234 + t);
      std::vector<CacheStore::Lease> leases;
      for (int i = 0; i < kOpsPerThread; ++i) {
        const std::string id = absl::StrCat("id", rng() % 64);
        switch (rng() % 8) {
          case 0:
          case 1:
          case 2: {
            absl::Status s = store->Insert(MakeEntry(id, 100 + rng() % 3000), rng() % 2 == 0);
            if (s.ok())
              inserted.fetch_add(1);
            else if (s.code() != absl::StatusCode::kAlreadyExists &&
                     s.code() != absl::StatusCode::kResourceExhausted)
              violations.fetch_add(1);
            break;
          }
          case 3: {
            auto lease = store->Acquire(id);
            if (lease.ok()) {
              if (!VerifyEntry(lease->entry()).ok() || lease->entry().id != id) {
                violations.fetch_add(1);
              }
              leases.push_back(std::move(lease).value());
            }
            if (!leases.empty() && (leases.size() > 2 || rng() % 2 == 0)) {
              leases.erase(leases.begin() + rng() % leases.size());
            }
            break;
          }
          case 4:
            if (store->Delete(id).ok()) deleted.fetch_add(1);
            break;
          case 5:
            for (const auto& e : store->List("id1", "", 5)) {
              if (e->id.rfind("id1", 0) != 0) violations.fetch_add(1);
            }
            break;
          case 6:
            (void)store->Peek(id);
            (void)store->CheckCanFit(rng() % 5000);
            break;
          default:
            store->ExpireNow();
            break;
        }
        const CacheStore::Stats st = store->GetStats();
        if (st.used_bytes > kCapacity || st.leased_bytes > st.used_bytes) violations.fetch_add(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(violations.load(), 0);

  // All leases are gone: used bytes are exactly the live entries, none leased.
  const auto all = store->List("", "", 1000);
  uint64_t sum = 0;
  for (const auto& e : all) sum += e->ChargedBytes();
  const CacheStore::Stats st = store->GetStats();
  EXPECT_EQ(st.used_bytes, sum);
  EXPECT_EQ(st.leased_bytes, 0u);
  EXPECT_EQ(st.entries, all.size());
  EXPECT_GT(inserted.load(), 0);
  EXPECT_EQ(inserted.load(), evicted.load() + deleted.load() + static_cast<int64_t>(all.size()));
}

}  // namespace
}  // namespace kvc

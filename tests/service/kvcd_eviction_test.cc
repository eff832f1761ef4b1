// Store policy through the RPCs of a real kvcd: LRU eviction by capacity, read leases that block
// eviction, early budget rejection, and TTL expiry (per upload and the server default).
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::KvcdProcess;
using testing::TestCache;

std::unique_ptr<KvcdProcess> StartKvcd(std::vector<std::string> flags) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = std::move(flags);
  opts.flags.push_back("--backend=cpu");
  auto p = KvcdProcess::Start(opts);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

// `layers` layers of 1 KV head, D = 64, S = 256, f16, uncompressed: about 66 KiB per layer.
TestCache Entry(const std::string& id, uint32_t layers) {
  return testing::MakeTestCache(id, testing::Shape(layers, 1, 1, 64, 256, 0),
                                kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, id.size());
}

double Metric(const KvcdProcess& kvcd, const std::string& series) {
  auto text = testing::HttpGet(kvcd.metrics_address(), "/metrics");
  EXPECT_TRUE(text.ok()) << text.status();
  if (!text.ok()) return -1;
  auto v = testing::MetricValue(*text, series);
  EXPECT_TRUE(v.ok()) << v.status();
  return v.ok() ? *v : -1;
}

TEST(KvcdEvictionTest, LeastRecentlyUsedIsEvictedFirst) {
  auto kvcd =
      StartKvcd({"--store_bytes=210KiB", "--max_cache_bytes=210KiB", "--max_chunk_bytes=16KiB"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  for (const char* id : {"a", "b", "c"})
    ASSERT_TRUE(testing::PutCache(stub.get(), Entry(id, 1)).ok());
  EXPECT_THAT(testing::ViewStore(stub.get()).ids, ElementsAre("a", "b", "c"));
  // Reading "a" makes it the most recently used; "b" is now the oldest.
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("a");
  testing::Fetched f;
  ASSERT_TRUE(testing::Get(stub.get(), get, &f).ok());
  ASSERT_TRUE(testing::PutCache(stub.get(), Entry("d", 1)).ok());
  const auto view = testing::ViewStore(stub.get());
  EXPECT_THAT(view.ids, ElementsAre("a", "c", "d"));
  EXPECT_LE(view.used_bytes, 210u << 10);
  EXPECT_EQ(Metric(*kvcd, "kvc_evictions_total{reason=\"capacity\"}"), 1.0);
  EXPECT_EQ(Metric(*kvcd, "kvc_store_entries"), 3.0);
}

TEST(KvcdEvictionTest, UploadThatCannotFitIsRejectedEarlyAndChangesNothing) {
  auto kvcd = StartKvcd({"--store_bytes=210KiB", "--max_cache_bytes=1MiB"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  ASSERT_TRUE(testing::PutCache(stub.get(), Entry("keep", 1)).ok());
  const auto before = testing::ViewStore(stub.get());
  // Four layers (about 264 KiB) exceed the 210 KiB budget: refused at the header.
  grpc::Status s = testing::PutCache(stub.get(), Entry("toobig", 4));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("cannot fit"));
  EXPECT_EQ(testing::ViewStore(stub.get()), before);
  EXPECT_GE(Metric(*kvcd, "kvc_rejected_requests_total{reason=\"budget\"}"), 1.0);
}

TEST(KvcdEvictionTest, AnEntryBeingReadIsNotEvicted) {
  auto kvcd =
      StartKvcd({"--store_bytes=12MiB", "--max_cache_bytes=12MiB", "--max_chunk_bytes=16KiB"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  // 1 layer, 4 heads, D = 128, S = 4096, f16: 8 MiB of K + V, more than gRPC buffers for a
  // reader that does not read.
  auto big = [](const std::string& id) {
    return testing::MakeTestCache(id, testing::Shape(1, 4, 4, 128, 4096, 0), kvcache::v1::DTYPE_F16,
                                  kvcache::v1::LAYOUT_HND, 7);
  };
  ASSERT_TRUE(testing::PutCache(stub.get(), big("big1")).ok());
  // Open a GetCache stream and read only its first message: the lease is held.
  grpc::ClientContext ctx;
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("big1");
  auto reader = stub->GetCache(&ctx, get);
  kvcache::v1::GetCacheResponse first;
  ASSERT_TRUE(reader->Read(&first));
  ASSERT_TRUE(first.has_info());
  const auto before = testing::ViewStore(stub.get());
  grpc::Status s = testing::PutCache(stub.get(), big("big2"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_EQ(testing::ViewStore(stub.get()), before);
  // Finish the read: the lease ends and big1 becomes evictable.
  kvcache::v1::GetCacheResponse msg;
  uint64_t bytes = 0;
  while (reader->Read(&msg)) bytes += msg.data().size();
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_GT(bytes, 8u << 20);
  s = testing::PutCache(stub.get(), big("big2"));
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_THAT(testing::ViewStore(stub.get()).ids, ElementsAre("big2"));
}

TEST(KvcdEvictionTest, CancellingAReadReleasesItsLease) {
  auto kvcd =
      StartKvcd({"--store_bytes=32MiB", "--max_cache_bytes=32MiB", "--max_chunk_bytes=16KiB"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  ASSERT_TRUE(testing::PutCache(stub.get(), testing::MakeTestCache(
                                                "read/a", testing::Shape(1, 4, 4, 128, 4096, 0),
                                                kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 3))
                  .ok());
  grpc::ClientContext ctx;
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("read/a");
  auto reader = stub->GetCache(&ctx, get);
  kvcache::v1::GetCacheResponse first;
  ASSERT_TRUE(reader->Read(&first));
  // Deleted while being read: gone from the listing, but its bytes stay until the read ends.
  {
    grpc::ClientContext c;
    kvcache::v1::DeleteCacheRequest del;
    del.set_cache_id("read/a");
    kvcache::v1::DeleteCacheResponse resp;
    ASSERT_TRUE(stub->DeleteCache(&c, del, &resp).ok());
  }
  auto view = testing::ViewStore(stub.get());
  EXPECT_TRUE(view.ids.empty());
  EXPECT_GT(view.used_bytes, 8u << 20);
  ctx.TryCancel();
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (testing::ViewStore(stub.get()).used_bytes != 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_EQ(testing::ViewStore(stub.get()).used_bytes, 0u);
}

TEST(KvcdEvictionTest, CachesExpireAfterTheirTtl) {
  auto kvcd = StartKvcd({"--default_ttl_seconds=1", "--ttl_sweep_seconds=0.1"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  TestCache defaulted = Entry("ttl/default", 1);
  TestCache explicit_short = Entry("ttl/short", 1);
  explicit_short.header.set_ttl_seconds(1);
  TestCache long_lived = Entry("ttl/long", 1);
  long_lived.header.set_ttl_seconds(3600);
  for (const auto* c : {&defaulted, &explicit_short, &long_lived}) {
    ASSERT_TRUE(testing::PutCache(stub.get(), *c).ok());
  }
  {
    grpc::ClientContext ctx;
    kvcache::v1::StatCacheRequest req;
    req.set_cache_id("ttl/default");
    kvcache::v1::CacheInfo info;
    ASSERT_TRUE(stub->StatCache(&ctx, req, &info).ok());
    EXPECT_EQ(info.expires_unix_ms() - info.created_unix_ms(), 1000);
  }
  const uint64_t used_before = testing::ViewStore(stub.get()).used_bytes;
  absl::SleepFor(absl::Milliseconds(1600));
  // The sweep removed both short-lived caches; the other stays.
  const auto view = testing::ViewStore(stub.get());
  EXPECT_THAT(view.ids, ElementsAre("ttl/long"));
  EXPECT_EQ(view.entries, 1u);
  EXPECT_LT(view.used_bytes, used_before / 2);
  grpc::ClientContext ctx;
  kvcache::v1::StatCacheRequest req;
  req.set_cache_id("ttl/short");
  kvcache::v1::CacheInfo info;
  EXPECT_EQ(stub->StatCache(&ctx, req, &info).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Metric(*kvcd, "kvc_evictions_total{reason=\"ttl\"}"), 2.0);
}

}  // namespace
}  // namespace kvc

// Fetches (kvcache/v1/transfer.proto, Fetch) from kvcd's store, with kvcd assembled in process
// as kvcd_main.cc assembles it (ingest sink, store source, transfer service as an extra service)
// so that the fake data plane serves both ranks and corruption can be injected into the stored
// entry (the store never corrupts data through its API): the blobs equal GetCache PACKED byte
// for byte over NCCL (fake) and GRPC_BYTES sessions, served bytes are counted, corruption is
// DATA_LOSS before any of the corrupt layer's bytes go out, and the entry outlives a delete
// while a fetch holds its lease.
#include <memory>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvc/cache_store.h"
#include "kvc/transfer.h"
#include "kvc/transfer_client.h"
#include "server/ingest_registry.h"
#include "server/server.h"
#include "server/transfer_source.h"
#include "testing/fake_communicator.h"
#include "testing/in_process_kvcd.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using transfer::TransferClient;

class TransferFetchKvcdTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server::KvcServer::Options options = testing::InProcessKvcdOptions(16 << 10);
    options.extra_services.push_back(
        [this](const server::ServerResources& r) -> absl::StatusOr<std::unique_ptr<grpc::Service>> {
          store_ = r.store;
          metrics_ = r.metrics;
          source_ = std::make_unique<server::StoreTransferSource>(r.store, r.metrics);
          r.state->ingest = &registry_;
          transfer::TransferServiceOptions t;
          t.sink = &sink_;
          t.source = source_.get();
          t.factory = &fake_;
          t.limits.fetch_chunk_bytes = 10 << 10;  // several GRPC_BYTES pieces per layer
          return transfer::CreateTransferService(t);
        });
    auto server = server::KvcServer::Create(std::move(options));
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    channel_ =
        grpc::CreateCustomChannel(server_->address(), grpc::InsecureChannelCredentials(), args);
    stub_ = testing::NewStub(server_->address());
    // Three layers of 2048 tokens x 1 KV head x 64 dims fp16: each blob spans 4+ checksum blocks.
    const testing::TestCache c =
        testing::MakeTestCache("c", testing::Shape(3, 1, 1, 64, 2048, 0), kvcache::v1::DTYPE_F16,
                               kvcache::v1::LAYOUT_HND, 1);
    ASSERT_TRUE(testing::PutCache(stub_.get(), c).ok());
    kvcache::v1::GetCacheRequest get;
    get.set_cache_id("c");
    get.set_format(kvcache::v1::FORMAT_PACKED);
    ASSERT_TRUE(testing::Get(stub_.get(), get, &packed_).ok());
    ASSERT_GT(NumChecksumBlocks(packed_.part(1, kvcache::v1::PART_PACKED).size()), 2u);
  }

  std::unique_ptr<TransferClient> Client(const std::string& id, bool nccl) {
    TransferClient::Options o;
    o.client_id = id;
    o.factory = nccl ? &fake_ : nullptr;
    o.join_timeout = absl::Seconds(5);
    o.send_timeout = absl::Seconds(5);
    auto c = std::make_unique<TransferClient>(channel_, o);
    EXPECT_TRUE(c->Open().ok());
    return c;
  }

  // The stored entry, modified behind the store's back.
  CacheEntry& Stored() {
    auto entry = store_->Peek("c");
    EXPECT_TRUE(entry.ok());
    return const_cast<CacheEntry&>(**entry);
  }

  std::string Packed(uint32_t layer) const { return packed_.part(layer, kvcache::v1::PART_PACKED); }
  static std::string Str(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }

  double Served() {
    return testing::MetricValue(metrics_->Scrape(), "kvc_served_bytes_total").value_or(-1);
  }

  testing::FakeFactory fake_;
  server::IngestRegistry registry_;
  server::TransferIngestSink sink_{&registry_};
  std::unique_ptr<server::StoreTransferSource> source_;  // outlives server_ (declared first)
  CacheStore* store_ = nullptr;
  Metrics* metrics_ = nullptr;
  std::unique_ptr<server::KvcServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<kvcache::v1::KvCache::Stub> stub_;
  testing::Fetched packed_;
};

TEST_F(TransferFetchKvcdTest, FetchedBlobsEqualGetCachePacked) {
  for (bool nccl : {true, false}) {
    auto client = Client(nccl ? "decode-nccl" : "decode-bytes", nccl);
    EXPECT_EQ(client->transport(), nccl ? kvcache::v1::TRANSFER_TRANSPORT_NCCL
                                        : kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
    const double served = Served();
    auto all = client->Fetch("c");
    ASSERT_TRUE(all.ok()) << all.status();
    EXPECT_EQ(all->info.SerializeAsString(), packed_.info.SerializeAsString());
    ASSERT_EQ(all->layers.size(), 3u);
    uint64_t bytes = 0;
    for (uint32_t l = 0; l < 3; ++l) {
      EXPECT_EQ(Str(all->layers[l]), Packed(l)) << "layer " << l << (nccl ? " nccl" : " bytes");
      bytes += all->layers[l].size();
    }
    // Counted as GetCache counts its data bytes.
    EXPECT_EQ(Served() - served, static_cast<double>(bytes));

    auto range = client->Fetch("c", 1, 2);
    ASSERT_TRUE(range.ok()) << range.status();
    EXPECT_EQ(range->layer_begin, 1u);
    ASSERT_EQ(range->layers.size(), 1u);
    EXPECT_EQ(Str(range->layers[0]), Packed(1));
    ASSERT_TRUE(client->Close().ok());
  }
}

TEST_F(TransferFetchKvcdTest, UnknownCacheAndBadRange) {
  auto client = Client("decode-errors", /*nccl=*/true);
  auto unknown = client->Fetch("not-stored");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
  EXPECT_NE(unknown.status().message().find("'not-stored' not found"), std::string::npos)
      << unknown.status();
  auto bad = client->Fetch("c", 2, 4);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
  EXPECT_NE(bad.status().message().find("[2, 4) is not a range within [0, 3]"), std::string::npos)
      << bad.status();
  auto good = client->Fetch("c", 2);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(Str(good->layers[0]), Packed(2));
}

// Fetch names caches by GetCache's rules: an id GetCache refuses is INVALID_ARGUMENT here too
// (it used to be looked up whenever its length was right), and the session carries on.
TEST_F(TransferFetchKvcdTest, CacheIdsAreValidatedLikeGetCache) {
  auto client = Client("decode-ids", /*nccl=*/false);
  const std::string bad_ids[] = {"a b", "caf\xc3\xa9", "a\nb", std::string("c\0", 2),
                                 "x*",  "\xff\xfe",    "c?"};
  for (const std::string& id : bad_ids) {
    kvcache::v1::GetCacheRequest get;
    get.set_cache_id(id);
    testing::Fetched ignored;
    EXPECT_EQ(testing::Get(stub_.get(), get, &ignored).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT);
    auto f = client->Fetch(id);
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << f.status();
    // (Invalid UTF-8 never reaches the handler: protobuf refuses the string field.)
    EXPECT_NE(f.status().message().find("cache_id"), std::string::npos) << f.status();
  }
  auto good = client->Fetch("c", 0, 1);
  ASSERT_TRUE(good.ok()) << good.status();
  EXPECT_EQ(Str(good->layers[0]), Packed(0));
}

TEST_F(TransferFetchKvcdTest, CorruptBlockIsDataLossBeforeAnyOfItsLayerGoesOut) {
  for (bool nccl : {true, false}) {
    auto client = Client(nccl ? "corrupt-nccl" : "corrupt-bytes", nccl);
    ByteVector& blob = Stored().layers[1];
    blob[blob.size() / 2] ^= 0x40;
    std::vector<uint32_t> got;
    absl::Status s = client->Fetch(
        "c", 0, std::nullopt,
        [](const kvcache::v1::CacheInfo&, uint32_t, uint32_t) { return absl::OkStatus(); },
        [&](uint32_t layer, absl::Span<const uint8_t> b) {
          EXPECT_EQ(std::string(b.begin(), b.end()), Packed(layer));
          got.push_back(layer);
          return absl::OkStatus();
        });
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_NE(s.message().find("'c'"), std::string::npos) << s;
    EXPECT_NE(s.message().find("layer 1 block"), std::string::npos) << s;
    EXPECT_EQ(got, std::vector<uint32_t>{0});
    blob[blob.size() / 2] ^= 0x40;  // intact again: the same session fetches it whole
    auto again = client->Fetch("c");
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(Str(again->layers[1]), Packed(1));
  }
}

TEST_F(TransferFetchKvcdTest, TamperedBlockTableIsDataLossBeforeTheHeader) {
  auto client = Client("table", /*nccl=*/true);
  Stored().block_checksums[2][0] ^= 1;
  bool info_seen = false;
  absl::Status s = client->Fetch(
      "c", 0, 1,
      [&](const kvcache::v1::CacheInfo&, uint32_t, uint32_t) {
        info_seen = true;
        return absl::OkStatus();
      },
      [](uint32_t, absl::Span<const uint8_t>) { return absl::OkStatus(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("block checksum table"), std::string::npos) << s;
  EXPECT_FALSE(info_seen);
}

TEST_F(TransferFetchKvcdTest, FetchHoldsTheEntryThroughADelete) {
  auto client = Client("lease", /*nccl=*/true);
  std::vector<std::string> got;
  absl::Status s = client->Fetch(
      "c", 0, std::nullopt,
      [&](const kvcache::v1::CacheInfo&, uint32_t, uint32_t) {
        EXPECT_GT(store_->GetStats().leased_bytes, 0u);  // the fetch's lease
        grpc::ClientContext ctx;
        kvcache::v1::DeleteCacheRequest del;
        del.set_cache_id("c");
        kvcache::v1::DeleteCacheResponse resp;
        EXPECT_TRUE(stub_->DeleteCache(&ctx, del, &resp).ok());
        return absl::OkStatus();
      },
      [&](uint32_t, absl::Span<const uint8_t> b) {
        got.emplace_back(b.begin(), b.end());
        return absl::OkStatus();
      });
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(got.size(), 3u);
  for (uint32_t l = 0; l < 3; ++l) EXPECT_EQ(got[l], Packed(l)) << "layer " << l;
  auto gone = client->Fetch("c");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kNotFound) << gone.status();
  EXPECT_EQ(store_->GetStats().leased_bytes, 0u);
}

}  // namespace
}  // namespace kvc

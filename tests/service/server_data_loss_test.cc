// GetCache checks the block checksum table before sending anything and each block just before
// its bytes are sent: a corrupted block ends the stream with DATA_LOSS before any of its bytes
// go out. The corruption is injected in-process (the store never corrupts data through its API),
// so this test runs the KvCache service on an in-process gRPC server. Under bearer tokens the
// messages name the caller's cache id, never the tenant-qualified store id.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"
#include "kvc/compact.h"
#include "kvc/thread_pool.h"
#include "server/auth.h"
#include "server/service_impl.h"
#include "testing/kvc_rpc.h"
#include "testing/service_on_loopback.h"

namespace kvc::server {
namespace {

class ServerDataLossTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = CreateCpuBackend(BackendOptions{});
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    if (!Tenant().empty()) {
      auto auth = TokenAuth::Parse(std::string(kToken) + " " + Tenant() + "\n");
      ASSERT_TRUE(auth.ok()) << auth.status();
      auth_ = *std::move(auth);
    }
    auto configure = [this](ServiceState* state) {
      state->auth = auth_.get();
      // Chunks not aligned to the 64 KiB checksum blocks: a block may straddle two chunks.
      state->config.max_chunk_bytes = 96 << 10;
    };
    ASSERT_TRUE(loopback_.Start(backend_.get(), &pool_, configure,
                                Tenant().empty() ? "" : kToken));
    stub_ = loopback_.stub();
    // Two layers of 2048 tokens x 1 KV head x 64 dims fp16: each blob spans 8+ checksum blocks.
    auto cache = testing::MakeTestCache("c", testing::Shape(2, 1, 1, 64, 2048, 0),
                                        kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 1);
    grpc::Status put = testing::PutCache(stub_, cache);
    ASSERT_TRUE(put.ok()) << put.error_message();
    get_.set_cache_id("c");
    ASSERT_TRUE(testing::Get(stub_, get_, &good_).ok());
  }

  // The stored entry, modified behind the store's back (the store never corrupts data through
  // its API).
  CacheEntry& Stored() {
    auto entry = loopback_.store()->Peek(Tenant().empty() ? "c" : Tenant() + "/c");
    EXPECT_TRUE(entry.ok());
    return const_cast<CacheEntry&>(**entry);
  }

  // Flips a bit of layer 1's `blob` at `at` for one DENSE or DENSE_CONTIGUOUS `get` and checks
  // how the stream ends against the intact `good` fetch: DATA_LOSS naming the block, layer 0
  // whole, and of layer 1 no key when the bad block is one the keys' export reads (`in_keys`),
  // else the keys whole and the values up to the bad block's chunk.
  void ExpectLayerOneStopsAt(const kvcache::v1::GetCacheRequest& get, ByteVector& blob, size_t at,
                             bool in_keys, const testing::Fetched& good) {
    SCOPED_TRACE(in_keys ? "a key block" : "a value block");
    blob[at] ^= 0x10;
    testing::Fetched bad;
    grpc::Status s = testing::Get(stub_, get, &bad);
    blob[at] ^= 0x10;
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
    EXPECT_THAT(s.error_message(),
                ::testing::HasSubstr(absl::StrCat("layer 1 block ", at / kChecksumBlockBytes)));
    for (auto part : {kvcache::v1::PART_K, kvcache::v1::PART_V, kvcache::v1::PART_POSITIONS}) {
      EXPECT_EQ(bad.part(0, part), good.part(0, part));
    }
    if (in_keys) {
      EXPECT_EQ(bad.parts.count({1, kvcache::v1::PART_K}), 0u);
      return;
    }
    EXPECT_EQ(bad.part(1, kvcache::v1::PART_K), good.part(1, kvcache::v1::PART_K));
    const std::string& partial = bad.part(1, kvcache::v1::PART_V);
    EXPECT_GT(partial.size(), 0u);
    EXPECT_LT(partial.size(), good.part(1, kvcache::v1::PART_V).size());
    EXPECT_EQ(partial, good.part(1, kvcache::v1::PART_V).substr(0, partial.size()));
  }

  // The tenant the calls authenticate as ("" = no authentication).
  virtual std::string Tenant() const { return ""; }
  static constexpr char kToken[] = "token-data-loss-0123";

  std::unique_ptr<TokenAuth> auth_;
  std::unique_ptr<Backend> backend_;
  ThreadPool pool_{2};  // one compression worker
  testing::ServiceOnLoopback loopback_;  // declared last: stops serving first
  kvcache::v1::KvCache::Stub* stub_ = nullptr;
  kvcache::v1::GetCacheRequest get_;
  testing::Fetched good_;
};

// Each block is verified just before it is sent: the layers before the corrupt block arrive
// whole (and verified), no byte of the corrupt block's chunk goes out, the stream ends DATA_LOSS
// naming the cache, the layer and the block.
TEST_F(ServerDataLossTest, CorruptBlockEndsTheStreamBeforeItsBytes) {
  ASSERT_GT(NumChecksumBlocks(Stored().layers[1].size()), 2u);
  ByteVector& blob = Stored().layers[1];
  blob[blob.size() / 2] ^= 0x40;
  testing::Fetched bad;
  grpc::Status s = testing::Get(stub_, get_, &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("'c'"));
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("layer 1 block"));
  EXPECT_EQ(bad.part(0, kvcache::v1::PART_PACKED), good_.part(0, kvcache::v1::PART_PACKED));
  // Only chunks wholly before the corrupt block's chunk of layer 1 may have gone out.
  const std::string& partial = bad.part(1, kvcache::v1::PART_PACKED);
  EXPECT_GT(partial.size(), 0u);
  EXPECT_LT(partial.size(), blob.size() / 2);
  EXPECT_EQ(partial, good_.part(1, kvcache::v1::PART_PACKED).substr(0, partial.size()));
}

TEST_F(ServerDataLossTest, CorruptFirstBlockSendsNoCacheBytes) {
  Stored().layers[0][3] ^= 1;
  testing::Fetched bad;
  grpc::Status s = testing::Get(stub_, get_, &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("layer 0 block 0"));
  EXPECT_TRUE(bad.parts.empty());
}

TEST_F(ServerDataLossTest, TamperedBlockTableIsDataLossBeforeAnything) {
  Stored().block_checksums[1][0] ^= 1;
  testing::Fetched bad;
  grpc::Status s = testing::Get(stub_, get_, &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("block checksum table"));
  EXPECT_EQ(bad.messages, 0);
}

// DENSE checks a layer's header blocks before any of its bytes go out.
TEST_F(ServerDataLossTest, DenseVerifiesTheLayersHeaderFirst) {
  Stored().layers[1][100] ^= 1;
  get_.set_format(kvcache::v1::FORMAT_DENSE);
  testing::Fetched dense_good, bad;
  Stored().layers[1][100] ^= 1;  // intact again: the reference
  ASSERT_TRUE(testing::Get(stub_, get_, &dense_good).ok());
  Stored().layers[1][100] ^= 1;
  grpc::Status s = testing::Get(stub_, get_, &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("layer 1 block 0"));
  EXPECT_EQ(bad.part(0, kvcache::v1::PART_K), dense_good.part(0, kvcache::v1::PART_K));
  EXPECT_EQ(bad.parts.count({1, kvcache::v1::PART_K}), 0u);
}

// A layer stored whole goes out DENSE from the blob itself (no export): its header blocks are
// verified before anything of it is sent, each run's blocks as they go out, so a corrupt block in
// the middle of the keys ends the stream after the keys' chunks before it, none of its own.
TEST_F(ServerDataLossTest, DenseFromTheBlobVerifiesEachBlockAsItGoes) {
  get_.set_format(kvcache::v1::FORMAT_DENSE);
  testing::Fetched dense_good, bad;
  ASSERT_TRUE(testing::Get(stub_, get_, &dense_good).ok());
  ByteVector& blob = Stored().layers[1];
  const size_t at = blob.size() / 4;  // inside the keys: positions and indices come first
  ASSERT_LT(at, blob.size() / 2);
  blob[at] ^= 0x10;
  grpc::Status s = testing::Get(stub_, get_, &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_THAT(s.error_message(),
              ::testing::HasSubstr(absl::StrCat("layer 1 block ", at / kChecksumBlockBytes)));
  EXPECT_EQ(bad.part(0, kvcache::v1::PART_K), dense_good.part(0, kvcache::v1::PART_K));
  EXPECT_EQ(bad.part(0, kvcache::v1::PART_V), dense_good.part(0, kvcache::v1::PART_V));
  // Some of layer 1's keys went out (an export would have sent none), all before the block.
  const std::string& partial = bad.part(1, kvcache::v1::PART_K);
  EXPECT_GT(partial.size(), 0u);
  EXPECT_LT(partial.size(), dense_good.part(1, kvcache::v1::PART_K).size());
  EXPECT_EQ(partial, dense_good.part(1, kvcache::v1::PART_K).substr(0, partial.size()));
  EXPECT_EQ(bad.parts.count({1, kvcache::v1::PART_V}), 0u);
}

// DENSE_CONTIGUOUS of a layer kept whole or evicted only: the keys are turned on the pool from
// the blob (their blocks verified first, so a corrupt key block sends none of the layer's
// keys), the values and positions go out from the blob, verified block by block as they go.
TEST_F(ServerDataLossTest, ContiguousVerifiesTheKeysBeforeTurningThemAndTheValuesAsTheyGo) {
  get_.set_format(kvcache::v1::FORMAT_DENSE_CONTIGUOUS);
  get_.mutable_rope()->set_theta(10000);
  get_.mutable_rope()->set_style(kvcache::v1::ROPE_HALF_SPLIT);
  testing::Fetched good;
  ASSERT_TRUE(testing::Get(stub_, get_, &good).ok());
  ByteVector& blob = Stored().layers[1];
  for (const size_t at : {blob.size() / 4, blob.size() * 3 / 4}) {  // in the keys, the values
    ExpectLayerOneStopsAt(get_, blob, at, /*in_keys=*/at < blob.size() / 2, good);
  }
}

// DENSE of a layer whose only change is pruned key channels (ThinK on the keys): the keys are
// exported on the pool after every block outside the value and position runs is verified (a
// corrupt key block sends none of the layer's keys); the values go out from the blob, verified
// block by block as they go (a corrupt value block ends the stream after the layer's keys and
// the values before it). A whole-layer export would have sent none of layer 1 in either case.
TEST_F(ServerDataLossTest, KeyPrunedDenseVerifiesTheKeysBeforeExportingAndTheValuesAsTheyGo) {
  auto cache = testing::MakeTestCache("t", testing::Shape(2, 1, 1, 64, 2048, 16),
                                      kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 2);
  cache.header.mutable_compression()->mutable_channels()->set_key_policy("think");
  cache.header.mutable_compression()->mutable_channels()->set_key_lambda(0.5);
  ASSERT_TRUE(testing::PutCache(stub_, cache).ok());
  auto entry = loopback_.store()->Peek(Tenant().empty() ? "t" : Tenant() + "/t");
  ASSERT_TRUE(entry.ok());
  ByteVector& blob = const_cast<CacheEntry&>(**entry).layers[1];
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob);
  ASSERT_TRUE(view.ok()) << view.status();
  DenseRuns runs;
  ASSERT_TRUE(DenseValueRunsOf(*view, &runs));  // keys pruned, values whole
  const CompactHead head = view->head(0);
  ASSERT_LT(head.key_channels, 64);
  const auto offset = [&](const void* p, size_t rows, size_t row_bytes) {
    return static_cast<size_t>(static_cast<const uint8_t*>(p) - blob.data()) +
           rows / 2 * row_bytes;
  };
  const int old_rows = head.n_kept - head.n_recent;
  const size_t key_at = offset(head.key_old, old_rows, head.key_channels * 2);
  const size_t value_at = offset(head.value_old, old_rows, 64 * 2);
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("t");
  get.set_format(kvcache::v1::FORMAT_DENSE);
  testing::Fetched good;
  ASSERT_TRUE(testing::Get(stub_, get, &good).ok());
  ExpectLayerOneStopsAt(get, blob, key_at, /*in_keys=*/true, good);
  ExpectLayerOneStopsAt(get, blob, value_at, /*in_keys=*/false, good);
}

// DENSE of a head-adaptive layer from the blob: the padding of the head that keeps fewer tokens
// goes out from constant bytes, and the blob's own runs are still verified as they go, so a
// corrupt value block ends the stream after the layer's keys and the values before it.
TEST_F(ServerDataLossTest, RaggedDenseFromTheBlobVerifiesTheBlobsRuns) {
  auto cache = testing::MakeTestCache("r", testing::Shape(2, 2, 2, 64, 2048, 16),
                                      kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 3);
  auto* e = cache.header.mutable_compression()->mutable_eviction();
  e->set_policy("h2o");
  e->set_keep_ratio(0.5);
  e->set_adaptive(true);
  e->set_adaptive_floor(0.1);
  ASSERT_TRUE(testing::PutCache(stub_, cache).ok());
  auto entry = loopback_.store()->Peek(Tenant().empty() ? "r" : Tenant() + "/r");
  ASSERT_TRUE(entry.ok());
  ByteVector& blob = const_cast<CacheEntry&>(**entry).layers[1];
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob);
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_NE(view->desc(0).n_kept, view->desc(1).n_kept) << "the heads keep the same count";
  // The last old value row of the last head: the chunks of V before it have gone out.
  const CompactHead head = view->head(1);
  const size_t at = static_cast<size_t>(static_cast<const uint8_t*>(head.value_old) -
                                        blob.data()) +
                    static_cast<size_t>(head.n_kept - head.n_recent - 1) * 64 * 2;
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("r");
  get.set_format(kvcache::v1::FORMAT_DENSE);
  testing::Fetched good;
  ASSERT_TRUE(testing::Get(stub_, get, &good).ok());
  ExpectLayerOneStopsAt(get, blob, at, /*in_keys=*/false, good);
}

class ServerDataLossTenantTest : public ServerDataLossTest {
 protected:
  std::string Tenant() const override { return "alpha"; }
};

// A block found corrupt in the middle of the stream (PACKED while sending, DENSE while exporting)
// ends it with DATA_LOSS quoting the caller's id 'c', not the store's 'alpha/c'.
TEST_F(ServerDataLossTenantTest, MidStreamDataLossQuotesTheCallersId) {
  for (auto format : {kvcache::v1::FORMAT_PACKED, kvcache::v1::FORMAT_DENSE}) {
    SCOPED_TRACE(kvcache::v1::Format_Name(format));
    get_.set_format(format);
    Stored().layers[1][Stored().layers[1].size() / 2] ^= 0x40;
    testing::Fetched bad;
    grpc::Status s = testing::Get(stub_, get_, &bad);
    Stored().layers[1][Stored().layers[1].size() / 2] ^= 0x40;
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
    EXPECT_THAT(s.error_message(), ::testing::HasSubstr("cache 'c': layer 1 block"));
    EXPECT_THAT(s.error_message(), ::testing::Not(::testing::HasSubstr("alpha")));
    EXPECT_GT(bad.messages, 1) << "the stream should have started before the corrupt block";
  }
}

}  // namespace
}  // namespace kvc::server

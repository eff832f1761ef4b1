// PutCache/GetCache through a real kvcd: bit-exact round trips, compressed output equal to the
// engine's own, DENSE equal to ExportDense, layer ranges, chunk limits, concurrent clients.
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/contiguous_export.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"
#include "testing/shared_kvcd.h"

namespace kvc {
namespace {

using kvcache::v1::GetCacheRequest;
using testing::Fetched;
using testing::KvcdProcess;
using testing::TestCache;

constexpr uint64_t kChunkLimit = 16 << 10;

class KvcdPutGetTest : public testing::SharedKvcdTest<KvcdPutGetTest> {
 public:
  static std::vector<std::string> KvcdFlags() {
    return {"--store_bytes=64MiB", "--backend=cpu", "--max_chunk_bytes=16KiB",
            "--max_message_bytes=64KiB"};
  }

 protected:
  void SetUp() override {
    SharedKvcdTest::SetUp();
    if (HasFatalFailure()) return;
    stub_ = testing::NewStub(kvcd_->address());
  }

  std::unique_ptr<kvcache::v1::KvCache::Stub> stub_;
};

std::string Bytes(absl::Span<const uint8_t> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size());
}

// The same config as the engine's spec (what the server must map it to).
CompressionSpec CompressedSpec() {
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kSnapKV;
  s.eviction.keep_ratio = 0.25;
  s.channels.key_policy = ChannelPolicy::kThink;
  s.channels.key_lambda = 0.5;
  s.quant.bits = 4;
  s.recent_tokens = 16;
  return s;
}

// The engine's own blobs for a test cache, on a local CPU backend.
std::vector<CompactLayer> CompressLocally(const TestCache& cache, const CompressionSpec& spec) {
  auto backend = CreateCpuBackend(BackendOptions{});
  EXPECT_TRUE(backend.ok()) << backend.status();
  std::vector<CompactLayer> out;
  for (size_t l = 0; l < cache.k.size(); ++l) {
    LayerInput in;
    in.shape = cache.layer_shape();
    in.dtype = cache.dtype();
    in.layout = cache.layout();
    in.layer_index = static_cast<int>(l);
    in.k = cache.k[l].data();
    in.v = cache.v[l].data();
    in.q_obs = in.shape.obs_window > 0 ? cache.q[l].data() : nullptr;
    auto layer = (*backend)->Compress(in, spec, nullptr);
    EXPECT_TRUE(layer.ok()) << layer.status();
    out.push_back(layer.ok() ? *std::move(layer) : CompactLayer{});
  }
  return out;
}

TEST_F(KvcdPutGetTest, UncompressedRoundTripIsBitExactForEveryDtypeAndLayout) {
  const kvcache::v1::DType dtypes[] = {kvcache::v1::DTYPE_F32, kvcache::v1::DTYPE_F16,
                                       kvcache::v1::DTYPE_BF16};
  const kvcache::v1::Layout layouts[] = {kvcache::v1::LAYOUT_HND, kvcache::v1::LAYOUT_NHD};
  int n = 0;
  for (auto dtype : dtypes) {
    for (auto layout : layouts) {
      const std::string id = "exact/" + std::to_string(n);
      TestCache cache =
          testing::MakeTestCache(id, testing::Shape(2, 2, 4, 16, 40, 0), dtype, layout, 100 + n);
      // Chunks in a shuffled order for every other case: placement is by offset.
      kvcache::v1::PutCacheResponse resp;
      ASSERT_TRUE(
          testing::Put(stub_.get(), testing::MakeRequests(cache, 1000, n % 2 ? 7 : 0), &resp).ok());
      EXPECT_EQ(resp.input_bytes(), cache.kv_bytes());
      EXPECT_EQ(resp.backend(), "cpu");
      GetCacheRequest req;
      req.set_cache_id(id);
      req.set_format(kvcache::v1::FORMAT_DENSE);
      Fetched got;
      grpc::Status s = testing::Get(stub_.get(), req, &got);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(got.info.cache_id(), id);
      EXPECT_EQ(got.info.input_bytes(), cache.kv_bytes());
      const LayerShape shape = cache.layer_shape();
      const size_t es = DTypeSize(cache.dtype());
      for (uint32_t l = 0; l < 2; ++l) {
        auto k = cache.k[l], v = cache.v[l];
        if (layout == kvcache::v1::LAYOUT_NHD) {
          k = testing::NhdToHnd(k, shape.num_kv_heads, shape.seq_len, shape.head_dim, es);
          v = testing::NhdToHnd(v, shape.num_kv_heads, shape.seq_len, shape.head_dim, es);
        }
        EXPECT_EQ(got.part(l, kvcache::v1::PART_K), Bytes(k)) << "case " << n << " layer " << l;
        EXPECT_EQ(got.part(l, kvcache::v1::PART_V), Bytes(v)) << "case " << n << " layer " << l;
        std::vector<int32_t> positions;
        for (int h = 0; h < shape.num_kv_heads; ++h) {
          for (int t = 0; t < shape.seq_len; ++t) positions.push_back(t);
        }
        std::string expected_pos(reinterpret_cast<const char*>(positions.data()),
                                 positions.size() * 4);
        EXPECT_EQ(got.part(l, kvcache::v1::PART_POSITIONS), expected_pos);
        EXPECT_EQ(got.kept_tokens[l], static_cast<uint32_t>(shape.seq_len));
      }
      ++n;
    }
  }
}

TEST_F(KvcdPutGetTest, PackedEqualsTheEnginesCompressOutput) {
  TestCache cache = testing::MakeTestCache("packed/a", testing::Shape(3, 2, 8, 32, 200, 32),
                                           kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_NHD, 5);
  *cache.header.mutable_compression() = testing::FullCompression();
  kvcache::v1::PutCacheResponse resp;
  grpc::Status s = testing::PutCache(stub_.get(), cache, &resp);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const std::vector<CompactLayer> expected = CompressLocally(cache, CompressedSpec());
  uint64_t expected_bytes = 0;
  for (const auto& l : expected) expected_bytes += l.bytes.size();
  EXPECT_EQ(resp.stored_bytes(), expected_bytes);
  EXPECT_EQ(resp.input_bytes(), cache.kv_bytes());
  EXPECT_DOUBLE_EQ(resp.compression_ratio(), double(cache.kv_bytes()) / expected_bytes);
  EXPECT_GT(resp.compress().total_seconds(), 0.0);

  GetCacheRequest req;
  req.set_cache_id("packed/a");
  Fetched got;
  s = testing::Get(stub_.get(), req, &got);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ASSERT_EQ(got.parts.size(), 3u);
  for (uint32_t l = 0; l < 3; ++l) {
    EXPECT_EQ(got.part(l, kvcache::v1::PART_PACKED), Bytes(expected[l].bytes)) << "layer " << l;
    EXPECT_EQ(got.kept_tokens[l], 50u);  // 0.25 * 200
  }
  EXPECT_LE(got.max_data_bytes, kChunkLimit);
  EXPECT_EQ(got.info.stored_bytes(), expected_bytes);
  ASSERT_EQ(got.info.kept_tokens_size(), 3);
  EXPECT_EQ(got.info.compression().eviction().policy(), "snapkv");
}

// DENSE and DENSE_CONTIGUOUS of a cache that needs an export: quantized and key-pruned (the
// whole layer exported), and key-pruned alone (the keys exported, V and positions sent from the
// blob: DenseValueRunsOf). Each equals the engine's export of the same blob.
TEST_F(KvcdPutGetTest, DenseEqualsExportDenseAndHonoursTheLayerRange) {
  for (const bool quantized : {true, false}) {
    SCOPED_TRACE(quantized ? "snapkv + think + q4" : "snapkv + think");
    const std::string id = quantized ? "dense/a" : "dense/b";
    TestCache cache = testing::MakeTestCache(id, testing::Shape(4, 2, 4, 64, 128, 16),
                                             kvcache::v1::DTYPE_BF16, kvcache::v1::LAYOUT_HND, 9);
    *cache.header.mutable_compression() = testing::FullCompression();
    CompressionSpec spec = CompressedSpec();
    if (!quantized) {
      cache.header.mutable_compression()->clear_quant();
      spec.quant.bits = 0;
    }
    ASSERT_TRUE(testing::PutCache(stub_.get(), cache).ok());
    const std::vector<CompactLayer> blobs = CompressLocally(cache, spec);
    for (const bool contiguous : {false, true}) {
      SCOPED_TRACE(contiguous ? "DENSE_CONTIGUOUS" : "DENSE");
      RopeParams rope;
      rope.half_split = true;
      GetCacheRequest req;
      req.set_cache_id(id);
      req.set_format(contiguous ? kvcache::v1::FORMAT_DENSE_CONTIGUOUS
                                : kvcache::v1::FORMAT_DENSE);
      if (contiguous) {
        req.mutable_rope()->set_theta(rope.theta);
        req.mutable_rope()->set_style(kvcache::v1::ROPE_HALF_SPLIT);
      }
      req.set_layer_begin(1);
      req.set_layer_end(3);
      Fetched got;
      grpc::Status s = testing::Get(stub_.get(), req, &got);
      ASSERT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(got.parts.size(), 6u);  // layers 1 and 2, three parts each
      for (uint32_t l = 1; l < 3; ++l) {
        auto view = CompactLayerView::Parse(blobs[l].bytes);
        ASSERT_TRUE(view.ok()) << view.status();
        DenseRuns runs;
        EXPECT_EQ(DenseValueRunsOf(*view, &runs), !quantized);
        auto dense = contiguous ? ExportDenseContiguous(*view, rope) : ExportDense(*view);
        ASSERT_TRUE(dense.ok()) << dense.status();
        EXPECT_EQ(got.part(l, kvcache::v1::PART_K), Bytes(dense->k)) << "layer " << l;
        EXPECT_EQ(got.part(l, kvcache::v1::PART_V), Bytes(dense->v)) << "layer " << l;
        EXPECT_EQ(got.part(l, kvcache::v1::PART_POSITIONS),
                  std::string(reinterpret_cast<const char*>(dense->positions.data()),
                              dense->positions.size() * 4));
      }
      EXPECT_LE(got.max_data_bytes, kChunkLimit);
      // An empty range sends only the info message.
      req.set_layer_begin(2);
      req.set_layer_end(2);
      Fetched none;
      ASSERT_TRUE(testing::Get(stub_.get(), req, &none).ok());
      EXPECT_EQ(none.messages, 1);
      EXPECT_TRUE(none.parts.empty());
    }
  }
}

TEST_F(KvcdPutGetTest, ConcurrentClientsDoNotSeeEachOthersBytes) {
  constexpr int kClients = 8;
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kClients);
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([i, &failures] {
      auto stub = testing::NewStub(kvcd_->address());
      const std::string id = "concurrent/" + std::to_string(i);
      TestCache cache =
          testing::MakeTestCache(id, testing::Shape(2, 2, 2, 32, 96, 0), kvcache::v1::DTYPE_F32,
                                 kvcache::v1::LAYOUT_HND, 1000 + i);
      grpc::Status s = testing::Put(stub.get(), testing::MakeRequests(cache, 3000, i + 1), nullptr);
      if (!s.ok()) {
        failures[i] = "put: " + s.error_message();
        return;
      }
      GetCacheRequest req;
      req.set_cache_id(id);
      req.set_format(kvcache::v1::FORMAT_DENSE);
      Fetched got;
      s = testing::Get(stub.get(), req, &got);
      if (!s.ok()) {
        failures[i] = "get: " + s.error_message();
        return;
      }
      for (uint32_t l = 0; l < 2; ++l) {
        if (got.part(l, kvcache::v1::PART_K) != Bytes(cache.k[l]) ||
            got.part(l, kvcache::v1::PART_V) != Bytes(cache.v[l])) {
          failures[i] = "bytes differ in layer " + std::to_string(l);
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < kClients; ++i) EXPECT_EQ(failures[i], "") << "client " << i;
}

TEST_F(KvcdPutGetTest, StatListAndDelete) {
  TestCache cache = testing::MakeTestCache("meta/x", testing::Shape(1, 1, 1, 8, 16, 0),
                                           kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 3);
  ASSERT_TRUE(testing::PutCache(stub_.get(), cache).ok());
  kvcache::v1::StatCacheRequest stat;
  stat.set_cache_id("meta/x");
  kvcache::v1::CacheInfo info;
  {
    grpc::ClientContext ctx;
    ASSERT_TRUE(stub_->StatCache(&ctx, stat, &info).ok());
  }
  EXPECT_EQ(info.shape().seq_len(), 16u);
  EXPECT_EQ(info.dtype(), kvcache::v1::DTYPE_F16);
  EXPECT_NE(info.checksum(), 0u);
  EXPECT_EQ(info.expires_unix_ms(), 0);
  {
    grpc::ClientContext ctx;
    kvcache::v1::ListCachesRequest list;
    list.set_prefix("meta/");
    kvcache::v1::ListCachesResponse resp;
    ASSERT_TRUE(stub_->ListCaches(&ctx, list, &resp).ok());
    ASSERT_EQ(resp.caches_size(), 1);
    EXPECT_EQ(resp.caches(0).cache_id(), "meta/x");
  }
  {
    grpc::ClientContext ctx;
    kvcache::v1::DeleteCacheRequest del;
    del.set_cache_id("meta/x");
    kvcache::v1::DeleteCacheResponse resp;
    ASSERT_TRUE(stub_->DeleteCache(&ctx, del, &resp).ok());
    EXPECT_GT(resp.freed_bytes(), info.stored_bytes());
  }
  grpc::ClientContext ctx;
  EXPECT_EQ(stub_->StatCache(&ctx, stat, &info).error_code(), grpc::StatusCode::NOT_FOUND);
}

TEST_F(KvcdPutGetTest, ListCachesPages) {
  for (int i = 0; i < 5; ++i) {
    TestCache c =
        testing::MakeTestCache("page/" + std::to_string(i), testing::Shape(1, 1, 1, 8, 4, 0),
                               kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, i);
    ASSERT_TRUE(testing::PutCache(stub_.get(), c).ok());
  }
  std::vector<std::string> ids;
  std::string token;
  int pages = 0;
  do {
    grpc::ClientContext ctx;
    kvcache::v1::ListCachesRequest req;
    req.set_prefix("page/");
    req.set_page_size(2);
    req.set_page_token(token);
    kvcache::v1::ListCachesResponse resp;
    ASSERT_TRUE(stub_->ListCaches(&ctx, req, &resp).ok());
    EXPECT_LE(resp.caches_size(), 2);
    for (const auto& c : resp.caches()) ids.push_back(c.cache_id());
    token = resp.next_page_token();
    ++pages;
  } while (!token.empty() && pages < 10);
  EXPECT_EQ(pages, 3);
  EXPECT_EQ(ids, (std::vector<std::string>{"page/0", "page/1", "page/2", "page/3", "page/4"}));
}

}  // namespace
}  // namespace kvc

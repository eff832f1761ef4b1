// kvc::Client end to end against the real kvcd on loopback: raw uploads, PACKED and DENSE
// downloads (bit-exact without compression), layer streaming, metadata calls, server errors.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "kvc/client.h"
#include "kvc/compact.h"
#include "kvc/contiguous_export.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"
#include "testing/shared_kvcd.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;
using testing::KvcdProcess;

class ClientKvcdTest : public testing::SharedKvcdTest<ClientKvcdTest> {
 public:
  static std::vector<std::string> KvcdFlags() { return {"--store_bytes=256MiB"}; }

 protected:
  void SetUp() override {
    SharedKvcdTest::SetUp();
    if (HasFatalFailure()) return;
    ClientOptions o;
    o.target = kvcd_->address();
    o.max_chunk_bytes = kMinChunkBytes;  // several chunks per tensor below
    auto c = Client::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }

  // 2 layers of 2 MiB K and V each (fp16, 2 heads x 4096 tokens x 128): two chunks per tensor.
  static testing::TestCache MakeCache(const std::string& id, uint64_t seed) {
    return testing::MakeTestCache(id, testing::Shape(2, 2, 4, 128, 4096, 16), pb::DTYPE_F16,
                                  pb::LAYOUT_HND, seed);
  }
  static std::vector<LayerTensors> Views(const testing::TestCache& c) {
    std::vector<LayerTensors> v;
    for (size_t l = 0; l < c.k.size(); ++l)
      v.push_back({c.k[l].data(), c.v[l].data(), c.q[l].data()});
    return v;
  }

  std::unique_ptr<Client> client_;
};

TEST_F(ClientKvcdTest, DenseRoundTripIsBitExactWithoutCompression) {
  const testing::TestCache cache = MakeCache("exact", 1);
  auto put = client_->PutCache(cache.header, Views(cache));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_EQ(put->cache_id(), "exact");
  EXPECT_EQ(put->input_bytes(), cache.kv_bytes());

  GetOptions opt;
  opt.format = CacheFormat::kDense;
  auto got = client_->GetCache("exact", opt);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->info.cache_id(), "exact");
  ASSERT_EQ(got->layers.size(), 2u);
  for (uint32_t l = 0; l < 2; ++l) {
    const LayerData& d = got->layers[l];
    EXPECT_EQ(d.layer, l);
    EXPECT_EQ(d.kept_tokens, 4096u);
    EXPECT_TRUE(absl::MakeConstSpan(d.k) == absl::MakeConstSpan(cache.k[l])) << "layer " << l;
    EXPECT_TRUE(absl::MakeConstSpan(d.v) == absl::MakeConstSpan(cache.v[l])) << "layer " << l;
    ASSERT_EQ(d.positions.size(), 2u * 4096);
    for (size_t i = 0; i < d.positions.size(); ++i) {
      ASSERT_EQ(d.positions[i], static_cast<int32_t>(i % 4096));
    }
  }
}

TEST_F(ClientKvcdTest, PackedBlobsParseAndMatchDense) {
  testing::TestCache cache = MakeCache("packed", 2);
  cache.header.mutable_compression()->mutable_eviction()->set_policy("snapkv");
  cache.header.mutable_compression()->mutable_eviction()->set_keep_ratio(0.25);
  auto put = client_->PutCache(cache.header, Views(cache));
  ASSERT_TRUE(put.ok()) << put.status();
  EXPECT_GT(put->compression_ratio(), 3.0);

  auto packed = client_->GetCache("packed");
  ASSERT_TRUE(packed.ok()) << packed.status();
  GetOptions dense_opt;
  dense_opt.format = CacheFormat::kDense;
  auto dense = client_->GetCache("packed", dense_opt);
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_EQ(packed->layers.size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    auto view = CompactLayerView::Parse(packed->layers[l].packed);
    ASSERT_TRUE(view.ok()) << view.status();
    EXPECT_EQ(view->num_kv_heads(), 2);
    EXPECT_EQ(view->seq_len(), 4096);
    auto exported = ExportDense(*view);
    ASSERT_TRUE(exported.ok()) << exported.status();
    EXPECT_EQ(exported->n_kept, 1024);
    EXPECT_EQ(dense->layers[l].kept_tokens, 1024u);
    EXPECT_TRUE(absl::MakeConstSpan(exported->k) == absl::MakeConstSpan(dense->layers[l].k));
    EXPECT_TRUE(absl::MakeConstSpan(exported->v) == absl::MakeConstSpan(dense->layers[l].v));
    EXPECT_TRUE(exported->positions == dense->layers[l].positions);
  }
}

TEST_F(ClientKvcdTest, ContiguousExportRotatesKeysAndKeepsValues) {
  testing::TestCache cache = MakeCache("contig", 4);
  cache.header.mutable_compression()->mutable_eviction()->set_policy("snapkv");
  cache.header.mutable_compression()->mutable_eviction()->set_budget(512);
  ASSERT_TRUE(client_->PutCache(cache.header, Views(cache)).ok());
  GetOptions dense_opt;
  dense_opt.format = CacheFormat::kDense;
  auto dense = client_->GetCache("contig", dense_opt);
  ASSERT_TRUE(dense.ok()) << dense.status();
  GetOptions opt = dense_opt;
  opt.contiguous_rope.emplace();
  opt.contiguous_rope->set_theta(10000);
  opt.contiguous_rope->set_style(pb::ROPE_HALF_SPLIT);
  auto got = client_->GetCache("contig", opt);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->layers.size(), 2u);
  for (size_t l = 0; l < 2; ++l) {
    const LayerData& a = dense->layers[l];
    const LayerData& b = got->layers[l];
    EXPECT_EQ(b.kept_tokens, 512u);
    EXPECT_TRUE(absl::MakeConstSpan(a.v) == absl::MakeConstSpan(b.v));
    EXPECT_TRUE(a.positions == b.positions);
    // The same rotation the engine applies (kvc/contiguous_export.h), here by -(4096 - 512).
    DenseLayer want;
    want.num_kv_heads = 2;
    want.n_kept = 512;
    want.head_dim = 128;
    want.seq_len = 4096;
    want.dtype = DType::kF16;
    want.k.resize(a.k.size());
    std::memcpy(want.k.data(), a.k.data(), a.k.size());
    RopeParams rope;
    rope.half_split = true;
    ASSERT_TRUE(RotateKeys(rope, 4096 - 512, &want).ok());
    EXPECT_TRUE(absl::MakeConstSpan(want.k) == absl::MakeConstSpan(b.k)) << "layer " << l;
    EXPECT_FALSE(absl::MakeConstSpan(a.k) == absl::MakeConstSpan(b.k)) << "layer " << l;
  }
  // PACKED has no contiguous form.
  GetOptions bad = opt;
  bad.format = CacheFormat::kPacked;
  EXPECT_EQ(client_->GetCache("contig", bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ClientKvcdTest, StreamingDeliversLayersInRangeAndCallbackErrorsCancel) {
  const testing::TestCache cache = MakeCache("stream", 3);
  ASSERT_TRUE(client_->PutCache(cache.header, Views(cache)).ok());
  GetOptions opt;
  opt.format = CacheFormat::kDense;
  opt.layer_begin = 1;
  opt.layer_end = 2;
  std::vector<uint32_t> seen;
  bool info_first = false;
  absl::Status s = client_->GetCacheStreaming(
      "stream", opt,
      [&](const CacheInfo& info) {
        info_first = seen.empty();
        EXPECT_EQ(info.shape().num_layers(), 2u);
        return absl::OkStatus();
      },
      [&](LayerData&& d) {
        seen.push_back(d.layer);
        EXPECT_TRUE(absl::MakeConstSpan(d.k) == absl::MakeConstSpan(cache.k[1]));
        return absl::OkStatus();
      });
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_TRUE(info_first);
  EXPECT_EQ(seen, std::vector<uint32_t>{1});

  int calls = 0;
  s = client_->GetCacheStreaming("stream", GetOptions{}, nullptr, [&](LayerData&&) {
    ++calls;
    return absl::AbortedError("decoder full");
  });
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_EQ(s.message(), "decoder full");
  EXPECT_EQ(calls, 1);
}

TEST_F(ClientKvcdTest, StatListDeleteAndServerErrors) {
  const testing::TestCache a = MakeCache("meta/a", 4), b = MakeCache("meta/b", 5);
  ASSERT_TRUE(client_->PutCache(a.header, Views(a)).ok());
  ASSERT_TRUE(client_->PutCache(b.header, Views(b)).ok());
  auto info = client_->StatCache("meta/a");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->shape().seq_len(), 4096u);
  EXPECT_EQ(info->input_bytes(), a.kv_bytes());

  auto list = client_->ListCaches("meta/");
  ASSERT_TRUE(list.ok()) << list.status();
  ASSERT_EQ(list->size(), 2u);
  EXPECT_EQ((*list)[0].cache_id(), "meta/a");
  EXPECT_EQ((*list)[1].cache_id(), "meta/b");

  // Server-side errors keep their code.
  EXPECT_EQ(client_->PutCache(a.header, Views(a)).status().code(),
            absl::StatusCode::kAlreadyExists);
  testing::TestCache bad = MakeCache("bad id with spaces", 6);
  const absl::Status s = client_->PutCache(bad.header, Views(bad)).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("cache_id"), absl::string_view::npos) << s;

  auto freed = client_->DeleteCache("meta/a");
  ASSERT_TRUE(freed.ok()) << freed.status();
  EXPECT_GT(*freed, 0u);
  EXPECT_EQ(client_->StatCache("meta/a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->GetCache("meta/a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(client_->DeleteCache("meta/a").status().code(), absl::StatusCode::kNotFound);

  auto server = client_->GetServerInfo();
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_TRUE(server->serving());
  EXPECT_GE(server->limits().max_chunk_bytes(), kMinChunkBytes);
}

}  // namespace
}  // namespace kvc

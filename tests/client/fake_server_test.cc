// The client against an in-process server built from the generated (protobuf-serializing) service:
// checks that raw parsing accepts ordinary protobuf peers, that metadata carries the bearer token,
// that retries happen only where documented, and that a stream contradicting its CacheInfo is
// rejected instead of being written out of bounds.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "kvc/client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;

class FakeService final : public pb::KvCache::Service {
 public:
  std::atomic<int> stat_calls{0};
  std::atomic<int> unavailable_left{0};
  std::string last_authorization;
  std::atomic<int> get_calls{0};

  // What GetCache sends, then the status it ends with. A client that rejects a stream cancels
  // the call and returns at once, while the handler of that call may still be walking its
  // script; so tests replace the script only through here and each call works on its own copy.
  void SetGet(std::vector<pb::GetCacheResponse> script, grpc::Status status = grpc::Status::OK) {
    absl::MutexLock lock(&get_mu_);
    script_ = std::move(script);
    get_status_ = std::move(status);
  }

  grpc::Status StatCache(grpc::ServerContext* ctx, const pb::StatCacheRequest* req,
                         pb::CacheInfo* info) override {
    ++stat_calls;
    auto it = ctx->client_metadata().find("authorization");
    last_authorization =
        it == ctx->client_metadata().end() ? "" : std::string(it->second.data(), it->second.size());
    if (unavailable_left > 0) {
      --unavailable_left;
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "warming up");
    }
    if (req->cache_id() == "perm") return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, "no");
    info->set_cache_id(req->cache_id());
    return grpc::Status::OK;
  }

  // Pages of two ids from `ids` (token = index of the next id); `loop_tokens` hands out the
  // same token forever.
  std::vector<std::string> ids;
  bool loop_tokens = false;
  std::atomic<int> list_calls{0};
  grpc::Status ListCaches(grpc::ServerContext*, const pb::ListCachesRequest* req,
                          pb::ListCachesResponse* resp) override {
    ++list_calls;
    const size_t begin = req->page_token().empty() ? 0 : std::stoul(req->page_token());
    for (size_t i = begin; i < ids.size() && i < begin + 2; ++i) {
      if (ids[i].rfind(req->prefix(), 0) == 0) resp->add_caches()->set_cache_id(ids[i]);
    }
    if (loop_tokens) {
      resp->set_next_page_token("1");
    } else if (begin + 2 < ids.size()) {
      resp->set_next_page_token(std::to_string(begin + 2));
    }
    return grpc::Status::OK;
  }

  grpc::Status GetCache(grpc::ServerContext*, const pb::GetCacheRequest*,
                        grpc::ServerWriter<pb::GetCacheResponse>* writer) override {
    ++get_calls;
    std::vector<pb::GetCacheResponse> script;
    grpc::Status status;
    {
      absl::MutexLock lock(&get_mu_);
      script = script_;
      status = get_status_;
    }
    for (const pb::GetCacheResponse& m : script) {
      if (!writer->Write(m)) break;  // cancelled by the client
    }
    return status;
  }

 private:
  absl::Mutex get_mu_;
  std::vector<pb::GetCacheResponse> script_;
  grpc::Status get_status_ = grpc::Status::OK;
};

class FakeServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(&service_);
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ClientOptions o;
    o.target = "127.0.0.1:" + std::to_string(port);
    o.initial_backoff = absl::Milliseconds(1);
    o.bearer_token = "tok123";
    client_ = *Client::Create(o);
  }
  void TearDown() override { server_->Shutdown(); }

  // A 1-layer DENSE stream: 2 heads x 3 kept tokens x head_dim 8, fp16.
  static pb::CacheInfo Info() {
    pb::CacheInfo info;
    info.set_cache_id("c");
    info.set_dtype(pb::DTYPE_F16);
    info.mutable_shape()->set_num_layers(1);
    info.mutable_shape()->set_num_kv_heads(2);
    info.mutable_shape()->set_head_dim(8);
    info.mutable_shape()->set_seq_len(10);
    return info;
  }
  static pb::GetCacheResponse Chunk(pb::LayerPart part, uint64_t offset, uint64_t total,
                                    const std::string& data, uint32_t layer = 0) {
    pb::GetCacheResponse m;
    m.mutable_chunk()->set_layer(layer);
    m.mutable_chunk()->set_part(part);
    m.mutable_chunk()->set_offset(offset);
    m.mutable_chunk()->set_total_bytes(total);
    m.mutable_chunk()->set_kept_tokens(3);
    m.set_data(data);
    return m;
  }
  static std::vector<pb::GetCacheResponse> GoodDense() {
    pb::GetCacheResponse first;
    *first.mutable_info() = Info();
    std::vector<pb::GetCacheResponse> script = {first};
    const std::string k(96, 'k'), v(96, 'v');
    std::string pos(24, '\0');
    for (int i = 0; i < 6; ++i) pos[4 * i] = static_cast<char>(i);
    // V before K, K in two chunks out of order: the client must place bytes by offset.
    script.push_back(Chunk(pb::PART_V, 0, 96, v));
    script.push_back(Chunk(pb::PART_K, 50, 96, k.substr(50)));
    script.push_back(Chunk(pb::PART_POSITIONS, 0, 24, pos));
    script.push_back(Chunk(pb::PART_K, 0, 96, k.substr(0, 50)));
    return script;
  }
  static GetOptions Dense() {
    GetOptions o;
    o.format = CacheFormat::kDense;
    return o;
  }

  FakeService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<Client> client_;
};

TEST_F(FakeServerTest, BearerTokenAndRetryOnUnavailable) {
  service_.unavailable_left = 2;
  auto info = client_->StatCache("x");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(service_.stat_calls, 3);  // two UNAVAILABLE, then success (max_attempts 3)
  EXPECT_EQ(service_.last_authorization, "Bearer tok123");

  service_.stat_calls = 0;
  service_.unavailable_left = 5;
  EXPECT_EQ(client_->StatCache("x").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(service_.stat_calls, 3);

  service_.stat_calls = 0;
  service_.unavailable_left = 0;
  const absl::Status s = client_->StatCache("perm").status();
  EXPECT_EQ(s.code(), absl::StatusCode::kPermissionDenied);  // not retried
  EXPECT_EQ(s.message(), "no");
  EXPECT_EQ(service_.stat_calls, 1);
}

TEST_F(FakeServerTest, ListCachesFollowsEveryPage) {
  service_.ids = {"a1", "a2", "b1", "a3", "a4"};
  auto all = client_->ListCaches("a");
  ASSERT_TRUE(all.ok()) << all.status();
  std::vector<std::string> got;
  for (const CacheInfo& c : *all) got.push_back(c.cache_id());
  EXPECT_EQ(got, (std::vector<std::string>{"a1", "a2", "a3", "a4"}));
  EXPECT_EQ(service_.list_calls, 3);

  service_.loop_tokens = true;  // a server that never ends its pages must not hang the client
  EXPECT_EQ(client_->ListCaches().status().code(), absl::StatusCode::kInternal);
}

TEST_F(FakeServerTest, GetCacheRetriesUnavailableOnlyBeforeDelivering) {
  const grpc::Status draining(grpc::StatusCode::UNAVAILABLE, "draining");
  service_.SetGet({}, draining);
  EXPECT_EQ(client_->GetCache("c", Dense()).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(service_.get_calls, 3);  // nothing delivered: retried up to max_attempts

  service_.get_calls = 0;
  pb::GetCacheResponse first;
  *first.mutable_info() = Info();
  service_.SetGet({first}, draining);  // the CacheInfo reaches the caller, then the stream fails
  int infos = 0;
  const absl::Status s = client_->GetCacheStreaming(
      "c", Dense(),
      [&](const CacheInfo&) {
        ++infos;
        return absl::OkStatus();
      },
      [](LayerData&&) { return absl::OkStatus(); });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(service_.get_calls, 1);
  EXPECT_EQ(infos, 1);
}

TEST_F(FakeServerTest, DenseFromProtobufServerPlacesChunksByOffset) {
  service_.SetGet(GoodDense());
  auto got = client_->GetCache("c", Dense());
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->layers.size(), 1u);
  const LayerData& d = got->layers[0];
  EXPECT_EQ(d.kept_tokens, 3u);
  EXPECT_EQ(std::string(d.k.begin(), d.k.end()), std::string(96, 'k'));
  EXPECT_EQ(std::string(d.v.begin(), d.v.end()), std::string(96, 'v'));
  EXPECT_EQ(d.positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
}

TEST_F(FakeServerTest, RejectsStreamsThatContradictTheCacheInfo) {
  std::vector<pb::GetCacheResponse> script;
  // A part size that does not follow from the shape.
  script = GoodDense();
  script[1] = Chunk(pb::PART_V, 0, 1 << 30, "vv");
  service_.SetGet(script);
  EXPECT_EQ(client_->GetCache("c", Dense()).status().code(), absl::StatusCode::kInternal);
  // A chunk running past its part.
  script = GoodDense();
  script[2] = Chunk(pb::PART_K, 90, 96, std::string(46, 'k'));
  service_.SetGet(script);
  EXPECT_EQ(client_->GetCache("c", Dense()).status().code(), absl::StatusCode::kInternal);
  // Overlapping chunks whose sizes add up but leave a hole.
  script = GoodDense();
  script[2] = Chunk(pb::PART_K, 0, 96, std::string(46, 'k'));
  service_.SetGet(script);
  EXPECT_EQ(client_->GetCache("c", Dense()).status().code(), absl::StatusCode::kInternal);
  // A layer outside the request.
  script = GoodDense();
  script[1] = Chunk(pb::PART_V, 0, 96, std::string(96, 'v'), 7);
  service_.SetGet(script);
  EXPECT_EQ(client_->GetCache("c", Dense()).status().code(), absl::StatusCode::kInternal);
  // A PACKED part in a DENSE stream.
  script = GoodDense();
  script[1] = Chunk(pb::PART_PACKED, 0, 96, std::string(96, 'v'));
  service_.SetGet(script);
  EXPECT_EQ(client_->GetCache("c", Dense()).status().code(), absl::StatusCode::kInternal);
  // No CacheInfo first.
  script = GoodDense();
  script.erase(script.begin());
  service_.SetGet(script);
  EXPECT_EQ(client_->GetCache("c", Dense()).status().code(), absl::StatusCode::kInternal);
  // A stream that ends early.
  script = GoodDense();
  script.pop_back();
  service_.SetGet(script);
  EXPECT_EQ(client_->GetCache("c", Dense()).status().code(), absl::StatusCode::kDataLoss);
  // The server's own error wins and keeps its message.
  service_.SetGet(GoodDense(), grpc::Status(grpc::StatusCode::DATA_LOSS, "checksum mismatch"));
  const absl::Status s = client_->GetCache("c", Dense()).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), "checksum mismatch");
}

}  // namespace
}  // namespace kvc

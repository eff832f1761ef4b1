// Scoring a layer while its V arrives (Upload's early scoring, Backend::ScoreKeys /
// CompressScored): the stored cache is byte for byte what whole-layer compression stores, for
// every kind of scorer and for value-weighted scores; a failure or an exception in the early
// scoring fails the upload with its status and the server keeps serving; a client that leaves
// while a layer is being scored leaves nothing behind. The CPU engine runs behind a wrapper that
// counts the two-step calls and can hold ScoreKeys at a gate, so each test knows which path ran.
#include <atomic>
#include <chrono>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"
#include "kvc/thread_pool.h"
#include "server/service_impl.h"
#include "testing/kvc_rpc.h"
#include "testing/service_on_loopback.h"

namespace kvc::server {
namespace {

using ::testing::HasSubstr;
namespace pb = kvcache::v1;

class CountingBackend final : public Backend {
 public:
  enum class Mode { kScore, kBadAlloc, kRefuse };
  explicit CountingBackend(std::unique_ptr<Backend> real) : real_(std::move(real)) {}
  std::string_view name() const override { return "counting"; }
  std::string description() const override { return "counting"; }
  absl::StatusOr<CompactLayer> Compress(const LayerInput& in, const CompressionSpec& spec,
                                        CompressTimings* timings) override {
    ++compress;
    return real_->Compress(in, spec, timings);
  }
  bool CanScoreKeys() const override { return true; }
  absl::StatusOr<KeyScores> ScoreKeys(const LayerInput& in, const CompressionSpec& spec) override {
    EXPECT_EQ(in.v, nullptr);  // V is not complete yet: it must not be read
    ++score_keys;
    if (gate != nullptr) gate->WaitForNotification();
    switch (mode.load()) {
      case Mode::kBadAlloc:
        throw std::bad_alloc();
      case Mode::kRefuse:
        return absl::InvalidArgumentError("refused on purpose");
      case Mode::kScore:
        break;
    }
    return real_->ScoreKeys(in, spec);
  }
  absl::StatusOr<CompactLayer> CompressScored(const LayerInput& in, const CompressionSpec& spec,
                                              KeyScores scores,
                                              CompressTimings* timings) override {
    ++compress_scored;
    return real_->CompressScored(in, spec, std::move(scores), timings);
  }
  absl::Status Attend(const CompactLayerView& cache, const DecodeQuery& query,
                      float* out) override {
    return real_->Attend(cache, query, out);
  }
  std::atomic<int> compress{0}, score_keys{0}, compress_scored{0};
  std::atomic<Mode> mode{Mode::kScore};
  absl::Notification* gate = nullptr;  // ScoreKeys waits for it when set

 private:
  std::unique_ptr<Backend> real_;
};

// A cache's chunks with each layer's queries and keys first and its values last (as the clients
// send them), or in the old order (K, V, Q_obs).
std::vector<pb::PutCacheRequest> Ordered(const testing::TestCache& cache, bool queries_first) {
  std::vector<pb::PutCacheRequest> all = testing::MakeRequests(cache, 8 << 10);
  if (!queries_first) return all;
  std::vector<pb::PutCacheRequest> out = {all[0]};
  for (size_t l = 0; l < cache.k.size(); ++l) {
    for (pb::TensorKind kind : {pb::TENSOR_Q_OBS, pb::TENSOR_K, pb::TENSOR_V}) {
      for (size_t i = 1; i < all.size(); ++i) {
        if (all[i].chunk().layer() == l && all[i].chunk().tensor() == kind) out.push_back(all[i]);
      }
    }
  }
  return out;
}

class ServerEarlyScoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = CreateCpuBackend(BackendOptions{});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backend_ = std::make_unique<CountingBackend>(*std::move(cpu));
    ASSERT_TRUE(loopback_.Start(backend_.get(), &pool_));
    stub_ = loopback_.stub();
  }

  static testing::TestCache Cache(const std::string& id, const pb::CompressionConfig& config) {
    testing::TestCache c = testing::MakeTestCache(
        id, testing::Shape(3, 2, 4, 32, 96, 8), pb::DTYPE_F16, pb::LAYOUT_HND, 17);
    *c.header.mutable_compression() = config;
    return c;
  }

  // Every part of every layer of `id`, PACKED.
  testing::Fetched Fetch(const std::string& id) {
    pb::GetCacheRequest get;
    get.set_cache_id(id);
    testing::Fetched fetched;
    const grpc::Status s = testing::Get(stub_, get, &fetched);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return fetched;
  }

  std::unique_ptr<CountingBackend> backend_;
  ThreadPool pool_{3};
  testing::ServiceOnLoopback loopback_;  // declared last: stops serving first
  pb::KvCache::Stub* stub_ = nullptr;
};

pb::CompressionConfig Config(const std::string& policy, double keep) {
  pb::CompressionConfig c;
  c.mutable_eviction()->set_policy(policy);
  c.mutable_eviction()->set_keep_ratio(keep);
  return c;
}

TEST_F(ServerEarlyScoreTest, ScoredWhileVArrivesStoresTheSameBytes) {
  std::vector<std::pair<std::string, pb::CompressionConfig>> configs = {
      {"snapkv-think-q4", testing::FullCompression()},
      {"h2o", Config("h2o", 0.5)},
      {"keyformer", Config("keyformer", 0.25)},
      {"knorm", Config("knorm", 0.3)},
      {"keydiff", Config("keydiff", 0.3)},
  };
  pb::CompressionConfig weighted = Config("h2o", 0.25);  // value weighting: applied after V
  weighted.mutable_eviction()->set_value_weight("mul");
  configs.emplace_back("h2o-value-mul", weighted);
  pb::CompressionConfig adaptive = Config("snapkv", 0.25);
  adaptive.mutable_eviction()->set_adaptive(true);
  configs.emplace_back("snapkv-adaptive", adaptive);
  for (const auto& [name, config] : configs) {
    SCOPED_TRACE(name);
    const testing::TestCache whole = Cache("whole-" + name, config);
    const testing::TestCache early = Cache("early-" + name, config);  // same seed: same tensors
    backend_->compress = backend_->score_keys = backend_->compress_scored = 0;
    pb::PutCacheResponse r1, r2;
    grpc::Status s = testing::Put(stub_, Ordered(whole, false), &r1);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(backend_->score_keys.load(), 0);  // V before the queries: nothing to start early
    EXPECT_EQ(backend_->compress.load(), 3);

    // The queries and keys of layer 0 first; V only once its scoring has started (the gate
    // holds ScoreKeys until V is in, so the early path cannot be skipped by timing).
    absl::Notification gate;
    backend_->gate = &gate;
    std::vector<pb::PutCacheRequest> requests = Ordered(early, true);
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    std::unique_ptr<grpc::ClientWriter<pb::PutCacheRequest>> writer =
        stub_->PutCache(&ctx, &r2);
    bool waited = false;
    for (const pb::PutCacheRequest& req : requests) {
      if (!waited && req.has_chunk() && req.chunk().layer() == 0 &&
          req.chunk().tensor() == pb::TENSOR_V) {
        const absl::Time deadline = absl::Now() + absl::Seconds(60);
        while (backend_->score_keys.load() == 0 && absl::Now() < deadline) {
          absl::SleepFor(absl::Milliseconds(2));
        }
        ASSERT_EQ(backend_->score_keys.load(), 1) << "layer 0 was not scored before its V";
        waited = true;
      }
      ASSERT_TRUE(writer->Write(req));
    }
    writer->WritesDone();
    gate.Notify();
    s = writer->Finish();
    backend_->gate = nullptr;
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_GE(backend_->compress_scored.load(), 1);
    EXPECT_EQ(backend_->compress_scored.load(), backend_->score_keys.load());
    EXPECT_EQ(backend_->compress.load() + backend_->compress_scored.load(), 6);

    EXPECT_EQ(r1.stored_bytes(), r2.stored_bytes());
    const testing::Fetched a = Fetch(whole.header.cache_id());
    const testing::Fetched b = Fetch(early.header.cache_id());
    EXPECT_EQ(a.info.checksum(), b.info.checksum());
    ASSERT_EQ(a.parts.size(), b.parts.size());
    for (const auto& [key, bytes] : a.parts) {
      EXPECT_TRUE(bytes == b.parts.at(key)) << "layer " << key.first << " part " << key.second;
    }
  }
}

TEST_F(ServerEarlyScoreTest, FailuresInEarlyScoringFailTheUploadAndTheServerKeepsServing) {
  const pb::CompressionConfig config = testing::FullCompression();
  backend_->mode = CountingBackend::Mode::kBadAlloc;
  pb::PutCacheResponse response;
  grpc::Status s = testing::Put(stub_, Ordered(Cache("oom", config), true), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("out of memory"));

  backend_->mode = CountingBackend::Mode::kRefuse;
  s = testing::Put(stub_, Ordered(Cache("refused", config), true), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("refused on purpose"));
  EXPECT_THAT(s.error_message(), HasSubstr("layer "));
  EXPECT_EQ(testing::ViewStore(stub_).entries, 0u);

  backend_->mode = CountingBackend::Mode::kScore;
  s = testing::Put(stub_, Ordered(Cache("fine", config), true), &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(Fetch("fine").info.cache_id(), "fine");
  EXPECT_EQ(testing::ViewStore(stub_).ids, std::vector<std::string>{"fine"});
}

TEST_F(ServerEarlyScoreTest, ClientLeavingWhileALayerIsScoredLeavesNothing) {
  absl::Notification gate;
  backend_->gate = &gate;
  const testing::TestCache cache = Cache("gone", testing::FullCompression());
  std::vector<pb::PutCacheRequest> requests = Ordered(cache, true);
  {
    grpc::ClientContext ctx;
    pb::PutCacheResponse response;
    std::unique_ptr<grpc::ClientWriter<pb::PutCacheRequest>> writer =
        stub_->PutCache(&ctx, &response);
    for (const pb::PutCacheRequest& req : requests) {
      if (req.has_chunk() && req.chunk().tensor() == pb::TENSOR_V) break;  // layer 0's V
      ASSERT_TRUE(writer->Write(req));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (backend_->score_keys.load() == 0 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    ASSERT_EQ(backend_->score_keys.load(), 1);
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  gate.Notify();  // the scoring ends; its result is dropped
  backend_->gate = nullptr;
  ASSERT_TRUE(pool_.WaitIdle(std::chrono::steady_clock::now() + std::chrono::seconds(60)));
  EXPECT_EQ(testing::ViewStore(stub_).entries, 0u);
  EXPECT_EQ(backend_->compress_scored.load(), 0);
  // And the next upload goes through.
  pb::PutCacheResponse response;
  const grpc::Status s =
      testing::Put(stub_, Ordered(Cache("next", testing::FullCompression()), true),
                   &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace kvc::server

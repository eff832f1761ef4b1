// Scoring a layer while its V arrives (Upload's early scoring, Backend::ScoreKeys /
// CompressScored): the stored cache is byte for byte what whole-layer compression stores, for
// every kind of scorer and for value-weighted scores; a failure or an exception in the early
// scoring fails the upload with its status and the server keeps serving; a client that leaves
// while a layer is being scored leaves nothing behind. The CPU engine runs behind a wrapper that
// counts the two-step calls and can hold ScoreKeys at a gate, so each test knows which path ran.
// Layer-adaptive budgets (xlayer) go through the same two steps: every layer is scored, then one
// allocation over all of them (AllocateAcrossLayers) gives each head its count.
#include <atomic>
#include <chrono>
#include <memory>
#include <new>
#include <set>
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
#include "kvc/layer_budget.h"
#include "kvc/protocol/convert.h"
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

pb::CompressionConfig LayerAdaptive(const std::string& policy, double keep, double floor) {
  pb::CompressionConfig c = Config(policy, keep);
  c.mutable_eviction()->set_adaptive(true);
  c.mutable_eviction()->set_adaptive_floor(floor);
  c.mutable_eviction()->set_layer_adaptive(true);
  return c;
}

// What the layer-adaptive upload must store, computed with the engine directly: every layer's
// scores, one allocation over them, then each layer compressed with its counts.
std::vector<CompactLayer> LayerAdaptiveLocally(const testing::TestCache& cache,
                                               const CompressionSpec& spec,
                                               std::vector<std::vector<int32_t>>* counts) {
  auto cpu = CreateCpuBackend(BackendOptions{});
  EXPECT_TRUE(cpu.ok()) << cpu.status();
  const int L = static_cast<int>(cache.k.size());
  std::vector<LayerInput> in(L);
  std::vector<KeyScores> scores(L);
  std::vector<const std::vector<float>*> ptrs(L);
  for (int l = 0; l < L; ++l) {
    in[l].shape = cache.layer_shape();
    in[l].dtype = cache.dtype();
    in[l].layout = cache.layout();
    in[l].layer_index = l;
    in[l].k = cache.k[l].data();
    in[l].v = cache.v[l].data();
    in[l].q_obs = cache.q[l].data();
    auto s = (*cpu)->ScoreKeys(in[l], spec);
    EXPECT_TRUE(s.ok()) << s.status();
    scores[l] = s.ok() ? *std::move(s) : KeyScores{};
    ptrs[l] = &scores[l].scores;
  }
  auto alloc = AllocateAcrossLayers(spec.eviction, cache.layer_shape(), ptrs);
  EXPECT_TRUE(alloc.ok()) << alloc.status();
  if (!alloc.ok()) return {};
  *counts = *alloc;
  std::vector<CompactLayer> out;
  for (int l = 0; l < L; ++l) {
    scores[l].head_counts = (*alloc)[l];
    auto layer = (*cpu)->CompressScored(in[l], spec, std::move(scores[l]), nullptr);
    EXPECT_TRUE(layer.ok()) << layer.status();
    out.push_back(layer.ok() ? *std::move(layer) : CompactLayer{});
  }
  return out;
}

TEST_F(ServerEarlyScoreTest, LayerAdaptiveBudgetsStoreTheAllocationOverAllLayers) {
  for (const auto& [policy, floor] :
       std::vector<std::pair<std::string, double>>{{"h2o", 0.2}, {"kvzip", 0.0}, {"knorm", 0.5}}) {
    SCOPED_TRACE(policy);
    const pb::CompressionConfig config = LayerAdaptive(policy, 0.25, floor);
    const testing::TestCache cache = Cache("xlayer-" + policy, config);
    backend_->compress = backend_->score_keys = backend_->compress_scored = 0;
    pb::PutCacheResponse response;
    // Layers in the old order (V before the queries): no layer is scored before it is complete.
    const grpc::Status s = testing::Put(stub_, Ordered(cache, false), &response);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(backend_->score_keys.load(), 3);  // every layer scored, then every layer selected
    EXPECT_EQ(backend_->compress_scored.load(), 3);
    EXPECT_EQ(backend_->compress.load(), 0);

    absl::StatusOr<CompressionSpec> spec = SpecFromProto(config, "");
    ASSERT_TRUE(spec.ok()) << spec.status();
    std::vector<std::vector<int32_t>> counts;
    const std::vector<CompactLayer> want = LayerAdaptiveLocally(cache, *spec, &counts);
    ASSERT_EQ(want.size(), 3u);
    const testing::Fetched got = Fetch(cache.header.cache_id());
    uint64_t stored = 0;
    int total = 0;
    std::set<int> per_layer;
    for (uint32_t l = 0; l < 3; ++l) {
      EXPECT_EQ(got.part(l, pb::PART_PACKED), std::string(want[l].bytes.begin(),
                                                          want[l].bytes.end()))
          << "layer " << l;
      stored += want[l].bytes.size();
      int layer_total = 0;
      for (int32_t c : counts[l]) layer_total += c;
      per_layer.insert(layer_total);
      total += layer_total;
    }
    EXPECT_EQ(response.stored_bytes(), stored);
    EXPECT_EQ(total, 3 * 2 * 24);  // the request's budget: layers * KV heads * 0.25 * 96
    EXPECT_GT(per_layer.size(), 1u) << "every layer kept the same count: nothing moved";
  }
}

TEST_F(ServerEarlyScoreTest, LayerAdaptiveRefusalsAndFailuresLeaveNothing) {
  pb::PutCacheResponse response;
  // Not head-adaptive, and value-weighted: refused at the header, naming the field.
  pb::CompressionConfig plain = Config("h2o", 0.25);
  plain.mutable_eviction()->set_layer_adaptive(true);
  grpc::Status s = testing::Put(stub_, Ordered(Cache("no-ada", plain), true), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("layer_adaptive"));
  pb::CompressionConfig weighted = LayerAdaptive("expected", 0.25, 0.2);  // mul by default
  s = testing::Put(stub_, Ordered(Cache("weighted", weighted), true), &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("value weighting"));

  // A layer's scoring fails: the upload fails with its status, the held layers are dropped.
  backend_->mode = CountingBackend::Mode::kRefuse;
  s = testing::Put(stub_, Ordered(Cache("refused", LayerAdaptive("h2o", 0.25, 0.2)), false),
                   &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("refused on purpose"));
  backend_->mode = CountingBackend::Mode::kBadAlloc;
  s = testing::Put(stub_, Ordered(Cache("oom", LayerAdaptive("h2o", 0.25, 0.2)), false),
                   &response);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  backend_->mode = CountingBackend::Mode::kScore;
  EXPECT_EQ(testing::ViewStore(stub_).entries, 0u);

  // The client leaves with two layers scored and held, the third never sent.
  const testing::TestCache cache = Cache("gone", LayerAdaptive("h2o", 0.25, 0.2));
  backend_->score_keys = 0;
  {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientWriter<pb::PutCacheRequest>> writer =
        stub_->PutCache(&ctx, &response);
    for (const pb::PutCacheRequest& req : Ordered(cache, false)) {
      if (req.has_chunk() && req.chunk().layer() == 2) break;
      ASSERT_TRUE(writer->Write(req));
    }
    const absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (backend_->score_keys.load() < 2 && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(2));
    }
    ASSERT_EQ(backend_->score_keys.load(), 2);
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  ASSERT_TRUE(pool_.WaitIdle(std::chrono::steady_clock::now() + std::chrono::seconds(60)));
  EXPECT_EQ(testing::ViewStore(stub_).entries, 0u);
  EXPECT_EQ(backend_->compress_scored.load(), 0);
  // And the server goes on: the same request completes.
  s = testing::Put(stub_, Ordered(Cache("after", LayerAdaptive("h2o", 0.25, 0.2)), false),
                   &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(testing::ViewStore(stub_).ids, std::vector<std::string>{"after"});
}

}  // namespace
}  // namespace kvc::server

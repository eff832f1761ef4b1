// The query-agnostic and statistics-driven policies through a real kvcd: PutCache with no Q_obs
// (obs_window 0) then GetCache for knorm, streaming, random, keydiff and expected attention
// (with TENSOR_Q_STATS), expected attention from Q_obs with header.rope, value-aware h2o, each
// kept set equal to the engine's own SelectTokens on the same bytes; and every new field and
// limit refused with INVALID_ARGUMENT (or RESOURCE_EXHAUSTED) naming it, kvcd serving after.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/selection.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"
#include "testing/shared_kvcd.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;
using ::testing::HasSubstr;
using testing::TestCache;

constexpr uint32_t kLayers = 2, kHkv = 2, kHq = 4, kD = 16, kS = 96;

class KvcdScoresTest : public testing::SharedKvcdTest<KvcdScoresTest> {
 public:
  // 300 KiB per upload: the caches below fit, the same with a too large Q_stats do not.
  static std::vector<std::string> KvcdFlags() {
    return {"--backend=cpu", "--threads=2", "--max_cache_bytes=300KiB"};
  }
};

pb::RopeSpec Rope() {
  pb::RopeSpec r;
  r.set_theta(10000);
  r.set_style(pb::ROPE_HALF_SPLIT);
  return r;
}

// Per layer, float32 [Hq, D + D * D]: a random mean and a diagonal covariance.
std::vector<std::vector<float>> Stats(uint32_t hq, uint32_t d) {
  std::vector<std::vector<float>> out(kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) {
    out[l].assign(static_cast<size_t>(hq) * (d + d * d), 0.0f);
    for (uint32_t h = 0; h < hq; ++h) {
      float* s = out[l].data() + static_cast<size_t>(h) * (d + d * d);
      for (uint32_t c = 0; c < d; ++c) {
        s[c] = std::sin(1.0f + c + 7.0f * h + 13.0f * l);
        s[d + c * d + c] = 0.5f + 0.25f * std::cos(c + h);
      }
    }
  }
  return out;
}

// Per layer, float32 [Hq, W]: kvzip's row log-masses over keys not uploaded.
std::vector<std::vector<float>> Masses(uint32_t hq, uint32_t w) {
  std::vector<std::vector<float>> out(kLayers);
  for (uint32_t l = 0; l < kLayers; ++l) {
    out[l].resize(static_cast<size_t>(hq) * w);
    for (size_t i = 0; i < out[l].size(); ++i) out[l][i] = 1.5f * std::sin(0.7f * i + l);
  }
  return out;
}

std::vector<pb::PutCacheRequest> Requests(const TestCache& cache,
                                          const std::vector<std::vector<float>>* stats) {
  std::vector<pb::PutCacheRequest> r = testing::MakeRequests(cache, 8 << 10);
  if (stats != nullptr) {
    for (uint32_t l = 0; l < stats->size(); ++l) {
      pb::PutCacheRequest c;
      c.mutable_chunk()->set_layer(l);
      c.mutable_chunk()->set_tensor(pb::TENSOR_Q_STATS);
      c.mutable_chunk()->set_offset(0);
      c.set_data(reinterpret_cast<const char*>((*stats)[l].data()), (*stats)[l].size() * 4);
      r.push_back(std::move(c));
    }
  }
  return r;
}

// The positions the engine keeps for layer l of the cache.
std::string EnginePositions(const TestCache& cache, const CompressionSpec& spec, uint32_t l,
                            const RopeParams* rope, const std::vector<float>* stats) {
  LayerInput in;
  in.shape = cache.layer_shape();
  in.dtype = cache.dtype();
  in.layout = cache.layout();
  in.layer_index = static_cast<int>(l);
  in.k = cache.k[l].data();
  in.v = cache.v[l].data();
  in.q_obs = in.shape.obs_window > 0 ? cache.q[l].data() : nullptr;
  in.rope = rope;
  in.q_stats = stats != nullptr ? stats->data() : nullptr;
  absl::StatusOr<TokenSelection> sel = SelectTokens(in, spec);
  EXPECT_TRUE(sel.ok()) << sel.status();
  if (!sel.ok()) return "";
  return std::string(reinterpret_cast<const char*>(sel->positions.data()),
                     sel->positions.size() * 4);
}

struct Case {
  std::string name;
  uint32_t window;
  std::string policy;
  CompressionSpec spec;  // the same compression for the engine
  bool rope = false;
  bool stats = false;
  std::string value_weight;
};

TEST_F(KvcdScoresTest, RoundTripsMatchTheEngineIncludingObsWindowZero) {
  std::vector<Case> cases;
  for (const char* p : {"knorm", "streaming", "random", "keydiff"}) {
    Case c{std::string(p) + "-w0", 0, p, {}, false, false, ""};
    c.spec.eviction.policy = *ParseEvictionPolicy(p);
    cases.push_back(c);
  }
  {
    Case c{"expected-stats-w0", 0, "expected", {}, true, true, ""};
    c.spec.eviction.policy = EvictionPolicy::kExpectedAttention;
    c.spec.eviction.query_stats = true;
    cases.push_back(c);
  }
  {
    Case c{"expected-qobs", 8, "expected", {}, true, false, ""};
    c.spec.eviction.policy = EvictionPolicy::kExpectedAttention;
    cases.push_back(c);
  }
  {
    // kvzip with its rows' log-masses in TENSOR_Q_STATS ([Hq, W], not [Hq, D + D * D]).
    Case c{"kvzip-masses", 8, "kvzip", {}, false, true, ""};
    c.spec.eviction.policy = EvictionPolicy::kKVzip;
    c.spec.eviction.query_stats = true;
    cases.push_back(c);
  }
  {
    // kvzip's reconstruction pass has more rows than the context has tokens (its instruction's
    // queries come first): W = S + 12.
    Case c{"kvzip-rows-past-s", kS + 12, "kvzip", {}, false, true, ""};
    c.spec.eviction.policy = EvictionPolicy::kKVzip;
    c.spec.eviction.query_stats = true;
    cases.push_back(c);
  }
  {
    Case c{"h2o-value-add", 8, "h2o", {}, false, false, "add"};
    c.spec.eviction.policy = EvictionPolicy::kH2O;
    c.spec.eviction.value_weight = ValueWeight::kAdd;
    cases.push_back(c);
  }
  auto stub = testing::NewStub(kvcd_->address());
  const RopeParams rope{10000.0, 0, /*half_split=*/true, 1.0};
  const std::vector<std::vector<float>> moments = Stats(kHq, kD);
  for (Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<std::vector<float>> stats =
        c.policy == "kvzip" ? Masses(kHq, c.window) : moments;
    TestCache cache = testing::MakeTestCache("scores/" + c.name,
                                             testing::Shape(kLayers, kHkv, kHq, kD, kS, c.window),
                                             pb::DTYPE_F16, pb::LAYOUT_HND, 17);
    auto* e = cache.header.mutable_compression()->mutable_eviction();
    e->set_policy(c.policy);
    e->set_keep_ratio(0.25);
    e->set_value_weight(c.value_weight);
    e->set_query_stats(c.stats);
    if (c.rope) *cache.header.mutable_rope() = Rope();
    c.spec.eviction.keep_ratio = 0.25;
    pb::PutCacheResponse resp;
    grpc::Status s = testing::Put(stub.get(), Requests(cache, c.stats ? &stats : nullptr), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    pb::GetCacheRequest get;
    get.set_cache_id(cache.header.cache_id());
    get.set_format(pb::FORMAT_DENSE);
    testing::Fetched got;
    s = testing::Get(stub.get(), get, &got);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (uint32_t l = 0; l < kLayers; ++l) {
      EXPECT_EQ(got.kept_tokens[l], kS / 4);
      EXPECT_EQ(got.part(l, pb::PART_POSITIONS),
                EnginePositions(cache, c.spec, l, c.rope ? &rope : nullptr,
                                c.stats ? &stats[l] : nullptr))
          << "layer " << l;
    }
  }
}

// Each header is refused naming the field; nothing is stored and kvcd keeps serving.
TEST_F(KvcdScoresTest, BadFieldsAreInvalidArgumentNamingThem) {
  struct Bad {
    std::string name, want;
    uint32_t window;
    std::function<void(pb::PutCacheHeader&)> edit;
    grpc::StatusCode code = grpc::StatusCode::INVALID_ARGUMENT;
  };
  const std::vector<Bad> bad = {
      {"h2o-w0", "obs_window", 0,
       [](auto& h) { h.mutable_compression()->mutable_eviction()->set_policy("h2o"); }},
      {"snapkv-w0", "obs_window", 0,
       [](auto& h) { h.mutable_compression()->mutable_eviction()->set_policy("snapkv"); }},
      // Only kvzip's rows may outnumber the tokens: snapkv's are the prompt's last W positions.
      {"snapkv-w-past-s", "header.shape.obs_window: 97 is outside [0, seq_len 96]", kS + 1,
       [](auto& h) { h.mutable_compression()->mutable_eviction()->set_policy("snapkv"); }},
      {"expected-no-rope", "header.rope", 8,
       [](auto& h) { h.mutable_compression()->mutable_eviction()->set_policy("expected"); }},
      {"expected-w0-no-stats", "eviction.query_stats", 0,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("expected");
         *h.mutable_rope() = Rope();
       }},
      {"stats-with-h2o", "eviction.query_stats", 8,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("h2o");
         h.mutable_compression()->mutable_eviction()->set_query_stats(true);
       }},
      {"value-weight-name", "eviction.value_weight", 8,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("h2o");
         h.mutable_compression()->mutable_eviction()->set_value_weight("times");
       }},
      {"value-weight-knorm", "eviction.value_weight", 0,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("knorm");
         h.mutable_compression()->mutable_eviction()->set_value_weight("mul");
       }},
      {"value-eps", "eviction.value_eps", 8,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("h2o");
         h.mutable_compression()->mutable_eviction()->set_value_eps(-1);
       }},
      {"value-eps-nan", "eviction.value_eps", 8,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("h2o");
         h.mutable_compression()->mutable_eviction()->set_value_eps(std::nan(""));
       }},
      {"horizon-0", "eviction.horizon", 8,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("expected");
         h.mutable_compression()->mutable_eviction()->set_horizon(0);
         *h.mutable_rope() = Rope();
       }},
      {"horizon-huge", "eviction.horizon", 8,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("expected");
         h.mutable_compression()->mutable_eviction()->set_horizon(4000000000u);
         *h.mutable_rope() = Rope();
       }},
      {"rope-dims", "header.rope.rotary_dims", 8,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("expected");
         *h.mutable_rope() = Rope();
         h.mutable_rope()->set_rotary_dims(7);
       }},
      {"rope-style", "header.rope.style", 8,
       [](auto& h) {
         h.mutable_compression()->mutable_eviction()->set_policy("expected");
         *h.mutable_rope() = Rope();
         h.mutable_rope()->set_style(pb::ROPE_STYLE_UNSPECIFIED);
       }},
      // Q_stats is Hq * (D + D*D) * 4 bytes per layer: at D = 128 with 64 query heads, 4.2 MB
      // per layer, over --max_cache_bytes although K + V + Q_obs alone would fit.
      {"stats-over-limit", "Q_stats", 0,
       [](auto& h) {
         *h.mutable_shape() = testing::Shape(1, 1, 64, 128, 16, 0);
         h.mutable_compression()->mutable_eviction()->set_policy("expected");
         h.mutable_compression()->mutable_eviction()->set_query_stats(true);
         *h.mutable_rope() = Rope();
       },
       grpc::StatusCode::RESOURCE_EXHAUSTED},
  };
  auto stub = testing::NewStub(kvcd_->address());
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.name);
    TestCache cache =
        testing::MakeTestCache("bad/" + b.name, testing::Shape(1, kHkv, kHq, kD, kS, b.window),
                               pb::DTYPE_F16, pb::LAYOUT_HND, 3);
    b.edit(cache.header);
    std::vector<pb::PutCacheRequest> reqs(1);
    *reqs[0].mutable_header() = cache.header;
    grpc::Status s = testing::Put(stub.get(), reqs, nullptr);
    EXPECT_EQ(s.error_code(), b.code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(b.want));
    pb::StatCacheRequest stat;
    stat.set_cache_id(cache.header.cache_id());
    grpc::ClientContext ctx;
    pb::CacheInfo info;
    EXPECT_EQ(stub->StatCache(&ctx, stat, &info).error_code(), grpc::StatusCode::NOT_FOUND);
  }
}

// Q_stats chunks: refused without query_stats, checked against their size, required, finite.
TEST_F(KvcdScoresTest, QueryStatsChunksAreChecked) {
  auto stub = testing::NewStub(kvcd_->address());
  auto make = [](const std::string& id, bool query_stats) {
    TestCache cache = testing::MakeTestCache(id, testing::Shape(kLayers, kHkv, kHq, kD, kS, 0),
                                             pb::DTYPE_F16, pb::LAYOUT_HND, 5);
    auto* e = cache.header.mutable_compression()->mutable_eviction();
    e->set_policy(query_stats ? "expected" : "keydiff");
    e->set_keep_ratio(0.5);
    e->set_query_stats(query_stats);
    *cache.header.mutable_rope() = Rope();
    return cache;
  };
  std::vector<std::vector<float>> stats = Stats(kHq, kD);
  {
    SCOPED_TRACE("stats without query_stats");
    grpc::Status s = testing::Put(stub.get(), Requests(make("q/unasked", false), &stats), nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("TENSOR_Q_STATS sent but"));
  }
  {
    SCOPED_TRACE("too long");
    std::vector<std::vector<float>> longer = stats;
    longer[1].push_back(0.0f);
    grpc::Status s = testing::Put(stub.get(), Requests(make("q/long", true), &longer), nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("tensor Q_stats"));
  }
  {
    SCOPED_TRACE("missing");
    std::vector<pb::PutCacheRequest> reqs = Requests(make("q/missing", true), &stats);
    reqs.pop_back();  // layer 1's statistics never come
    grpc::Status s = testing::Put(stub.get(), reqs, nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("layer 1 tensor Q_stats"));
  }
  {
    SCOPED_TRACE("not finite");
    std::vector<std::vector<float>> nan = stats;
    nan[0][5] = std::nanf("");
    grpc::Status s = testing::Put(stub.get(), Requests(make("q/nan", true), &nan), nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_THAT(s.error_message(), HasSubstr("entry 5"));
  }
  // And the same upload with good statistics is stored.
  grpc::Status s = testing::Put(stub.get(), Requests(make("q/good", true), &stats), nullptr);
  EXPECT_TRUE(s.ok()) << s.error_message();

  // kvzip's Q_stats are its rows' log-masses, [Hq, W]: the moments' size is refused, a NaN too.
  auto kvzip = [](const std::string& id) {
    TestCache cache = testing::MakeTestCache(id, testing::Shape(kLayers, kHkv, kHq, kD, kS, 8),
                                             pb::DTYPE_F16, pb::LAYOUT_HND, 6);
    auto* e = cache.header.mutable_compression()->mutable_eviction();
    e->set_policy("kvzip");
    e->set_keep_ratio(0.5);
    e->set_query_stats(true);
    return cache;
  };
  s = testing::Put(stub.get(), Requests(kvzip("q/kvzip-moments"), &stats), nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("tensor Q_stats"));
  std::vector<std::vector<float>> masses = Masses(kHq, 8);
  masses[1][3] = std::nanf("");
  s = testing::Put(stub.get(), Requests(kvzip("q/kvzip-nan"), &masses), nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("entry 3"));
  masses = Masses(kHq, 8);
  s = testing::Put(stub.get(), Requests(kvzip("q/kvzip-good"), &masses), nullptr);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

}  // namespace
}  // namespace kvc

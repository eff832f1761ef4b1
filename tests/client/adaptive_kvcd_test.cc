// Head-adaptive budgets through a real kvcd: a ragged upload is stored as the engine packs it
// (bytes that really shrink), comes back PACKED bit-exact and DENSE padded with position -1,
// refuses the contiguous export, and packed attention over the fetched blob matches a plain
// reference over the DENSE rows. Bad options are rejected at the header and store nothing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvc/attention.h"
#include "kvc/backend.h"
#include "kvc/client.h"
#include "kvc/compact.h"
#include "kvc/dtype.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"
#include "testing/shared_kvcd.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;

class AdaptiveKvcdTest : public testing::SharedKvcdTest<AdaptiveKvcdTest> {
 public:
  static std::vector<std::string> KvcdFlags() { return {"--store_bytes=128MiB", "--backend=cpu"}; }

 protected:
  void SetUp() override {
    SharedKvcdTest::SetUp();
    if (HasFatalFailure()) return;
    ClientOptions o;
    o.target = kvcd_->address();
    auto c = Client::Create(o);
    ASSERT_TRUE(c.ok()) << c.status();
    client_ = std::move(*c);
  }

  // 2 layers, 4 KV heads (8 query heads), D = 64, S = 512, W = 16, fp16.
  static testing::TestCache MakeCache(const std::string& id, uint64_t seed) {
    return testing::MakeTestCache(id, testing::Shape(2, 4, 8, 64, 512, 16), pb::DTYPE_F16,
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

// Naive decode attention, in double, of one query per head over the per-head dense rows
// (counts[h] of them) of one layer plus one new token (k_new, v_new: [Hkv, 1, D]).
std::vector<float> ReferenceAttention(const LayerData& d, int hq, int dim, DType dt,
                                      const std::vector<float>& q, const std::vector<float>& k_new,
                                      const std::vector<float>& v_new) {
  const int hkv = static_cast<int>(d.counts.size()), g = hq / hkv;
  const uint32_t n = d.kept_tokens;
  std::vector<float> out(static_cast<size_t>(hq) * dim);
  for (int qh = 0; qh < hq; ++qh) {
    const int h = qh / g;
    const float* qv = q.data() + static_cast<size_t>(qh) * dim;
    const uint32_t m = d.counts[h];
    auto key = [&](uint32_t j, int c) -> double {
      return j < m ? LoadAsFloat(d.k.data(), dt, (static_cast<size_t>(h) * n + j) * dim + c)
                   : k_new[static_cast<size_t>(h) * dim + c];
    };
    auto value = [&](uint32_t j, int c) -> double {
      return j < m ? LoadAsFloat(d.v.data(), dt, (static_cast<size_t>(h) * n + j) * dim + c)
                   : v_new[static_cast<size_t>(h) * dim + c];
    };
    std::vector<double> logit(m + 1);
    double mx = -1e300;
    for (uint32_t j = 0; j <= m; ++j) {
      double a = 0;
      for (int c = 0; c < dim; ++c) a += qv[c] * key(j, c);
      logit[j] = a / std::sqrt(static_cast<double>(dim));
      mx = std::max(mx, logit[j]);
    }
    double sum = 0;
    for (double& l : logit) sum += (l = std::exp(l - mx));
    for (int c = 0; c < dim; ++c) {
      double o = 0;
      for (uint32_t j = 0; j <= m; ++j) o += logit[j] * value(j, c);
      out[static_cast<size_t>(qh) * dim + c] = static_cast<float>(o / sum);
    }
  }
  return out;
}

TEST_F(AdaptiveKvcdTest, RaggedCacheRoundTrips) {
  testing::TestCache cache = MakeCache("ada", 3);
  auto* e = cache.header.mutable_compression()->mutable_eviction();
  e->set_policy("h2o");
  e->set_keep_ratio(0.25);
  e->set_adaptive(true);
  e->set_adaptive_floor(0.1);
  auto put = client_->PutCache(cache.header, Views(cache));
  ASSERT_TRUE(put.ok()) << put.status();

  // The engine's own answer for the same spec.
  CompressionSpec spec;
  spec.eviction.policy = EvictionPolicy::kH2O;
  spec.eviction.keep_ratio = 0.25;
  spec.eviction.adaptive = true;
  spec.eviction.adaptive_floor = 0.1;
  auto cpu = CreateCpuBackend({});
  ASSERT_TRUE(cpu.ok());

  auto packed = client_->GetCache("ada");
  ASSERT_TRUE(packed.ok()) << packed.status();
  GetOptions dense_opt;
  dense_opt.format = CacheFormat::kDense;
  auto dense = client_->GetCache("ada", dense_opt);
  ASSERT_TRUE(dense.ok()) << dense.status();
  ASSERT_EQ(packed->layers.size(), 2u);
  ASSERT_EQ(dense->layers.size(), 2u);
  uint64_t stored = 0;
  bool any_ragged = false;
  std::mt19937 rng(5);
  for (int l = 0; l < 2; ++l) {
    SCOPED_TRACE(l);
    const LayerInput in{cache.layer_shape(), DType::kF16,       Layout::kHND,     l,
                        cache.k[l].data(),   cache.v[l].data(), cache.q[l].data()};
    auto want = (*cpu)->Compress(in, spec, nullptr);
    ASSERT_TRUE(want.ok()) << want.status();
    const ByteVector& blob = packed->layers[l].packed;
    ASSERT_TRUE(absl::MakeConstSpan(blob) == absl::MakeConstSpan(want->bytes));
    stored += blob.size();
    auto view = CompactLayerView::Parse(blob);
    ASSERT_TRUE(view.ok()) << view.status();
    int total = 0, mx = 0;
    for (int h = 0; h < 4; ++h) {
      total += view->desc(h).n_kept;
      mx = std::max(mx, view->desc(h).n_kept);
      any_ragged |= view->desc(h).n_kept != view->desc(0).n_kept;
    }
    EXPECT_EQ(total, 4 * 128);  // H * B with B = 0.25 * 512
    EXPECT_EQ(packed->info.kept_tokens(l), static_cast<uint32_t>(mx));
    // Bytes shrink to H * B rows: the uniform blob's size (header, descriptors, channel lists,
    // B positions and B K and V rows per head) plus at most 16 bytes of padding per head.
    EXPECT_LE(blob.size(), 64 + 4 * (32 + 2 * 64 * 4 + 128 * (4 + 2 * 64 * 2)) + 4 * 16);

    const LayerData& d = dense->layers[l];
    EXPECT_EQ(d.kept_tokens, static_cast<uint32_t>(mx));
    ASSERT_EQ(d.counts.size(), 4u);
    for (int h = 0; h < 4; ++h) {
      const CompactHead hd = view->head(h);
      ASSERT_EQ(d.counts[h], static_cast<uint32_t>(hd.n_kept));
      for (uint32_t j = 0; j < d.kept_tokens; ++j) {
        const int32_t p = d.positions[h * d.kept_tokens + j];
        ASSERT_EQ(p, j < d.counts[h] ? hd.positions[j] : -1) << h << " " << j;
      }
    }
    auto exported = ExportDense(*view);
    ASSERT_TRUE(exported.ok());
    EXPECT_TRUE(absl::MakeConstSpan(exported->k) == absl::MakeConstSpan(d.k));
    EXPECT_TRUE(absl::MakeConstSpan(exported->v) == absl::MakeConstSpan(d.v));

    // Packed attention on the fetched blob against the DENSE rows.
    std::vector<float> q(8 * 64), k_new(4 * 64), v_new(4 * 64);
    std::normal_distribution<float> nd;
    for (auto* t : {&q, &k_new, &v_new}) {
      for (float& x : *t) x = nd(rng);
    }
    std::vector<float> out(q.size());
    const absl::Status attended = PackedAttentionCpu(
        *view, DecodeQuery{8, 1, q.data(), 1, k_new.data(), v_new.data()}, out.data());
    ASSERT_TRUE(attended.ok()) << attended;
    const std::vector<float> ref = ReferenceAttention(d, 8, 64, DType::kF16, q, k_new, v_new);
    for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 2e-3f) << i;
  }
  EXPECT_TRUE(any_ragged);
  EXPECT_EQ(put->stored_bytes(), stored);

  // A stock engine's contiguous layout cannot hold heads of different lengths.
  GetOptions contiguous = dense_opt;
  contiguous.contiguous_rope.emplace();
  contiguous.contiguous_rope->set_theta(10000);
  contiguous.contiguous_rope->set_style(pb::ROPE_HALF_SPLIT);
  auto refused = client_->GetCache("ada", contiguous);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << refused.status();
  EXPECT_NE(refused.status().message().find("head-adaptive"), std::string::npos)
      << refused.status();
}

TEST_F(AdaptiveKvcdTest, BadOptionsAreRejectedAndStoreNothing) {
  struct Bad {
    std::string policy, granularity_layer;
    double floor;
    std::string want;
  };
  const Bad cases[] = {
      {"h2o", "", 1.5, "header.compression.eviction.adaptive_floor: 1.5 is outside [0, 1]"},
      {"streaming", "", 0.2, "header.compression.eviction.adaptive: needs a scoring policy"},
      {"snapkv", "layer", 0.2, "per-head granularity"},
  };
  for (const Bad& b : cases) {
    testing::TestCache cache = MakeCache("bad-ada", 4);
    auto* e = cache.header.mutable_compression()->mutable_eviction();
    e->set_policy(b.policy);
    e->set_keep_ratio(0.5);
    e->set_adaptive(true);
    e->set_adaptive_floor(b.floor);
    if (!b.granularity_layer.empty()) e->set_granularity(pb::GRANULARITY_PER_LAYER);
    auto put = client_->PutCache(cache.header, Views(cache));
    EXPECT_EQ(put.status().code(), absl::StatusCode::kInvalidArgument) << put.status();
    EXPECT_NE(put.status().message().find(b.want), std::string::npos) << put.status();
    EXPECT_EQ(client_->StatCache("bad-ada").status().code(), absl::StatusCode::kNotFound);
  }
}

}  // namespace
}  // namespace kvc

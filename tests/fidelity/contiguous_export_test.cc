// The engine-ready export (kvc/contiguous_export.h) on the real model: decoding from the kept
// tokens re-rotated into slots 0..K-1, as a plain full cache at positions K, K+1, ..., gives the
// logits of decoding the compact cache at the original positions, for both RoPE pair conventions
// and with eviction alone, channel pruning and quantization on top.
#include "kvc/contiguous_export.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "fidelity/model_util.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/model/checkpoint.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"

namespace kvc::fidelity {
namespace {

constexpr int kPrefix = 96, kCont = 16, kWindow = 16;

class ContiguousExportTest : public ::testing::TestWithParam<model::RopePairs> {
 protected:
  void SetUp() override {
    KVC_REQUIRE_MODEL(path);
    auto ck = model::Checkpoint::Load(path);
    ASSERT_TRUE(ck.ok()) << ck.status();
    model_ = std::make_unique<model::Transformer>(*std::move(ck), GetParam());
    BackendOptions bo;
    bo.num_threads = 1;
    auto backend = CreateCpuBackend(bo);
    ASSERT_TRUE(backend.ok()) << backend.status();
    backend_ = *std::move(backend);
    RunOptions o;
    o.num_sequences = 1;
    o.prefix_len = kPrefix;
    o.continuation = kCont;
    o.obs_window = kWindow;
    o.seed = 5;
    auto eval = FidelityEval::Create(model_.get(), o, backend_.get());
    ASSERT_TRUE(eval.ok()) << eval.status();
    eval_ = *std::move(eval);
  }

  RopeParams Rope(bool half_split) const {
    RopeParams r;
    r.theta = 10000;
    r.half_split = half_split;
    return r;
  }
  bool HalfSplit() const { return GetParam() == model::RopePairs::kHalfSplit; }

  // Teacher-forced logits of the continuation on a plain cache holding each layer's export.
  std::vector<float> DecodeOnExport(const std::vector<CompactLayer>& blobs, bool rotate,
                                    bool half_split) {
    const model::LlamaConfig& c = model_->config();
    std::vector<model::LayerProjections> layers(c.n_layers);
    int kept = -1;
    for (int l = 0; l < c.n_layers; ++l) {
      auto view = CompactLayerView::Parse(blobs[l].bytes);
      EXPECT_TRUE(view.ok()) << view.status();
      auto dense = rotate ? ExportDenseContiguous(*view, Rope(half_split)) : ExportDense(*view);
      EXPECT_TRUE(dense.ok()) << dense.status();
      EXPECT_EQ(dense->dtype, DType::kF32);
      if (kept < 0) kept = dense->n_kept;
      EXPECT_EQ(dense->n_kept, kept);
      layers[l].k.resize(dense->k.size() / sizeof(float));
      layers[l].v.resize(dense->v.size() / sizeof(float));
      std::memcpy(layers[l].k.data(), dense->k.data(), dense->k.size());
      std::memcpy(layers[l].v.data(), dense->v.data(), dense->v.size());
    }
    auto cache = model::FullKvCache::FromPrefix(c, layers, kept, kept, kept + kCont);
    EXPECT_TRUE(cache.ok()) << cache.status();
    EXPECT_EQ((*cache)->position(), kept);  // a stock engine: the next position is the count
    std::vector<float> logits(static_cast<size_t>(kCont) * c.vocab_size);
    for (int t = 0; t < kCont; ++t) {
      absl::Status s = model_->DecodeStep(
          eval_->sequences()[0][kPrefix + t], cache->get(),
          absl::MakeSpan(&logits[static_cast<size_t>(t) * c.vocab_size], c.vocab_size));
      EXPECT_TRUE(s.ok()) << s;
    }
    return logits;
  }

  static double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double{a[i]} - b[i]));
    return m;
  }

  std::unique_ptr<model::Transformer> model_;
  std::unique_ptr<Backend> backend_;
  std::unique_ptr<FidelityEval> eval_;
};

TEST_P(ContiguousExportTest, MatchesCompactDecodingAtOriginalPositions) {
  struct Case {
    std::string name;
    CompressionSpec spec;
  };
  std::vector<Case> cases;
  CompressionSpec snap;
  snap.eviction.policy = EvictionPolicy::kSnapKV;
  snap.eviction.keep_ratio = 0.4;
  cases.push_back({"snapkv@0.4", snap});
  CompressionSpec think = snap;
  think.channels.key_policy = ChannelPolicy::kThink;
  think.channels.key_lambda = 0.5;
  think.recent_tokens = 8;
  cases.push_back({"snapkv+think0.5", think});
  CompressionSpec quant = snap;
  quant.quant.bits = 4;
  quant.quant.group_size = 8;
  quant.recent_tokens = 8;
  cases.push_back({"snapkv+quant4", quant});
  for (const Case& c : cases) {
    auto blobs = InProcessCompressor(backend_.get())(eval_->prefix(0), c.spec, 0);
    ASSERT_TRUE(blobs.ok()) << blobs.status();
    auto compact = eval_->DecodeOnCompact(0, *blobs);
    ASSERT_TRUE(compact.ok()) << compact.status();
    double scale = 0;
    for (float x : *compact) scale = std::max(scale, std::abs(double{x}));
    const double diff = MaxAbsDiff(*compact, DecodeOnExport(*blobs, true, HalfSplit()));
    // Not vacuous: the unrotated keys, or the other pair convention, decode something else.
    const double unrotated = MaxAbsDiff(*compact, DecodeOnExport(*blobs, false, HalfSplit()));
    const double other = MaxAbsDiff(*compact, DecodeOnExport(*blobs, true, !HalfSplit()));
    std::printf(
        "%s %s: max |logit diff| %.3g (max |logit| %.3g); unrotated %.3g, other pairs "
        "%.3g\n",
        HalfSplit() ? "half-split" : "interleaved", c.name.c_str(), diff, scale, unrotated, other);
    EXPECT_LE(diff, 1e-5 * scale) << c.name;
    EXPECT_GT(unrotated, 1e-2 * scale) << c.name;
    EXPECT_GT(other, 1e-2 * scale) << c.name;
  }
}

INSTANTIATE_TEST_SUITE_P(BothPairConventions, ContiguousExportTest,
                         ::testing::Values(model::RopePairs::kInterleaved,
                                           model::RopePairs::kHalfSplit),
                         [](const auto& info) {
                           return info.param == model::RopePairs::kHalfSplit ? "HalfSplit"
                                                                             : "Interleaved";
                         });

}  // namespace
}  // namespace kvc::fidelity

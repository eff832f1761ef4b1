// Decoding the real model on compact caches built by the engine: with nothing removed it matches
// full-cache decoding; with eviction, channel pruning or quantization it matches a test-only
// oracle that expands each blob to floats and runs plain softmax attention.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <vector>

#include "fidelity/eval_fixture.h"
#include "fidelity/model_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"

namespace kvc::fidelity {
namespace {

using ::testing::HasSubstr;

// Oracle: every layer's blob expanded with UnpackHeadToFloat (pruned channels zero, quantized
// blocks dequantized) plus the new tokens, attended with exact softmax in double.
class UnpackedKvCache : public model::KvCache {
 public:
  UnpackedKvCache(const model::LlamaConfig& c, const std::vector<CompactLayer>& blobs, int max_new)
      : c_(c), max_new_(max_new), k_(c.n_layers), v_(c.n_layers) {
    const int hd = c.head_dim();
    for (int l = 0; l < c.n_layers; ++l) {
      const CompactLayerView view = *CompactLayerView::Parse(blobs[l].bytes);
      seq_len_ = view.seq_len();
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const int n = view.desc(h).n_kept;
        std::vector<float> keys(static_cast<size_t>(n) * hd), values(keys.size());
        UnpackHeadToFloat(view, h, keys.data(), values.data());
        k_[l].push_back(std::move(keys));
        v_[l].push_back(std::move(values));
      }
    }
  }
  int position() const override { return seq_len_ + n_new_; }
  bool CanAppend() const override { return n_new_ < max_new_; }
  void Advance() override { ++n_new_; }
  absl::Status AppendAndAttend(int layer, const float* q, const float* k, const float* v,
                               float* out) override {
    const int hd = c_.head_dim(), g = c_.group_size();
    for (int h = 0; h < c_.n_kv_heads; ++h) {
      k_[layer][h].insert(k_[layer][h].end(), k + h * hd, k + (h + 1) * hd);
      v_[layer][h].insert(v_[layer][h].end(), v + h * hd, v + (h + 1) * hd);
      const int n = static_cast<int>(k_[layer][h].size()) / hd;
      for (int qh = h * g; qh < (h + 1) * g; ++qh) {
        std::vector<double> s(n);
        double max_s = -INFINITY, sum = 0;
        for (int t = 0; t < n; ++t) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += double{q[qh * hd + d]} * k_[layer][h][t * hd + d];
          s[t] = dot / std::sqrt(static_cast<double>(hd));
          max_s = std::max(max_s, s[t]);
        }
        for (double& x : s) sum += (x = std::exp(x - max_s));
        for (int d = 0; d < hd; ++d) {
          double o = 0;
          for (int t = 0; t < n; ++t) o += s[t] / sum * v_[layer][h][t * hd + d];
          out[qh * hd + d] = static_cast<float>(o);
        }
      }
    }
    return absl::OkStatus();
  }

 private:
  model::LlamaConfig c_;
  int max_new_, seq_len_ = 0, n_new_ = 0;
  std::vector<std::vector<std::vector<float>>> k_, v_;  // [layer][head][tokens * hd]
};

class CompactDecodeTest : public EvalFixture {
 protected:
  static constexpr int kPrefix = 96, kCont = 16, kWindow = 16;

  void SetUp() override {
    RunOptions o;
    o.num_sequences = 1;
    o.prefix_len = kPrefix;
    o.continuation = kCont;
    o.obs_window = kWindow;
    o.seed = 11;
    SetUpEval(o);
  }

  std::vector<CompactLayer> Compress(const CompressionSpec& spec) {
    auto blobs = InProcessCompressor(backend_.get())(eval_->prefix(0), spec, 0);
    EXPECT_TRUE(blobs.ok()) << blobs.status();
    return blobs.ok() ? *std::move(blobs) : std::vector<CompactLayer>();
  }

  // Teacher-forced logits [C, vocab] of the continuation on `cache`.
  std::vector<float> Decode(model::KvCache* cache) {
    const int vocab = model_->config().vocab_size;
    std::vector<float> logits(static_cast<size_t>(kCont) * vocab);
    for (int t = 0; t < kCont; ++t) {
      absl::Status s = model_->DecodeStep(eval_->sequences()[0][kPrefix + t], cache,
                                          absl::MakeSpan(&logits[t * vocab], vocab));
      EXPECT_TRUE(s.ok()) << s;
    }
    return logits;
  }

  std::vector<float> FullCacheLogits() {
    const std::vector<int32_t>& seq = eval_->sequences()[0];
    auto fwd = model_->Forward(absl::MakeConstSpan(seq).subspan(0, kPrefix));
    EXPECT_TRUE(fwd.ok());
    auto cache = model::FullKvCache::FromPrefix(model_->config(), fwd->layers, kPrefix, kPrefix,
                                                kPrefix + kCont);
    EXPECT_TRUE(cache.ok());
    return Decode(cache->get());
  }

  static double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
    double m = 0;
    for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(double{a[i]} - b[i]));
    return m;
  }

};

TEST_F(CompactDecodeTest, KeepEverythingMatchesFullCacheDecoding) {
  const std::vector<float> full = FullCacheLogits();
  auto compact = eval_->DecodeOnCompact(0, Compress(CompressionSpec{}));
  ASSERT_TRUE(compact.ok()) << compact.status();
  const double diff = MaxAbsDiff(full, *compact);
  double scale = 0;
  for (float x : full) scale = std::max(scale, std::abs(double{x}));
  // Next-token probabilities, which is what decoding consumes.
  const int vocab = model_->config().vocab_size;
  double prob_diff = 0;
  for (int t = 0; t < kCont; ++t) {
    const float* a = &full[t * vocab];
    const float* b = &(*compact)[t * vocab];
    const float ma = *std::max_element(a, a + vocab), mb = *std::max_element(b, b + vocab);
    double sa = 0, sb = 0;
    for (int i = 0; i < vocab; ++i) {
      sa += std::exp(double{a[i]} - ma);
      sb += std::exp(double{b[i]} - mb);
    }
    for (int i = 0; i < vocab; ++i) {
      prob_diff =
          std::max(prob_diff, std::abs(std::exp(a[i] - ma) / sa - std::exp(b[i] - mb) / sb));
    }
  }
  std::printf(
      "policy none: max |logit diff| = %.3g (max |logit| %.3g), max |prob diff| = %.3g "
      "over %d steps\n",
      diff, scale, prob_diff, kCont);
  EXPECT_LE(diff, 1e-5 * scale);
  EXPECT_LE(prob_diff, 1e-5);
}

TEST_F(CompactDecodeTest, CompressedDecodingMatchesAnUnpackedOracle) {
  struct Case {
    std::string name;
    CompressionSpec spec;
  };
  std::vector<Case> cases;
  for (EvictionPolicy p : {EvictionPolicy::kStreaming, EvictionPolicy::kSnapKV,
                           EvictionPolicy::kH2O, EvictionPolicy::kKeyformer}) {
    CompressionSpec s;
    s.eviction.policy = p;
    s.eviction.keep_ratio = 0.4;
    cases.push_back({std::string(PolicyName(p)) + "@0.4", s});
  }
  CompressionSpec think;
  think.eviction.policy = EvictionPolicy::kSnapKV;
  think.eviction.keep_ratio = 0.5;
  think.channels.key_policy = ChannelPolicy::kThink;
  think.channels.key_lambda = 0.5;
  think.recent_tokens = 8;
  cases.push_back({"snapkv+think0.5", think});
  for (int bits : {4, 2}) {
    CompressionSpec q;
    q.quant.bits = bits;
    q.quant.group_size = 8;
    q.recent_tokens = 8;
    cases.push_back({bits == 4 ? "quant4" : "quant2", q});
  }
  const std::vector<float> full = FullCacheLogits();
  for (const Case& c : cases) {
    std::vector<CompactLayer> blobs = Compress(c.spec);
    ASSERT_EQ(blobs.size(), 5u) << c.name;
    UnpackedKvCache oracle(model_->config(), blobs, kCont);
    const std::vector<float> expected = Decode(&oracle);
    auto got = eval_->DecodeOnCompact(0, blobs);
    ASSERT_TRUE(got.ok()) << c.name << ": " << got.status();
    EXPECT_LT(MaxAbsDiff(expected, *got), 1e-3) << c.name;
    // And compression really changed something (the comparison is not vacuous).
    EXPECT_GT(MaxAbsDiff(full, *got), 1e-3) << c.name;
  }
}

TEST_F(CompactDecodeTest, BackendAttendAndPackedAttentionCpuAgree) {
  CompressionSpec spec;
  spec.eviction.policy = EvictionPolicy::kSnapKV;
  spec.eviction.keep_ratio = 0.5;
  spec.quant.bits = 4;
  spec.quant.group_size = 8;
  const std::vector<CompactLayer> blobs = Compress(spec);
  auto via_backend = model::CompactKvCache::Create(model_->config(), blobs, backend_.get(), kCont);
  auto via_function = model::CompactKvCache::Create(model_->config(), blobs, nullptr, kCont);
  ASSERT_TRUE(via_backend.ok() && via_function.ok());
  EXPECT_EQ((*via_backend)->position(), kPrefix);
  EXPECT_EQ(Decode(via_backend->get()), Decode(via_function->get()));
  EXPECT_EQ((*via_backend)->position(), kPrefix + kCont);
}

TEST_F(CompactDecodeTest, CreateRejectsBlobsThatDoNotFitTheModel) {
  const model::LlamaConfig& c = model_->config();
  std::vector<CompactLayer> blobs = Compress(CompressionSpec{});
  std::vector<CompactLayer> short_list(blobs.begin(), blobs.begin() + 4);
  EXPECT_THAT(model::CompactKvCache::Create(c, short_list, nullptr, 4).status().message(),
              HasSubstr("layers: 4 blobs given, the model has 5 layers"));
  std::vector<CompactLayer> swapped = blobs;
  std::swap(swapped[1], swapped[2]);
  EXPECT_THAT(model::CompactKvCache::Create(c, swapped, nullptr, 4).status().message(),
              HasSubstr("layers[1]: blob is for layer_index 2"));
  std::vector<CompactLayer> corrupt = blobs;
  corrupt[3].bytes.resize(40);
  auto s = model::CompactKvCache::Create(c, corrupt, nullptr, 4).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("layers[3]"));
  EXPECT_THAT(model::CompactKvCache::Create(c, blobs, nullptr, 0).status().message(),
              HasSubstr("max_new: 0"));
  model::LlamaConfig other = c;
  other.n_kv_heads = 8;
  EXPECT_THAT(model::CompactKvCache::Create(other, blobs, nullptr, 4).status().message(),
              HasSubstr("blob has 4 KV heads of dim 8, the model has 8 of dim 8"));
}

TEST_F(CompactDecodeTest, EvaluateRejectsBlobsOfAnotherPrefixLength) {
  RunOptions o = eval_->options();
  o.prefix_len = 64;
  auto other = FidelityEval::Create(model_.get(), o, backend_.get());
  ASSERT_TRUE(other.ok()) << other.status();
  const Compressor wrong = [&](const PrefixCache&, const CompressionSpec& spec, int i) {
    return InProcessCompressor(backend_.get())((*other)->prefix(i), spec, i);
  };
  absl::Status s = eval_->Evaluate(CompressionSpec{}, wrong).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("blobs have seq_len 64, the prefix has 96"));
  EXPECT_THAT(eval_->DecodeOnCompact(0, wrong(eval_->prefix(0), CompressionSpec{}, 0).value())
                  .status()
                  .message(),
              HasSubstr("blobs have seq_len 64"));
  EXPECT_THAT(eval_->DecodeOnCompact(1, {}).status().message(), HasSubstr("sequence: 1"));
}

TEST_F(CompactDecodeTest, CacheRefusesTokensBeyondItsCapacity) {
  auto cache =
      model::CompactKvCache::Create(model_->config(), Compress(CompressionSpec{}), nullptr, 1);
  ASSERT_TRUE(cache.ok());
  std::vector<float> logits(model_->config().vocab_size);
  ASSERT_TRUE(model_->DecodeStep(5, cache->get(), absl::MakeSpan(logits)).ok());
  EXPECT_EQ(model_->DecodeStep(5, cache->get(), absl::MakeSpan(logits)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*cache)->position(), kPrefix + 1);
}

}  // namespace
}  // namespace kvc::fidelity

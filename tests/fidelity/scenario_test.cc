// The two scenarios on the real model (question inside the compressed prompt, question after
// compression), the per-layer attention error measured with the continuation's own queries, and
// evaluation on given sequences.
#include <string>
#include <vector>

#include "fidelity/eval_fixture.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/fidelity/fidelity.h"

namespace kvc::fidelity {
namespace {

using ::testing::HasSubstr;

constexpr int kSeqs = 2, kPrefix = 96, kCont = 16, kWindow = 16;  // SmallRun's

class ScenarioTest : public EvalFixture {
 protected:
  void SetUp() override { SetUpEval(Options()); }

  static RunOptions Options() { return SmallRun(3); }

  Metrics Run(const char* spec, Scenario scenario, const Compressor& compressor) {
    auto m = eval_->Evaluate(*ParseSpecString(spec), compressor, scenario);
    EXPECT_TRUE(m.ok()) << spec << ": " << m.status();
    return m.ok() ? *m : Metrics{};
  }
  Metrics Run(const char* spec, Scenario scenario) {
    return Run(spec, scenario, InProcessCompressor(backend_.get()));
  }
};

TEST_F(ScenarioTest, AfterCompressesOnlyThePrefixBeforeTheQuestion) {
  const CompressionSpec snapkv = *ParseSpecString("snapkv:0.5");
  const CompressionSpec knorm = *ParseSpecString("knorm:0.5");
  absl::StatusOr<PrefixCache> inside_or = eval_->CompressedPrefix(0, Scenario::kInside, snapkv);
  absl::StatusOr<PrefixCache> after_or = eval_->CompressedPrefix(0, Scenario::kAfter, snapkv);
  absl::StatusOr<PrefixCache> knorm_or = eval_->CompressedPrefix(0, Scenario::kAfter, knorm);
  ASSERT_TRUE(inside_or.ok() && after_or.ok() && knorm_or.ok());
  const PrefixCache& inside = *inside_or;
  EXPECT_EQ(inside.prefix_len, kPrefix);
  EXPECT_EQ(inside.obs_window, kWindow);
  const PrefixCache& after = *after_or;
  EXPECT_EQ(after.prefix_len, kPrefix - kWindow);
  EXPECT_EQ(after.obs_window, kWindow);  // snapkv needs queries: the prefix's own last W
  EXPECT_EQ(knorm_or->obs_window, 0);    // query-agnostic: none
  EXPECT_EQ(inside.recon, nullptr);
  // The after prefix is the inside prefix's first P - W positions, and its queries are those
  // of the W positions before the question, not the question's.
  const int hd = inside.head_dim;
  const auto& in0 = (*inside.layers)[1];
  const auto& af0 = (*after.layers)[1];
  for (int d = 0; d < hd; ++d) {
    EXPECT_EQ(af0.k[static_cast<size_t>(after.prefix_len - 1) * hd + d],
              in0.k[static_cast<size_t>(after.prefix_len - 1) * hd + d]);
  }
  EXPECT_NE(af0.q, in0.q);
}

TEST_F(ScenarioTest, PrefixesAreWhatAForwardPassOverThePromptAloneGives) {
  // What a prefill node pushes: the cache of the prompt alone. The tool runs one forward pass over
  // prompt + continuation; causality makes the prompt's part bit-identical.
  const std::vector<int32_t>& seq = eval_->sequences()[1];
  auto fwd = model_->Forward(absl::MakeConstSpan(seq).subspan(0, kPrefix));
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const PrefixCache& inside = eval_->prefix(1);
  for (int l = 0; l < inside.num_layers(); ++l) {
    EXPECT_EQ((*inside.layers)[l].k, fwd->layers[l].k) << "layer " << l;
    EXPECT_EQ((*inside.layers)[l].v, fwd->layers[l].v) << "layer " << l;
  }
}

TEST_F(ScenarioTest, KeepingEverythingReproducesFullDecodingInBothScenarios) {
  for (Scenario s : {Scenario::kInside, Scenario::kAfter}) {
    for (const char* spec : {"full", "snapkv:1", "knorm:1"}) {
      const Metrics m = Run(spec, s);
      EXPECT_EQ(m.steps, kSeqs * kCont);
      EXPECT_EQ(m.top1_agreement, 1.0) << spec << " " << ScenarioName(s);
      EXPECT_LT(m.mean_kl, 1e-8) << spec << " " << ScenarioName(s);
      EXPECT_LT(m.mean_attn_rel_err, 1e-5) << spec << " " << ScenarioName(s);
      ASSERT_EQ(m.seq_top1.size(), static_cast<size_t>(kSeqs));
      ASSERT_EQ(m.seq_kl.size(), static_cast<size_t>(kSeqs));
    }
  }
}

TEST_F(ScenarioTest, ScenariosDifferForQueryPoliciesAndAfterSendsNoQueriesOtherwise) {
  const Metrics inside = Run("snapkv:0.25", Scenario::kInside);
  const Metrics after = Run("snapkv:0.25", Scenario::kAfter);
  EXPECT_EQ(inside.obs_window, kWindow);
  EXPECT_EQ(after.obs_window, kWindow);
  EXPECT_NE(inside.seq_kl, after.seq_kl);
  // The after cache holds P - W tokens' worth of bytes, the inside one P.
  EXPECT_LT(after.compact_bytes, inside.compact_bytes);
  EXPECT_EQ(Run("streaming:0.25", Scenario::kAfter).obs_window, 0);
  // Per-sequence values average to the row's numbers.
  double top1 = 0;
  for (double v : inside.seq_top1) top1 += v / kSeqs;
  EXPECT_DOUBLE_EQ(top1, inside.top1_agreement);
}

TEST_F(ScenarioTest, AttentionErrorIsEachLayersOwnNotPropagatedDrift) {
  // Compress only layer 2; every other layer keeps its full cache. Decoding drifts after layer 2,
  // but the per-layer error, measured with the full model's continuation q/k/v, is zero there.
  const Compressor only_layer_2 = [&](const PrefixCache& prefix, const CompressionSpec& spec,
                                      int i) -> absl::StatusOr<std::vector<CompactLayer>> {
    auto full = InProcessCompressor(backend_.get())(prefix, CompressionSpec{}, i);
    auto compressed = InProcessCompressor(backend_.get())(prefix, spec, i);
    if (!full.ok()) return full.status();
    if (!compressed.ok()) return compressed.status();
    (*full)[2] = std::move((*compressed)[2]);
    return full;
  };
  for (Scenario s : {Scenario::kInside, Scenario::kAfter}) {
    const Metrics m = Run("streaming:0.25", s, only_layer_2);
    ASSERT_EQ(m.attn_rel_err.size(), 5u);
    EXPECT_GT(m.mean_kl, 1e-4) << "layer 2's compression changes the output";
    EXPECT_GT(m.attn_rel_err[2], 0.05);
    for (int l : {0, 1, 3, 4}) {
      EXPECT_LT(m.attn_rel_err[l], 1e-5) << "layer " << l << " " << ScenarioName(s);
    }
  }
}

TEST_F(ScenarioTest, AfterNeedsAPrefixBeforeTheQuestion) {
  RunOptions o = Options();
  o.obs_window = o.prefix_len;
  auto eval = FidelityEval::Create(model_.get(), o, backend_.get());
  ASSERT_TRUE(eval.ok()) << eval.status();
  auto m =
      (*eval)->Evaluate(CompressionSpec{}, InProcessCompressor(backend_.get()), Scenario::kAfter);
  ASSERT_FALSE(m.ok());
  EXPECT_THAT(m.status().message(), HasSubstr("prefix_len 96 <= obs_window 96"));
}

TEST_F(ScenarioTest, GivenSequencesGiveTheSameNumbers) {
  RunOptions o = Options();
  o.seed = 999;  // ignored: the sequences are given
  for (const std::vector<int32_t>& seq : eval_->sequences()) {
    std::vector<int32_t> longer = seq;
    longer.push_back(5);  // extra tokens are ignored
    o.given_sequences.push_back(longer);
  }
  auto given = FidelityEval::Create(model_.get(), o, backend_.get());
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ((*given)->sequences(), eval_->sequences());
  const CompressionSpec spec = *ParseSpecString("keyformer:0.5");
  for (Scenario s : {Scenario::kInside, Scenario::kAfter}) {
    auto a = eval_->Evaluate(spec, InProcessCompressor(backend_.get()), s);
    auto b = (*given)->Evaluate(spec, InProcessCompressor(backend_.get()), s);
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->seq_kl, b->seq_kl);
    EXPECT_EQ(a->attn_rel_err, b->attn_rel_err);
  }
}

}  // namespace
}  // namespace kvc::fidelity

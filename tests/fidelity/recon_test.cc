// KVzip's reconstruction pass in the fidelity tools (kvc/fidelity/recon.h) on the real model:
// its rows are the queries of the context's copy in one causal forward over context + prompt +
// context, their log-masses match a double-precision sum over the pass's own keys, and
// FidelityEval hands them to kvzip specs (and refuses what it cannot run).
#include "kvc/fidelity/recon.h"

#include <cmath>
#include <string>
#include <vector>

#include "fidelity/eval_fixture.h"
#include "fidelity/model_util.h"
#include "gmock/gmock.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/protocol/spec_string.h"

namespace kvc::fidelity {
namespace {

using ::testing::HasSubstr;

std::vector<int32_t> Tokens(int n, int vocab, uint32_t seed) {
  std::vector<int32_t> out(n);
  for (int i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    out[i] = static_cast<int32_t>((seed >> 8) % static_cast<uint32_t>(vocab));
  }
  return out;
}

TEST(ReconstructionTest, RowsAreTheCopysQueriesAndLogMassesMatchAReference) {
  KVC_REQUIRE_MODEL(path);
  auto model = model::Transformer::Load(path);
  ASSERT_TRUE(model.ok()) << model.status();
  const model::LlamaConfig& c = model->config();
  // 258 rows: two blocks of the log-mass's row-blocked products (256 rows a block).
  const std::vector<int32_t> context = Tokens(251, c.vocab_size, 7);
  const std::vector<int32_t> prompt = {5, 9, 13, 17, 21, 25, 29};
  ASSERT_LE(2 * 251 + 7, c.seq_len);
  auto pass = RunReconstruction(*model, context, prompt);
  ASSERT_TRUE(pass.ok()) << pass.status();
  const int s = 251, w = s + 7, n = 2 * s + 7, hd = c.head_dim(), g = c.n_heads / c.n_kv_heads;
  EXPECT_EQ(pass->context_len, s);
  EXPECT_EQ(pass->rows, w);
  ASSERT_EQ(pass->q.size(), static_cast<size_t>(c.n_layers));
  ASSERT_EQ(pass->log_mass.size(), static_cast<size_t>(c.n_layers));

  std::vector<int32_t> all = context;
  all.insert(all.end(), prompt.begin(), prompt.end());
  all.insert(all.end(), context.begin(), context.end());
  auto fwd = model->Forward(all);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  for (int l = 0; l < c.n_layers; ++l) {
    const model::LayerProjections& lp = fwd->layers[l];
    ASSERT_EQ(pass->q[l].size(), static_cast<size_t>(c.n_heads) * w * hd);
    ASSERT_EQ(pass->log_mass[l].size(), static_cast<size_t>(c.n_heads) * w);
    for (int h = 0; h < c.n_heads; ++h) {
      for (int r = 0; r < w; ++r) {
        // Row r is position S + r of the forward, head h.
        const float* want = &lp.q[(static_cast<size_t>(h) * n + s + r) * hd];
        const float* got = &pass->q[l][(static_cast<size_t>(h) * w + r) * hd];
        for (int d = 0; d < hd; ++d) ASSERT_NEAR(got[d], want[d], 1e-5f) << l << " " << h;
        // Its log-mass over the pass's keys S .. S + r of its KV head, in double.
        double sum = 0;
        for (int j = s; j <= s + r; ++j) {
          const float* k = &lp.k[(static_cast<size_t>(h / g) * n + j) * hd];
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += static_cast<double>(want[d]) * k[d];
          sum += std::exp(dot / std::sqrt(static_cast<double>(hd)));
        }
        ASSERT_NEAR(pass->log_mass[l][static_cast<size_t>(h) * w + r], std::log(sum),
                    1e-4 * (1 + std::fabs(std::log(sum))))
            << "layer " << l << " head " << h << " row " << r;
      }
    }
  }
  // No prompt: the context's copy follows it directly, W = S.
  auto bare = RunReconstruction(*model, context, {});
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(bare->rows, s);
}

TEST(ReconstructionTest, RefusesWhatItCannotRun) {
  KVC_REQUIRE_MODEL(path);
  auto model = model::Transformer::Load(path);
  ASSERT_TRUE(model.ok()) << model.status();
  const model::LlamaConfig& c = model->config();
  // 2 x S + prompt past seq_len, named with its numbers.
  const std::vector<int32_t> longest = Tokens(c.seq_len / 2, c.vocab_size, 3);
  EXPECT_TRUE(RunReconstruction(*model, longest, {}).ok());  // exactly seq_len positions
  const absl::Status too_long = RunReconstruction(*model, longest, {1}).status();
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_long.message(), HasSubstr(absl::StrCat("seq_len ", c.seq_len)));
  EXPECT_THAT(RunReconstruction(*model, {}, {1}).status().message(), HasSubstr("empty"));
  // A prompt token outside the vocabulary (the forward pass checks every id).
  EXPECT_EQ(RunReconstruction(*model, {1, 2, 3}, {c.vocab_size}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ReconstructionTest, ParsesTokenIdsAndChecksSpecs) {
  auto ids = ParseTokenIds(" 1, 2 3,,40 ", "--kvzip_prompt");
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int32_t>{1, 2, 3, 40}));
  EXPECT_TRUE(ParseTokenIds("", "--kvzip_prompt")->empty());
  EXPECT_THAT(ParseTokenIds("1 x", "--kvzip_prompt").status().message(),
              HasSubstr("--kvzip_prompt: 'x'"));
  EXPECT_FALSE(ParseTokenIds("-1", "--kvzip_prompt").ok());
  EXPECT_FALSE(ParseTokenIds("99999999999", "--kvzip_prompt").ok());

  EXPECT_TRUE(NeedsReconstruction(*ParseSpecString("kvzip:0.5,top=4")));
  EXPECT_FALSE(NeedsReconstruction(*ParseSpecString("snapkv:0.5")));
  EXPECT_TRUE(CheckReconstructionSpec(*ParseSpecString("kvzip:0.5,stats=1")).ok());
  EXPECT_THAT(CheckReconstructionSpec(*ParseSpecString("kvzip:0.5,passes=40/40,chunk=30"))
                  .message(),
              HasSubstr("passes"));
}

constexpr int kSeqs = 2, kPrefix = 96, kWindow = 16;  // SmallRun's

class ReconEvalTest : public EvalFixture {
 protected:
  void SetUp() override {
    RunOptions o = SmallRun(4);
    o.kvzip_prompt = {3, 4};
    SetUpEval(o);
  }
};

TEST_F(ReconEvalTest, KVzipSpecsGetTheReconstructionOfTheirPrefix) {
  const CompressionSpec kvzip = *ParseSpecString("kvzip:0.25,stats=1,top=4");
  for (Scenario scenario : {Scenario::kInside, Scenario::kAfter}) {
    SCOPED_TRACE(ScenarioName(scenario));
    auto prefix = eval_->CompressedPrefix(1, scenario, kvzip);
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    const int p = scenario == Scenario::kInside ? kPrefix : kPrefix - kWindow;
    EXPECT_EQ(prefix->prefix_len, p);
    ASSERT_NE(prefix->recon, nullptr);
    EXPECT_EQ(prefix->obs_window, p + 2);  // the copy and the two prompt tokens
    EXPECT_EQ(prefix->recon->rows, p + 2);
    const LayerInput in = prefix->Input(2);
    EXPECT_EQ(in.shape.obs_window, p + 2);
    EXPECT_EQ(in.q_obs, prefix->recon->q[2].data());
    EXPECT_EQ(in.q_stats, prefix->recon->log_mass[2].data());
    // The rows are that prefix's own pass: the same as running it here.
    const std::vector<int32_t>& seq = eval_->sequences()[1];
    auto again = RunReconstruction(*model_, absl::MakeConstSpan(seq.data(), p),
                                   std::vector<int32_t>{3, 4});
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->q[2], prefix->recon->q[2]);
    EXPECT_EQ(again->log_mass[4], prefix->recon->log_mass[4]);
    // Kept on first use: a second call shares the rows.
    auto second = eval_->CompressedPrefix(1, scenario, kvzip);
    ASSERT_TRUE(second.ok());
    EXPECT_EQ(second->recon, prefix->recon);
    // Evaluate compresses and decodes with them.
    auto m = eval_->Evaluate(kvzip, InProcessCompressor(backend_.get()), scenario);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->obs_window, p + 2);
    EXPECT_LT(m->top1_agreement, 1.0);
    EXPECT_GT(m->top1_agreement, 0.0);
  }
  // passes= cannot be fed by one pass; other policies keep their own queries.
  EXPECT_THAT(eval_->CompressedPrefix(0, Scenario::kInside,
                                      *ParseSpecString("kvzip:0.5,passes=98/98,chunk=96"))
                  .status()
                  .message(),
              HasSubstr("passes"));
  auto snap = eval_->CompressedPrefix(0, Scenario::kInside, *ParseSpecString("snapkv:0.5"));
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->recon, nullptr);
  EXPECT_EQ(snap->obs_window, kWindow);
  EXPECT_THAT(eval_->CompressedPrefix(kSeqs, Scenario::kInside, *ParseSpecString("kvzip:0.5"))
                  .status()
                  .message(),
              HasSubstr("out of range"));
}

// The selection over all layers (xlayer=1) needs every layer at once: in-process compression,
// one layer at a time, refuses it instead of selecting per layer.
TEST_F(ReconEvalTest, InProcessCompressionRefusesTheSelectionOverLayers) {
  auto m = eval_->Evaluate(*ParseSpecString("kvzip:0.25,ada=0,stats=1,xlayer=1"),
                           InProcessCompressor(backend_.get()), Scenario::kAfter);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(m.status().message(), HasSubstr("xlayer=1"));
}

TEST_F(ReconEvalTest, RunOptionsRefuseAPromptOutsideTheVocabulary) {
  RunOptions o = eval_->options();
  o.kvzip_prompt = {1, model_->config().vocab_size};
  EXPECT_THAT(ValidateRunOptions(o, model_->config()).message(), HasSubstr("kvzip_prompt"));
}

}  // namespace
}  // namespace kvc::fidelity

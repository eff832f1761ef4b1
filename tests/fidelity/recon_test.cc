// KVzip's reconstruction passes in the fidelity tools (kvc/fidelity/recon.h) on the real model:
// a pass's rows are the queries of the context's copy in one causal forward over context +
// prompt + chunk, their log-masses match a double-precision sum over the pass's own keys, a long
// context takes one pass a chunk, and FidelityEval hands them to kvzip specs (naming the passes
// in the spec) and refuses what it cannot run.
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

// One pass over the whole context after `prompt`.
ReconPrompts OnePass(std::vector<int32_t> prompt) {
  ReconPrompts p;
  p.prompt = std::move(prompt);
  p.chunk = 0;
  return p;
}

std::vector<int32_t> Tokens(int n, int vocab, uint32_t seed) {
  std::vector<int32_t> out(n);
  for (int i = 0; i < n; ++i) {
    seed = seed * 1664525u + 1013904223u;
    out[i] = static_cast<int32_t>((seed >> 8) % static_cast<uint32_t>(vocab));
  }
  return out;
}

// Checks rows row0 .. row0 + |repeat| - 1 of `pass` against one forward over context + repeat
// (the pass's tokens): the queries of the repeat's positions, and each row's log-mass over the
// repeat's keys up to its own, summed in double.
void ExpectPassRows(const model::Transformer& model, const std::vector<int32_t>& context,
                    const std::vector<int32_t>& repeat, const ReconstructionPass& pass,
                    int row0) {
  const model::LlamaConfig& c = model.config();
  const int s = static_cast<int>(context.size()), rows = static_cast<int>(repeat.size());
  const int n = s + rows, w = pass.rows, hd = c.head_dim(), g = c.n_heads / c.n_kv_heads;
  std::vector<int32_t> all = context;
  all.insert(all.end(), repeat.begin(), repeat.end());
  auto fwd = model.Forward(all);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  for (int l = 0; l < c.n_layers; ++l) {
    const model::LayerProjections& lp = fwd->layers[l];
    ASSERT_EQ(pass.q[l].size(), static_cast<size_t>(c.n_heads) * w * hd);
    ASSERT_EQ(pass.log_mass[l].size(), static_cast<size_t>(c.n_heads) * w);
    for (int h = 0; h < c.n_heads; ++h) {
      for (int r = 0; r < rows; ++r) {
        // Row row0 + r is position S + r of the forward, head h.
        const float* want = &lp.q[(static_cast<size_t>(h) * n + s + r) * hd];
        const float* got = &pass.q[l][(static_cast<size_t>(h) * w + row0 + r) * hd];
        for (int d = 0; d < hd; ++d) ASSERT_NEAR(got[d], want[d], 1e-5f) << l << " " << h;
        // Its log-mass over the pass's keys S .. S + r of its KV head, in double.
        double sum = 0;
        for (int j = s; j <= s + r; ++j) {
          const float* k = &lp.k[(static_cast<size_t>(h / g) * n + j) * hd];
          double dot = 0;
          for (int d = 0; d < hd; ++d) dot += static_cast<double>(want[d]) * k[d];
          sum += std::exp(dot / std::sqrt(static_cast<double>(hd)));
        }
        ASSERT_NEAR(pass.log_mass[l][static_cast<size_t>(h) * w + row0 + r], std::log(sum),
                    1e-4 * (1 + std::fabs(std::log(sum))))
            << "layer " << l << " head " << h << " row " << row0 + r;
      }
    }
  }
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
  auto pass = RunReconstruction(*model, context, OnePass(prompt));
  ASSERT_TRUE(pass.ok()) << pass.status();
  EXPECT_EQ(pass->context_len, 251);
  EXPECT_EQ(pass->rows, 251 + 7);
  EXPECT_TRUE(pass->pass_rows.empty());  // one pass: the spec names none
  ASSERT_EQ(pass->q.size(), static_cast<size_t>(c.n_layers));
  ASSERT_EQ(pass->log_mass.size(), static_cast<size_t>(c.n_layers));
  std::vector<int32_t> repeat = prompt;
  repeat.insert(repeat.end(), context.begin(), context.end());
  ExpectPassRows(*model, context, repeat, *pass, 0);
  // No prompt: the context's copy follows it directly, W = S.
  auto bare = RunReconstruction(*model, context, OnePass({}));
  ASSERT_TRUE(bare.ok()) << bare.status();
  EXPECT_EQ(bare->rows, 251);
  // A context that fits in the default chunk (2,048) takes one pass as well.
  ReconPrompts defaults;
  defaults.prompt = prompt;
  auto same = RunReconstruction(*model, context, defaults);
  ASSERT_TRUE(same.ok()) << same.status();
  EXPECT_TRUE(same->pass_rows.empty());
  EXPECT_EQ(same->q[1], pass->q[1]);
  EXPECT_EQ(same->log_mass[3], pass->log_mass[3]);
}

// A context longer than the chunk: one pass a chunk (kvc.recon's repeat_passes), each on top of
// the context alone, the first after the prompt, every later one after the part prompt, the
// previous chunk's last 8 tokens and the suffix; the rows are concatenated in pass order.
TEST(ReconstructionTest, ALongContextTakesOnePassAChunk) {
  KVC_REQUIRE_MODEL(path);
  auto model = model::Transformer::Load(path);
  ASSERT_TRUE(model.ok()) << model.status();
  const model::LlamaConfig& c = model->config();
  const std::vector<int32_t> context = Tokens(100, c.vocab_size, 11);
  ReconPrompts prompts;
  prompts.prompt = {5, 9};
  prompts.part_prompt = {11, 12, 13};
  prompts.part_suffix = {14};
  prompts.chunk = 40;
  const std::vector<ReconPassPlan> plan = PlanReconstruction(context, prompts);
  ASSERT_EQ(plan.size(), 3u);
  auto head = [&](int start) {
    std::vector<int32_t> h = {11, 12, 13};
    h.insert(h.end(), context.begin() + start - 8, context.begin() + start);
    h.push_back(14);
    return h;
  };
  EXPECT_EQ(plan[0].start, 0);
  EXPECT_EQ(plan[0].end, 40);
  EXPECT_EQ(plan[0].head, prompts.prompt);
  EXPECT_EQ(plan[1].start, 40);
  EXPECT_EQ(plan[1].end, 80);
  EXPECT_EQ(plan[1].head, head(40));
  EXPECT_EQ(plan[2].start, 80);
  EXPECT_EQ(plan[2].end, 100);  // the last chunk is what is left
  EXPECT_EQ(plan[2].head, head(80));

  auto pass = RunReconstruction(*model, context, prompts);
  ASSERT_TRUE(pass.ok()) << pass.status();
  EXPECT_EQ(pass->pass_rows, (std::vector<int>{42, 52, 32}));
  EXPECT_EQ(pass->pass_tokens, 40);
  EXPECT_EQ(pass->rows, 42 + 52 + 32);
  int row0 = 0;
  for (const ReconPassPlan& p : plan) {
    SCOPED_TRACE(p.start);
    std::vector<int32_t> repeat = p.head;
    repeat.insert(repeat.end(), context.begin() + p.start, context.begin() + p.end);
    ExpectPassRows(*model, context, repeat, *pass, row0);
    row0 += static_cast<int>(repeat.size());
  }
  // The spec sent with these rows names the passes; a one-pass run leaves it as it was.
  const CompressionSpec spec = *ParseSpecString("kvzip:0.3,stats=1,top=4");
  const CompressionSpec named = SpecForPasses(spec, &*pass);
  EXPECT_EQ(named.eviction.pass_rows, pass->pass_rows);
  EXPECT_EQ(named.eviction.pass_tokens, 40);
  EXPECT_EQ(named.eviction.top_rows, 4);
  const ReconstructionPass one_pass;
  EXPECT_TRUE(SpecForPasses(spec, &one_pass).eviction.pass_rows.empty());
  EXPECT_TRUE(SpecForPasses(spec, nullptr).eviction.pass_rows.empty());
  // A chunk shorter than the overlap repeats the whole previous chunk; chunk 0 is one pass.
  prompts.chunk = 4;
  const std::vector<ReconPassPlan> small = PlanReconstruction(context, prompts);
  ASSERT_EQ(small.size(), 25u);
  EXPECT_EQ(small[1].head, (std::vector<int32_t>{11, 12, 13, context[0], context[1], context[2],
                                                 context[3], 14}));
  prompts.chunk = 0;
  EXPECT_EQ(PlanReconstruction(context, prompts).size(), 1u);
}

TEST(ReconstructionTest, RefusesWhatItCannotRun) {
  KVC_REQUIRE_MODEL(path);
  auto model = model::Transformer::Load(path);
  ASSERT_TRUE(model.ok()) << model.status();
  const model::LlamaConfig& c = model->config();
  // One pass: 2 x S + prompt past seq_len, named with its numbers.
  const std::vector<int32_t> longest = Tokens(c.seq_len / 2, c.vocab_size, 3);
  EXPECT_TRUE(RunReconstruction(*model, longest, OnePass({})).ok());  // exactly seq_len
  const absl::Status too_long = RunReconstruction(*model, longest, OnePass({1})).status();
  EXPECT_EQ(too_long.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(too_long.message(), HasSubstr(absl::StrCat("seq_len ", c.seq_len)));
  EXPECT_THAT(RunReconstruction(*model, {}, OnePass({1})).status().message(), HasSubstr("empty"));
  // In chunks it fits; a later pass's head (part prompt + 8 overlap + suffix) counts too.
  ReconPrompts chunked = OnePass({1});
  chunked.chunk = 16;
  EXPECT_TRUE(CheckReconstructionFits(c, c.seq_len / 2, chunked).ok());
  EXPECT_TRUE(CheckReconstructionFits(c, c.seq_len - 24, chunked).ok());  // + 8 overlap + 16
  const absl::Status over = CheckReconstructionFits(c, c.seq_len - 23, chunked);
  EXPECT_THAT(over.message(), HasSubstr("smaller --kvzip_chunk"));
  chunked.part_suffix = {2};
  EXPECT_FALSE(CheckReconstructionFits(c, c.seq_len - 24, chunked).ok());  // + 8 + 1 + 16
  chunked.chunk = 4;  // a later pass's overlap is at most a chunk: 4 + 1 + 4
  EXPECT_TRUE(CheckReconstructionFits(c, c.seq_len - 9, chunked).ok());
  EXPECT_FALSE(CheckReconstructionFits(c, c.seq_len - 8, chunked).ok());
  chunked.chunk = 16;
  // A token outside the vocabulary in any of the lists, a negative chunk.
  EXPECT_THAT(RunReconstruction(*model, {1, 2, 3}, OnePass({c.vocab_size})).status().message(),
              HasSubstr("kvzip_prompt: token"));
  chunked.part_prompt = {-1};
  EXPECT_THAT(RunReconstruction(*model, {1, 2, 3}, chunked).status().message(),
              HasSubstr("kvzip_part_prompt: token -1"));
  chunked.part_prompt = {};
  chunked.part_suffix = {c.vocab_size};
  EXPECT_THAT(RunReconstruction(*model, {1, 2, 3}, chunked).status().message(),
              HasSubstr("kvzip_part_suffix"));
  chunked.part_suffix = {};
  chunked.chunk = -1;
  EXPECT_THAT(RunReconstruction(*model, {1, 2, 3}, chunked).status().message(),
              HasSubstr("kvzip_chunk: -1"));
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
  auto prompts = ParseReconPrompts("1 2", "3", "", 64);
  ASSERT_TRUE(prompts.ok()) << prompts.status();
  EXPECT_EQ(prompts->prompt, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(prompts->part_prompt, (std::vector<int32_t>{3}));
  EXPECT_TRUE(prompts->part_suffix.empty());
  EXPECT_EQ(prompts->chunk, 64);
  EXPECT_THAT(ParseReconPrompts("", "3 y", "", 64).status().message(),
              HasSubstr("--kvzip_part_prompt: 'y'"));
  EXPECT_THAT(ParseReconPrompts("", "", "z", 64).status().message(),
              HasSubstr("--kvzip_part_suffix: 'z'"));
  EXPECT_THAT(ParseReconPrompts("", "", "", -1).status().message(),
              HasSubstr("--kvzip_chunk: -1 must be >= 0"));
  EXPECT_EQ(ParseReconPrompts("", "", "", 0)->chunk, 0);

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
    o.kvzip.prompt = {3, 4};
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
                                   eval_->options().kvzip);
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
  o.kvzip.prompt = {1, model_->config().vocab_size};
  EXPECT_THAT(ValidateRunOptions(o, model_->config()).message(), HasSubstr("kvzip_prompt"));
  o.kvzip.prompt = {};
  o.kvzip.chunk = -2;
  EXPECT_THAT(ValidateRunOptions(o, model_->config()).message(), HasSubstr("kvzip_chunk"));
}

// With a chunk shorter than the prefix the rows come from one pass a chunk, and the spec that
// compresses with them names those passes (kvcd then normalises each row over the sinks and its
// own chunk): the kept sets differ from the one-pass run's, and Evaluate decodes on them.
TEST_F(ReconEvalTest, AChunkedPrefixNamesItsPassesInTheSpec) {
  RunOptions o = eval_->options();
  o.kvzip.part_prompt = {5};
  o.kvzip.chunk = 32;
  auto chunked = FidelityEval::Create(model_.get(), o, backend_.get());
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  const CompressionSpec kvzip = *ParseSpecString("kvzip:0.25,stats=1");
  auto prefix = (*chunked)->CompressedPrefix(0, Scenario::kInside, kvzip);
  ASSERT_TRUE(prefix.ok()) << prefix.status();
  // 96 tokens in chunks of 32: {3, 4} + 32, then twice {5} + 8 overlap + 32.
  EXPECT_EQ(prefix->recon->pass_rows, (std::vector<int>{34, 41, 41}));
  EXPECT_EQ(prefix->obs_window, 116);
  auto m = (*chunked)->Evaluate(kvzip, InProcessCompressor(backend_.get()), Scenario::kInside);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->obs_window, 116);
  EXPECT_GT(m->top1_agreement, 0.0);
  // What the compressor got: the spec with the passes, and so other kept tokens than one pass.
  CompressionSpec seen;
  auto capture = [&](const PrefixCache& p, const CompressionSpec& spec,
                     int i) -> absl::StatusOr<std::vector<CompactLayer>> {
    seen = spec;
    return InProcessCompressor(backend_.get())(p, spec, i);
  };
  ASSERT_TRUE((*chunked)->Evaluate(kvzip, capture, Scenario::kInside).ok());
  EXPECT_EQ(seen.eviction.pass_rows, (std::vector<int>{34, 41, 41}));
  EXPECT_EQ(seen.eviction.pass_tokens, 32);
  auto one = eval_->CompressedPrefix(0, Scenario::kInside, kvzip);
  ASSERT_TRUE(one.ok()) << one.status();
  auto kept = [&](const PrefixCache& p, const CompressionSpec& spec) {
    auto layer = backend_->Compress(p.Input(1), spec, nullptr);
    EXPECT_TRUE(layer.ok()) << layer.status();
    return layer.ok() ? layer->bytes : ByteVector{};
  };
  EXPECT_NE(kept(*prefix, seen), kept(*one, kvzip));
}

}  // namespace
}  // namespace kvc::fidelity

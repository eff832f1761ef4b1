// The fidelity tool's pieces that need no model: spec lists, --only, seeds, scenarios, spread and
// bootstrap intervals, output path checks, plot axes and the SVG renderer.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/fidelity/report.h"
#include "kvc/fidelity/stats.h"
#include "kvc/fidelity/sweep.h"

namespace kvc::fidelity {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SpecListTest, SemicolonsSeparateSpecStringsThatHoldCommasAndPluses) {
  auto rows = ParseSpecList(" snapkv:0.25,kernel=5,pool=avg ; keyformer:0.5+think:0.5+q4;;q2g4", 8);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 3u);
  const SweepEntry& a = (*rows)[0];
  EXPECT_EQ(a.spec.eviction.policy, EvictionPolicy::kSnapKV);
  EXPECT_EQ(a.spec.eviction.keep_ratio, 0.25);
  EXPECT_EQ(a.spec.eviction.pool_kernel, 5);
  EXPECT_EQ(a.spec.eviction.pool, PoolKind::kAvg);
  EXPECT_EQ(a.family, "eviction");
  EXPECT_EQ(a.series, "snapkv:*,kernel=5,pool=avg");
  const SweepEntry& b = (*rows)[1];  // eviction + channels + bits
  EXPECT_EQ(b.spec.eviction.policy, EvictionPolicy::kKeyformer);
  EXPECT_EQ(b.spec.channels.key_policy, ChannelPolicy::kThink);
  EXPECT_EQ(b.spec.channels.key_lambda, 0.5);
  EXPECT_EQ(b.spec.quant.bits, 4);
  EXPECT_EQ(b.spec.quant.group_size, 8);  // "q4" without a group: the run's group
  EXPECT_EQ(b.family, "combined");
  EXPECT_EQ(b.label, SpecString(b.spec));
  EXPECT_EQ(b.series, "keyformer:*+think:0.5+q4g8");
  EXPECT_EQ((*rows)[2].spec.quant.group_size, 4);  // an explicit group stays
  EXPECT_EQ((*rows)[2].family, "quant");
}

TEST(SpecListTest, ErrorsNameTheItem) {
  auto bad = ParseSpecList("snapkv:0.5;h2o:2", 8);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(), HasSubstr("--spec 'h2o:2'"));
  EXPECT_THAT(ParseSpecList(" ; ;", 8).status().message(), HasSubstr("no spec strings"));
}

TEST(OnlyTest, MatchesLabelPrefixesAndFamiliesAndRefusesNoMatch) {
  auto rows = FilterOnly(DefaultSweep(8), "snapkv:0.5,quant");
  ASSERT_TRUE(rows.ok()) << rows.status();
  std::vector<std::string> labels;
  for (const SweepEntry& e : *rows) labels.push_back(e.label);
  EXPECT_THAT(labels, ElementsAre("snapkv:0.5", "snapkv:0.5+think:0.25", "snapkv:0.5+think:0.5",
                                  "q4g8", "q2g8", "snapkv:0.5,ada=0.2", "snapkv:0.5,value=mul",
                                  "snapkv:0.5,value=add"));
  EXPECT_EQ(FilterOnly(DefaultSweep(8), "")->size(), DefaultSweep(8).size());
  auto none = FilterOnly(DefaultSweep(8), "snapk:0.5");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("--only 'snapk:0.5' matches no row"));
  EXPECT_THAT(none.status().message(), HasSubstr("snapkv:0.5"));  // lists what exists
}

TEST(SeedTest, SeedZeroIsTheSpecAndLaterSeedsMoveTheNoise) {
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kKeyformer;
  s.eviction.seed = 7;
  EXPECT_EQ(ForSeed(s, 0).eviction.seed, 7u);
  EXPECT_EQ(ForSeed(s, 3).eviction.seed, 10u);
  EXPECT_EQ(ForSeed(s, 3).eviction.policy, EvictionPolicy::kKeyformer);
}

TEST(ScenarioTest, Parses) {
  EXPECT_THAT(*ParseScenarios("both"), ElementsAre(Scenario::kInside, Scenario::kAfter));
  EXPECT_THAT(*ParseScenarios("after, inside"), ElementsAre(Scenario::kAfter, Scenario::kInside));
  EXPECT_THAT(*ParseScenarios("after"), ElementsAre(Scenario::kAfter));
  EXPECT_THAT(ParseScenarios("inside,both").status().message(), HasSubstr("inside twice"));
  EXPECT_THAT(ParseScenarios("later").status().message(), HasSubstr("'later' is not one of"));
  EXPECT_THAT(ParseScenarios("").status().message(), HasSubstr("'' is not one of"));
  EXPECT_EQ(ScenarioName(Scenario::kAfter), "after");
}

TEST(NeedsQueriesTest, AttentionPoliciesAndThinkNeedQueries) {
  LayerShape shape;
  shape.num_kv_heads = 2;
  shape.num_q_heads = 4;
  shape.seq_len = 64;
  shape.head_dim = 8;
  shape.obs_window = 0;
  auto needs = [&](const char* text) { return NeedsQueries(*ParseSpecString(text), shape); };
  EXPECT_TRUE(needs("snapkv:0.5"));
  EXPECT_TRUE(needs("h2o:0.5"));
  EXPECT_TRUE(needs("keyformer:0.5"));
  EXPECT_TRUE(needs("streaming:0.5+think:0.25"));
  EXPECT_FALSE(needs("streaming:0.5"));
  EXPECT_FALSE(needs("knorm:0.5"));
  EXPECT_FALSE(needs("random:0.5+q4g8"));
  EXPECT_FALSE(needs("full"));
  EXPECT_FALSE(needs("snapkv@65"));  // invalid anyway: the compressor reports it
}

TEST(RunOptionsTest, GivenSequencesAreChecked) {
  model::LlamaConfig c;
  c.seq_len = 512;
  c.vocab_size = 100;
  RunOptions o;
  o.num_sequences = 2;
  o.prefix_len = 4;
  o.continuation = 2;
  o.obs_window = 1;
  o.given_sequences = {{1, 2, 3, 4, 5, 6}, {1, 2, 3, 4, 5, 6, 7}};
  EXPECT_TRUE(ValidateRunOptions(o, c).ok());
  o.given_sequences.pop_back();
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("1 given, num_sequences is 2"));
  o.given_sequences = {{1, 2, 3, 4, 5, 6}, {1, 2, 3, 4, 5}};
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("sequence 1 has 5 tokens"));
  o.given_sequences = {{1, 2, 3, 4, 5, 6}, {1, 2, 3, 100, 5, 6}};
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("token 100 outside [0, vocab 100)"));
}

TEST(StatsTest, SampleStdDev) {
  EXPECT_EQ(SampleStdDev({}), 0);
  EXPECT_EQ(SampleStdDev({3}), 0);
  EXPECT_DOUBLE_EQ(SampleStdDev({1, 2, 3, 4}), std::sqrt(5.0 / 3.0));
}

TEST(StatsTest, BootstrapIntervalIsDeterministicAndCoversTheMean) {
  EXPECT_EQ(BootstrapMeanInterval({}).lo, 0);
  const Interval one = BootstrapMeanInterval({0.4});
  EXPECT_EQ(one.lo, 0.4);
  EXPECT_EQ(one.hi, 0.4);
  const Interval same = BootstrapMeanInterval({0.5, 0.5, 0.5});
  EXPECT_EQ(same.lo, 0.5);
  EXPECT_EQ(same.hi, 0.5);
  std::vector<double> v;
  for (int i = 0; i < 32; ++i) v.push_back(i % 2);  // mean 0.5, sd 0.508
  const Interval a = BootstrapMeanInterval(v), b = BootstrapMeanInterval(v);
  EXPECT_EQ(a.lo, b.lo);
  EXPECT_EQ(a.hi, b.hi);
  EXPECT_LT(a.lo, 0.5);
  EXPECT_GT(a.hi, 0.5);
  // The normal approximation: +-1.96 * 0.508 / sqrt(32) = +-0.176, within resampling noise.
  EXPECT_NEAR(a.hi - a.lo, 2 * 0.176, 0.06);
  // Four times the data: about half the width.
  std::vector<double> w;
  for (int i = 0; i < 128; ++i) w.push_back(i % 2);
  const Interval c = BootstrapMeanInterval(w);
  EXPECT_NEAR((c.hi - c.lo) / (a.hi - a.lo), 0.5, 0.15);
}

TEST(StatsTest, SummarizePoolsSeeds) {
  Metrics a, b;
  a.steps = 4;
  a.top1_agreement = 0.5;
  a.mean_kl = 1.0;
  a.max_kl = 3;
  a.attn_rel_err = {0.2, 0.4};
  a.compact_bytes = 100;
  a.full_bytes = 400;
  a.seq_top1 = {0.25, 0.75};
  a.seq_kl = {0.5, 1.5};
  b = a;
  b.top1_agreement = 1.0;
  b.mean_kl = 2.0;
  b.max_kl = 5;
  b.attn_rel_err = {0.4, 0.6};
  b.seq_top1 = {1, 1};
  b.seq_kl = {2, 2};
  const SeedStats s = Summarize({a, b});
  EXPECT_EQ(s.seeds, 2);
  EXPECT_EQ(s.pooled.steps, 8);
  EXPECT_DOUBLE_EQ(s.pooled.top1_agreement, 0.75);
  EXPECT_DOUBLE_EQ(s.pooled.mean_kl, 1.5);
  EXPECT_EQ(s.pooled.max_kl, 5);
  EXPECT_THAT(s.pooled.attn_rel_err,
              ElementsAre(::testing::DoubleEq(0.3), ::testing::DoubleEq(0.5)));
  EXPECT_DOUBLE_EQ(s.pooled.mean_attn_rel_err, 0.4);
  EXPECT_EQ(s.pooled.compact_bytes, 200u);
  EXPECT_DOUBLE_EQ(s.pooled.size_ratio, 0.25);
  EXPECT_EQ(s.pooled.seq_top1.size(), 4u);
  EXPECT_DOUBLE_EQ(s.top1_sd, std::sqrt(0.125));
  EXPECT_DOUBLE_EQ(s.kl_sd, std::sqrt(0.5));
  EXPECT_LE(s.top1_ci.lo, 0.75);
  EXPECT_GE(s.top1_ci.hi, 0.75);
  EXPECT_GE(s.top1_ci.lo, 0.25);
}

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "kvc_" + name + "_" + std::to_string(::getpid());
}

TEST(CheckWritableTest, FailsOnBadPathsAndLeavesFilesAlone) {
  const absl::Status bad = CheckWritable("/nonexistent-dir/x.csv", "--csv");
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("--csv: cannot write '/nonexistent-dir/x.csv'"));
  const std::string fresh = TempPath("fresh.svg");
  EXPECT_TRUE(CheckWritable(fresh, "--svg").ok());
  EXPECT_NE(::access(fresh.c_str(), F_OK), 0);  // the check created nothing
  const std::string existing = TempPath("existing.png");
  std::ofstream(existing) << "keep";
  EXPECT_TRUE(CheckWritable(existing, "--png").ok());
  std::ifstream in(existing);
  std::string text;
  in >> text;
  EXPECT_EQ(text, "keep");
  std::remove(existing.c_str());
}

SweepResult Row(const char* spec, Scenario scenario, double size, double top1, Interval ci) {
  SweepResult r;
  r.entry = EntryForSpec(*ParseSpecString(spec));
  r.scenario = scenario;
  r.metrics.size_ratio = size;
  r.metrics.top1_agreement = top1;
  r.top1_ci = ci;
  return r;
}

TEST(PlotAxesTest, OnePanelPerScenarioAndTheYAxisFitsDataAndIntervals) {
  const std::vector<SweepResult> results = {
      Row("snapkv:0.5", Scenario::kInside, 0.54, 0.36, {0.31, 0.42}),
      Row("snapkv:0.25", Scenario::kInside, 0.27, 0.2, {0.16, 0.24}),
      Row("q4g8", Scenario::kInside, 0.61, 0.58, {0.5, 0.66}),
      Row("snapkv:0.5", Scenario::kAfter, 0.55, 0.3, {0.25, 0.35}),
  };
  const std::vector<PlotSpec> panels = AgreementPlots(results, "t");
  ASSERT_EQ(panels.size(), 2u);
  EXPECT_THAT(panels[0].title, HasSubstr("inside"));
  EXPECT_THAT(panels[1].title, HasSubstr("after"));
  EXPECT_DOUBLE_EQ(panels[0].y_min, 0.1);
  EXPECT_DOUBLE_EQ(panels[0].y_max, 0.7);
  EXPECT_DOUBLE_EQ(panels[0].x_max, 0.7);
  ASSERT_EQ(panels[0].series.size(), 2u);
  EXPECT_EQ(panels[0].series[0].name, "snapkv");
  EXPECT_EQ(panels[0].series[0].points.front(), std::make_pair(0.27, 0.2));
  EXPECT_EQ(panels[0].series[0].errors.front(), std::make_pair(0.16, 0.24));
  EXPECT_EQ(panels[0].series[1].name, "q4g8");
  EXPECT_DOUBLE_EQ(panels[1].y_min, 0.2);
  EXPECT_DOUBLE_EQ(panels[1].y_max, 0.4);
  for (double t : panels[1].y_ticks) {
    EXPECT_GE(t, panels[1].y_min - 1e-9);
    EXPECT_LE(t, panels[1].y_max + 1e-9);
  }
  EXPECT_GE(panels[1].y_ticks.size(), 3u);
  // The panels one above the other: the document is twice one panel's height.
  auto height = [](const std::string& svg) {
    const size_t at = svg.find("height=\"");
    return at == std::string::npos ? -1 : std::atoi(svg.c_str() + at + 8);
  };
  EXPECT_GT(height(RenderSvg({panels[0]})), 0);
  EXPECT_EQ(height(RenderSvg(panels)), height(RenderSvg({panels[0]})) * 2);
}

TEST(SvgTest, DrawsEverySeriesEscapedInOneDocument) {
  std::vector<SweepResult> results = {
      Row("snapkv:0.5", Scenario::kInside, 0.54, 0.36, {0.31, 0.42}),
      Row("snapkv:0.25", Scenario::kInside, 0.27, 0.2, {0.16, 0.24}),
      Row("snapkv:0.5+think:0.25", Scenario::kInside, 0.5, 0.3, {0.2, 0.4}),
      Row("q2g8", Scenario::kAfter, 0.5, 0.4, {0.3, 0.5}),
  };
  std::vector<PlotSpec> panels = AgreementPlots(results, "a < b");
  const std::string svg = RenderSvg(panels);
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_TRUE(absl::EndsWith(svg, "</svg>\n"));
  EXPECT_THAT(svg, HasSubstr(">snapkv</text>"));
  EXPECT_THAT(svg, HasSubstr(">snapkv:*+think:0.25</text>"));
  EXPECT_THAT(svg, HasSubstr(">q2g8</text>"));
  EXPECT_THAT(svg, HasSubstr("a &lt; b"));
  EXPECT_EQ(svg.find("a < b"), std::string::npos);
  EXPECT_THAT(svg, HasSubstr("<polyline points="));  // snapkv's two points joined
  EXPECT_EQ(WriteSvg(panels, "/nonexistent-dir/x.svg").code(), absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace kvc::fidelity

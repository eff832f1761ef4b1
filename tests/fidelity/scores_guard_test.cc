// CI guard for the query-agnostic scores on the real model: with no observation queries at all
// (obs_window 0, what a serving engine that does not expose queries can send), every policy that
// needs none compresses and decodes, and expected attention from calibration statistics (the
// other sequences' queries) beats StreamingLLM, knorm and KeyDiff on mean KL(full || compressed)
// at a quarter of the cache, and KeyDiff beats knorm. Measured with kvcfidelity on 16 sequences x
// 64 steps over seeds 1, 101 and 201 (docs/fidelity.md); here a CI-sized run over two seeds.
#include <cstdio>
#include <map>
#include <string>

#include "fidelity/eval_fixture.h"
#include "gtest/gtest.h"
#include "kvc/fidelity/fidelity.h"

namespace kvc::fidelity {
namespace {

class ScoresGuardTest : public EvalFixture, public ::testing::WithParamInterface<uint64_t> {
 protected:
  void SetUp() override {
    RunOptions o;
    o.num_sequences = 6;
    o.prefix_len = 128;
    o.continuation = 32;
    o.obs_window = 0;  // no queries: scores from keys, values and statistics only
    o.seed = GetParam();
    SetUpEval(o);
  }

  Metrics Run(const std::string& text) {
    absl::StatusOr<CompressionSpec> spec = ParseSpecString(text);
    EXPECT_TRUE(spec.ok()) << spec.status();
    if (!spec.ok()) return {};
    auto m = eval_->Evaluate(*spec, InProcessCompressor(backend_.get()));
    EXPECT_TRUE(m.ok()) << text << ": " << m.status();
    if (!m.ok()) return {};
    std::printf("seed %llu %-28s top1 %.4f  mean KL %.4e\n",
                static_cast<unsigned long long>(GetParam()), text.c_str(), m->top1_agreement,
                m->mean_kl);
    return *m;
  }
};

TEST_P(ScoresGuardTest, ExpectedAttentionFromStatisticsBeatsQueryFreeBaselines) {
  if (IsSkipped() || HasFatalFailure()) return;
  std::map<std::string, Metrics> m;
  for (const char* s :
       {"streaming:0.25", "knorm:0.25", "random:0.25", "keydiff:0.25", "expected:0.25,stats=1"}) {
    m[s] = Run(s);
    EXPECT_EQ(m[s].steps, 6 * 32) << s;
    EXPECT_GT(m[s].mean_kl, 1e-3) << s;  // a quarter of the cache must change something
  }
  const double expected = m["expected:0.25,stats=1"].mean_kl;
  for (const char* s : {"streaming:0.25", "knorm:0.25", "keydiff:0.25"}) {
    EXPECT_LT(expected, m[s].mean_kl) << "expected attention from statistics vs " << s;
  }
  EXPECT_LT(m["keydiff:0.25"].mean_kl, m["knorm:0.25"].mean_kl) << "keydiff vs knorm";
}

INSTANTIATE_TEST_SUITE_P(Seeds, ScoresGuardTest, ::testing::Values(1, 101));

}  // namespace
}  // namespace kvc::fidelity

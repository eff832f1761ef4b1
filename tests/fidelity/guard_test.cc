// CI guard on compression quality with the real model: keeping every token must reproduce
// full-cache decoding, and at half the cache the attention-based policies (h2o, snapkv, keyformer)
// must each beat both baselines (random, streaming) on mean KL(full || compressed).
#include <cstdio>
#include <map>
#include <string>

#include "fidelity/eval_fixture.h"
#include "fidelity/model_util.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/model/transformer.h"

namespace kvc::fidelity {
namespace {

class GuardTest : public EvalFixture {
 protected:
  void SetUp() override {
    // Small enough for CI (about a second), large enough that the ordering is not noise: 4
    // sequences x 32 teacher-forced steps on 128-token prefixes.
    RunOptions o;
    o.num_sequences = 4;
    o.prefix_len = 128;
    o.continuation = 32;
    o.obs_window = 16;
    o.seed = 1;
    SetUpEval(o);
  }

  Metrics Run(EvictionPolicy policy, double keep_ratio) {
    CompressionSpec spec;
    spec.eviction.policy = policy;
    spec.eviction.keep_ratio = keep_ratio;
    auto m = eval_->Evaluate(spec, InProcessCompressor(backend_.get()));
    EXPECT_TRUE(m.ok()) << m.status();
    std::printf("%-10s keep %.2f: top1 %.4f  mean KL %.4e  attn err %.4f\n",
                std::string(PolicyName(policy)).c_str(), keep_ratio, m->top1_agreement, m->mean_kl,
                m->mean_attn_rel_err);
    return m.ok() ? *m : Metrics{};
  }

};

constexpr EvictionPolicy kAllPolicies[] = {EvictionPolicy::kNone,      EvictionPolicy::kStreaming,
                                           EvictionPolicy::kH2O,       EvictionPolicy::kSnapKV,
                                           EvictionPolicy::kKeyformer, EvictionPolicy::kKNorm,
                                           EvictionPolicy::kRandom};

TEST_F(GuardTest, KeepingEveryTokenReproducesFullCacheDecoding) {
  for (EvictionPolicy p : kAllPolicies) {
    const Metrics m = Run(p, 1.0);
    EXPECT_EQ(m.steps, 4 * 32);
    EXPECT_EQ(m.top1_agreement, 1.0) << PolicyName(p);
    EXPECT_LT(m.mean_kl, 1e-8) << PolicyName(p);
    EXPECT_LT(m.max_kl, 1e-7) << PolicyName(p);
    EXPECT_LT(m.mean_attn_rel_err, 1e-5) << PolicyName(p);
  }
}

TEST_F(GuardTest, AttentionBasedPoliciesBeatBaselinesAtHalfTheCache) {
  std::map<EvictionPolicy, Metrics> at_half;
  for (EvictionPolicy p :
       {EvictionPolicy::kStreaming, EvictionPolicy::kRandom, EvictionPolicy::kH2O,
        EvictionPolicy::kSnapKV, EvictionPolicy::kKeyformer}) {
    at_half[p] = Run(p, 0.5);
    // Evicting half the cache must visibly change something, or the comparison means nothing.
    EXPECT_GT(at_half[p].mean_kl, 1e-3) << PolicyName(p);
  }
  const double random_kl = at_half[EvictionPolicy::kRandom].mean_kl;
  const double streaming_kl = at_half[EvictionPolicy::kStreaming].mean_kl;
  for (EvictionPolicy p :
       {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV, EvictionPolicy::kKeyformer}) {
    EXPECT_LT(at_half[p].mean_kl, random_kl) << PolicyName(p) << " vs random";
    EXPECT_LT(at_half[p].mean_kl, streaming_kl) << PolicyName(p) << " vs streaming";
  }
}

}  // namespace
}  // namespace kvc::fidelity

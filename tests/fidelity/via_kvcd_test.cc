// The fidelity numbers through a real kvcd: each prefix cache goes up with PutCache (the spec in
// the header) and comes back with GetCache PACKED; decoding on the served blobs must give exactly
// the in-process numbers, and the blobs must be byte-identical.
#include "kvc/fidelity/via_kvcd.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fidelity/eval_fixture.h"
#include "fidelity/model_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/client.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/model/transformer.h"
#include "testing/kvcd_process.h"

namespace kvc::fidelity {
namespace {

using ::testing::HasSubstr;

class ViaKvcdTest : public EvalFixture {
 protected:
  void SetUp() override {
    SetUpEval(SmallRun(5));
    if (IsSkipped() || HasFatalFailure()) return;

    testing::KvcdProcess::Options kvcd_options;
    kvcd_options.binary = KVCD_PATH;
    auto kvcd = testing::KvcdProcess::Start(kvcd_options);
    ASSERT_TRUE(kvcd.ok()) << kvcd.status();
    kvcd_ = *std::move(kvcd);
    ClientOptions client_options;
    client_options.target = kvcd_->address();
    auto client = Client::Create(client_options);
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  std::unique_ptr<testing::KvcdProcess> kvcd_;
  std::unique_ptr<Client> client_;
};

std::vector<CompressionSpec> Specs() {
  std::vector<CompressionSpec> specs(8);
  specs[4] = *ParseSpecString("knorm:0.5");  // query-agnostic: after sends W = 0
  specs[5] = *ParseSpecString("keyformer:0.5,seed=3+think:0.5+q4g4");
  // kvzip: S + prompt reconstruction rows (more than the tokens), with and without their
  // log-masses (without, neither side may read them).
  specs[6] = *ParseSpecString("kvzip:0.5,stats=1,top=4");
  specs[7] = *ParseSpecString("kvzip:0.25");
  specs[0].eviction.policy = EvictionPolicy::kSnapKV;
  specs[0].eviction.keep_ratio = 0.5;
  specs[1].eviction.policy = EvictionPolicy::kKeyformer;  // seeded noise must match too
  specs[1].eviction.keep_ratio = 0.25;
  specs[1].eviction.seed = 9;
  specs[2].eviction.policy = EvictionPolicy::kH2O;
  specs[2].eviction.keep_ratio = 0.5;
  specs[2].channels.key_policy = ChannelPolicy::kThink;
  specs[2].channels.key_lambda = 0.25;
  specs[2].recent_tokens = 8;
  specs[3].quant.bits = 2;
  specs[3].quant.group_size = 8;
  return specs;
}

TEST_F(ViaKvcdTest, ServedBlobsGiveExactlyTheInProcessNumbers) {
  const Compressor local = InProcessCompressor(backend_.get());
  const Compressor remote = KvcdCompressor(client_.get(), "fidelity-test");
  for (const CompressionSpec& spec : Specs()) {
    const std::string name =
        absl::StrCat(std::string(PolicyName(spec.eviction.policy)),
                     spec.eviction.query_stats ? "+stats" : "", "/",
                     std::string(PolicyName(spec.channels.key_policy)), "/q", spec.quant.bits);
    // Byte-identical blobs for every sequence.
    for (int i = 0; i < eval_->options().num_sequences; ++i) {
      absl::StatusOr<PrefixCache> prefix = eval_->CompressedPrefix(i, Scenario::kInside, spec);
      ASSERT_TRUE(prefix.ok()) << name << ": " << prefix.status();
      auto a = local(*prefix, spec, i);
      auto b = remote(*prefix, spec, i);
      ASSERT_TRUE(a.ok()) << name << ": " << a.status();
      ASSERT_TRUE(b.ok()) << name << ": " << b.status();
      ASSERT_EQ(a->size(), b->size());
      for (size_t l = 0; l < a->size(); ++l) {
        EXPECT_EQ((*a)[l].bytes, (*b)[l].bytes) << name << " sequence " << i << " layer " << l;
      }
    }
    // And therefore identical metrics, compared exactly, in both scenarios (the after scenario
    // sends a shorter prefix, and no queries at all for query-agnostic specs).
    for (Scenario scenario : {Scenario::kInside, Scenario::kAfter}) {
      const std::string where = absl::StrCat(name, " ", ScenarioName(scenario));
      auto m_local = eval_->Evaluate(spec, local, scenario);
      auto m_remote = eval_->Evaluate(spec, remote, scenario);
      ASSERT_TRUE(m_local.ok()) << where << ": " << m_local.status();
      ASSERT_TRUE(m_remote.ok()) << where << ": " << m_remote.status();
      EXPECT_LT(m_local->top1_agreement, 1.0) << where << ": compression should change something";
      EXPECT_EQ(m_local->top1_agreement, m_remote->top1_agreement) << where;
      EXPECT_EQ(m_local->mean_kl, m_remote->mean_kl) << where;
      EXPECT_EQ(m_local->max_kl, m_remote->max_kl) << where;
      EXPECT_EQ(m_local->attn_rel_err, m_remote->attn_rel_err) << where;
      EXPECT_EQ(m_local->size_ratio, m_remote->size_ratio) << where;
      EXPECT_EQ(m_local->compact_bytes, m_remote->compact_bytes) << where;
      EXPECT_EQ(m_local->seq_kl, m_remote->seq_kl) << where;
      EXPECT_EQ(m_local->obs_window, m_remote->obs_window) << where;
    }
  }
  // Every cache was deleted after it was fetched.
  auto left = client_->ListCaches("fidelity-test");
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->empty());
}

TEST_F(ViaKvcdTest, ServerRejectionsComeBackWithTheirField) {
  CompressionSpec spec;
  spec.quant.bits = 4;
  spec.quant.group_size = 32;  // does not divide head_dim 8
  auto local = InProcessCompressor(backend_.get())(eval_->prefix(0), spec, 0);
  auto remote = KvcdCompressor(client_.get(), "fidelity-bad")(eval_->prefix(0), spec, 0);
  ASSERT_FALSE(local.ok());
  ASSERT_FALSE(remote.ok());
  EXPECT_EQ(remote.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(remote.status().message(), HasSubstr("group_size"));
}

TEST(SpecToProtoTest, CarriesEveryField) {
  CompressionSpec spec;
  spec.eviction.policy = EvictionPolicy::kSnapKV;
  spec.eviction.budget = 17;
  spec.eviction.keep_ratio = 0.3;
  spec.eviction.layer_budgets = {4, 0, 9};
  spec.eviction.granularity = Granularity::kPerLayer;
  spec.eviction.sink_tokens = 2;
  spec.eviction.pool_kernel = 5;
  spec.eviction.pool = PoolKind::kAvg;
  spec.eviction.tau = 1.5;
  spec.eviction.seed = 77;
  spec.channels.key_policy = ChannelPolicy::kL2;
  spec.channels.key_lambda = 0.25;
  spec.channels.prune_values = true;
  spec.channels.value_lambda = 0.125;
  spec.quant.bits = 8;
  spec.quant.group_size = 16;
  spec.recent_tokens = 12;
  const kvcache::v1::CompressionConfig c = SpecToProto(spec);
  EXPECT_EQ(c.eviction().policy(), "snapkv");
  EXPECT_EQ(c.eviction().budget(), 17u);
  EXPECT_EQ(c.eviction().keep_ratio(), 0.3);
  EXPECT_THAT(c.eviction().layer_budgets(), ::testing::ElementsAre(4, 0, 9));
  EXPECT_EQ(c.eviction().granularity(), kvcache::v1::GRANULARITY_PER_LAYER);
  EXPECT_EQ(c.eviction().sink_tokens(), 2u);
  EXPECT_FALSE(c.eviction().has_recent_fraction());  // -1: the policy's default
  EXPECT_EQ(c.eviction().pool_kernel(), 5u);
  EXPECT_EQ(c.eviction().pool(), "avg");
  EXPECT_EQ(c.eviction().tau(), 1.5);
  EXPECT_EQ(c.eviction().seed(), 77u);
  EXPECT_EQ(c.channels().key_policy(), "l2");
  EXPECT_EQ(c.channels().key_lambda(), 0.25);
  EXPECT_TRUE(c.channels().prune_values());
  EXPECT_EQ(c.channels().value_lambda(), 0.125);
  EXPECT_EQ(c.quant().bits(), 8u);
  EXPECT_EQ(c.quant().group_size(), 16u);
  EXPECT_EQ(c.recent_tokens(), 12u);
  spec.eviction.recent_fraction = 0.4;
  EXPECT_EQ(SpecToProto(spec).eviction().recent_fraction(), 0.4);
}

}  // namespace
}  // namespace kvc::fidelity

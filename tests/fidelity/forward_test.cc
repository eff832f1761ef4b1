// Transformer::Forward (sgemm, blocked attention, RoPE tables) against the plain reference of
// reference_model.h and against DecodeStep, on Hugging Face-shaped models: GQA, a head_dim that is
// not hidden / heads, RoPE theta and scaling, tied and untied classifiers; and ForwardOptions.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fidelity/hf_model_util.h"
#include "fidelity/reference_model.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/model/checkpoint.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"

namespace kvc::model {
namespace {

using ::kvc::testing::ConfigJson;
using ::kvc::testing::FreshDir;
using ::kvc::testing::HfShape;
using ::kvc::testing::RandomLlamaTensors;
using ::kvc::testing::RemoveDir;
using ::kvc::testing::WriteHfDir;
using ::testing::HasSubstr;
using Json = nlohmann::json;

struct Case {
  std::string name;
  HfShape shape;
  Json rope;  // merged into config.json
  int tokens;
};

std::vector<Case> Cases() {
  std::vector<Case> cases;
  HfShape gqa;  // hidden 32, 4 heads of 8, 2 KV heads, tied
  cases.push_back({"gqa_tied", gqa, {{"rope_theta", 10000.0}}, 40});
  HfShape wide = gqa;  // head_dim 16: q_dim 64 != hidden 32; one KV head; untied
  wide.head_dim = 16;
  wide.kv_heads = 1;
  wide.tied = false;
  cases.push_back({"wide_heads_untied", wide, {{"rope_theta", 100000.0}}, 300});
  HfShape mha = gqa;
  mha.kv_heads = 4;
  mha.layers = 3;
  cases.push_back(
      {"linear_scaling",
       mha,
       {{"rope_parameters", {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 10000.0}}}},
       150});
  cases.push_back({"llama3_scaling",
                   gqa,
                   {{"rope_theta", 500000.0},
                    {"rope_scaling",
                     {{"rope_type", "llama3"},
                      {"factor", 8.0},
                      {"low_freq_factor", 1.0},
                      {"high_freq_factor", 4.0},
                      {"original_max_position_embeddings", 32}}}},
                   200});
  return cases;
}

class ForwardTest : public ::testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    const Case& c = GetParam();
    dir_ = FreshDir(c.name);
    Json config = ConfigJson(c.shape);
    config["max_position_embeddings"] = 512;
    for (auto it = c.rope.begin(); it != c.rope.end(); ++it) config[it.key()] = it.value();
    ASSERT_TRUE(
        WriteHfDir(dir_, config, RandomLlamaTensors(c.shape, 3, !c.shape.tied), StDType::kBF16)
            .ok());
    absl::StatusOr<Checkpoint> ck = Checkpoint::LoadHuggingFace(dir_);
    ASSERT_TRUE(ck.ok()) << ck.status();
    ck_ = std::make_unique<Checkpoint>(*std::move(ck));
    absl::StatusOr<Transformer> model = Transformer::Load(dir_);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<Transformer>(*std::move(model));
    for (int t = 0; t < c.tokens; ++t) tokens_.push_back((t * 37 + 11) % c.shape.vocab);
  }
  void TearDown() override { RemoveDir(dir_); }
  std::string dir_;
  std::unique_ptr<Checkpoint> ck_;
  std::unique_ptr<Transformer> model_;
  std::vector<int32_t> tokens_;
};

double MaxAbs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v) m = std::max(m, std::fabs(double{x}));
  return m;
}

TEST_P(ForwardTest, MatchesThePlainReference) {
  absl::StatusOr<ForwardOutput> fwd = model_->Forward(tokens_);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const std::vector<float> ref = kvc::testing::ReferenceLogits(*ck_, model_->config(), tokens_);
  ASSERT_EQ(fwd->logits.size(), ref.size());
  double max_diff = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(double{fwd->logits[i]} - ref[i]));
  }
  const double scale = MaxAbs(ref);
  std::printf("%s: max |Forward - reference| %.3g, max |logit| %.3g\n", GetParam().name.c_str(),
              max_diff, scale);
  EXPECT_GT(scale, 1.0);  // the model is not degenerate
  EXPECT_LT(max_diff, 1e-4 * scale);
}

TEST_P(ForwardTest, DecodeStepMatchesForward) {
  absl::StatusOr<ForwardOutput> fwd = model_->Forward(tokens_);
  ASSERT_TRUE(fwd.ok());
  auto cache = FullKvCache::Create(model_->config(), static_cast<int>(tokens_.size()));
  ASSERT_TRUE(cache.ok());
  std::vector<float> logits(model_->config().vocab_size);
  double max_diff = 0;
  for (size_t t = 0; t < tokens_.size(); ++t) {
    ASSERT_TRUE(model_->DecodeStep(tokens_[t], cache->get(), absl::MakeSpan(logits)).ok());
    for (size_t i = 0; i < logits.size(); ++i) {
      max_diff = std::max(max_diff, std::fabs(double{logits[i]} - fwd->logits_at(t)[i]));
    }
  }
  EXPECT_LT(max_diff, 1e-4 * MaxAbs(fwd->logits));
}

TEST_P(ForwardTest, LastLogitsAndNoLayers) {
  absl::StatusOr<ForwardOutput> all = model_->Forward(tokens_);
  ForwardOptions o;
  o.last_logits = 3;
  o.keep_layers = false;
  absl::StatusOr<ForwardOutput> last = model_->Forward(tokens_, o);
  ASSERT_TRUE(all.ok() && last.ok());
  const int s = static_cast<int>(tokens_.size()), vocab = model_->config().vocab_size;
  EXPECT_EQ(last->logits_first, s - 3);
  ASSERT_EQ(last->logits.size(), 3u * vocab);
  EXPECT_TRUE(last->layers.empty());
  EXPECT_EQ(all->layers.size(), static_cast<size_t>(model_->config().n_layers));
  // The same rows through a smaller sgemm: equal up to the kernel's summation order.
  const double tol = 1e-5 * MaxAbs(all->logits);
  for (int t = s - 3; t < s; ++t) {
    for (int i = 0; i < vocab; ++i) {
      ASSERT_NEAR(last->logits_at(t)[i], all->logits_at(t)[i], tol) << t << " " << i;
    }
  }
  o.last_logits = 0;
  EXPECT_TRUE(model_->Forward(tokens_, o)->logits.empty());
  o.last_logits = 100000;  // more than the sequence: every position
  EXPECT_EQ(model_->Forward(tokens_, o)->logits, all->logits);
  o.last_logits = -2;
  EXPECT_THAT(model_->Forward(tokens_, o).status().message(), HasSubstr("last_logits: -2"));
}

INSTANTIATE_TEST_SUITE_P(HfShapes, ForwardTest, ::testing::ValuesIn(Cases()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace kvc::model

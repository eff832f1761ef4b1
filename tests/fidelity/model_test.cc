// The reference model on its own: checkpoint validation, Forward vs incremental decoding, and that
// text sampled from the real model is likely under it.
#include <cmath>
#include <cstdio>
#include <vector>

#include "fidelity/model_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/model/checkpoint.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"

namespace kvc::model {
namespace {

using ::kvc::testing::WriteCheckpoint;
using ::testing::HasSubstr;

// A small valid config: dim 16, hidden 24, 2 layers, 4 heads, 2 KV heads, vocab 32, seq_len 16.
std::vector<int32_t> SmallHeader(int32_t vocab = 32) { return {16, 24, 2, 4, 2, vocab, 16}; }

LlamaConfig ConfigOf(const std::vector<int32_t>& h) {
  LlamaConfig c;
  c.dim = h[0];
  c.hidden_dim = h[1];
  c.n_layers = h[2];
  c.n_heads = h[3];
  c.n_kv_heads = h[4];
  c.vocab_size = std::abs(h[5]);
  c.seq_len = h[6];
  c.shared_classifier = h[5] > 0;
  return c;
}

size_t FloatsOf(const std::vector<int32_t>& h) {
  absl::StatusOr<uint64_t> n = CheckpointFloatCount(ConfigOf(h));
  return n.ok() ? *n : 0;
}

absl::Status LoadStatus(const std::string& path) {
  absl::Status s = Checkpoint::Load(path).status();
  std::remove(path.c_str());
  return s;
}

TEST(CheckpointTest, FloatCountMatchesTheRealModelsFileSize) {
  // stories260K: 1,056,540 bytes = 28-byte header + 264,128 floats (../shared/models/README.md's layout).
  LlamaConfig c = ConfigOf({64, 172, 5, 8, 4, 512, 512});
  absl::StatusOr<uint64_t> n = CheckpointFloatCount(c);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 264128u);
  c.shared_classifier = false;
  EXPECT_EQ(*CheckpointFloatCount(c), 264128u + 512u * 64u);
}

TEST(CheckpointTest, LoadsAValidSyntheticFile) {
  const auto header = SmallHeader();
  const std::string path = WriteCheckpoint("valid", header, FloatsOf(header));
  absl::StatusOr<Checkpoint> ck = Checkpoint::Load(path);
  std::remove(path.c_str());
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->config().head_dim(), 4);
  EXPECT_EQ(ck->config().kv_dim(), 8);
  EXPECT_TRUE(ck->config().shared_classifier);
  EXPECT_EQ(ck->classifier(), ck->token_embedding());
}

TEST(CheckpointTest, NegativeVocabMeansASeparateClassifier) {
  const auto header = SmallHeader(-32);
  const std::string path = WriteCheckpoint("unshared", header, FloatsOf(header));
  absl::StatusOr<Checkpoint> ck = Checkpoint::Load(path);
  std::remove(path.c_str());
  ASSERT_TRUE(ck.ok()) << ck.status();
  EXPECT_EQ(ck->config().vocab_size, 32);
  EXPECT_FALSE(ck->config().shared_classifier);
  // The classifier is the last vocab*dim floats of the file.
  EXPECT_EQ(ck->classifier() + 32 * 16, ck->token_embedding() + FloatsOf(header));
}

TEST(CheckpointTest, RejectsMissingAndShortFiles) {
  EXPECT_EQ(Checkpoint::Load("/nonexistent/kvc_model.bin").status().code(),
            absl::StatusCode::kNotFound);
  const std::string tiny = WriteCheckpoint("tiny", {16, 24, 2}, 0);  // 12 bytes
  absl::Status s = LoadStatus(tiny);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("shorter than the 28-byte header"));
}

TEST(CheckpointTest, RejectsADirectory) {
  absl::StatusOr<Checkpoint> ck = Checkpoint::Load(::testing::TempDir());
  EXPECT_FALSE(ck.ok());
}

TEST(CheckpointTest, RejectsTruncatedWeights) {
  const auto header = SmallHeader();
  absl::Status s = LoadStatus(WriteCheckpoint("trunc", header, FloatsOf(header) - 1));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("(truncated)"));
  EXPECT_THAT(s.message(), HasSubstr(std::to_string(28 + 4 * FloatsOf(header))));
}

TEST(CheckpointTest, RejectsTrailingBytes) {
  const auto header = SmallHeader();
  absl::Status s = LoadStatus(WriteCheckpoint("trail", header, FloatsOf(header), 3));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("(trailing bytes)"));
}

TEST(CheckpointTest, RejectsInconsistentHeaders) {
  struct Case {
    std::vector<int32_t> header;
    const char* message;
  };
  const Case cases[] = {
      {{0, 24, 2, 4, 2, 32, 16}, "dim: 0 must be positive"},
      {{16, -1, 2, 4, 2, 32, 16}, "hidden_dim: -1 must be positive"},
      {{16, 24, 0, 4, 2, 32, 16}, "n_layers: 0 must be positive"},
      {{16, 24, 2, 0, 2, 32, 16}, "n_heads: 0 must be positive"},
      {{16, 24, 2, 4, 0, 32, 16}, "n_kv_heads: 0 must be positive"},
      {{16, 24, 2, 4, 2, 0, 16}, "vocab_size: 0 must be positive"},
      {{16, 24, 2, 4, 2, INT32_MIN, 16}, "vocab_size: -2147483648 must be positive"},
      {{16, 24, 2, 4, 2, 32, 0}, "seq_len: 0 must be positive"},
      {{18, 24, 2, 4, 2, 32, 16}, "dim: 18 is not divisible by n_heads 4"},
      {{16, 24, 2, 4, 3, 32, 16}, "n_heads: 4 is not a multiple of n_kv_heads 3"},
      {{12, 24, 2, 4, 2, 32, 16}, "head_dim: dim / n_heads = 3 is odd"},
  };
  for (const Case& c : cases) {
    // Enough bytes that only the header can be wrong.
    absl::Status s = LoadStatus(WriteCheckpoint("bad", c.header, 20000));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
}

TEST(CheckpointTest, RejectsAHeaderWhoseSizeOverflows) {
  const std::vector<int32_t> header = {1 << 30, 1 << 30, 1 << 30, 2, 1, 1 << 30, 1 << 30};
  absl::Status s = LoadStatus(WriteCheckpoint("huge", header, 16));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("overflows"));
}

TEST(RopeTest, RotatesPairsByPositionTimesFrequency) {
  std::vector<float> x = {1, 0, 1, 0};  // one head, head_dim 4
  ApplyRope(x.data(), 1, 4, 0);
  EXPECT_THAT(x, ::testing::ElementsAre(1, 0, 1, 0));
  ApplyRope(x.data(), 1, 4, 3);
  // Pair 0: frequency 1, angle 3. Pair 1: frequency 10000^(-1/2) = 0.01, angle 0.03.
  EXPECT_NEAR(x[0], std::cos(3.0), 1e-6);
  EXPECT_NEAR(x[1], std::sin(3.0), 1e-6);
  EXPECT_NEAR(x[2], std::cos(0.03), 1e-6);
  EXPECT_NEAR(x[3], std::sin(0.03), 1e-6);
}

TEST(SamplerTest, GreedyAndSeededSampling) {
  const std::vector<float> logits = {0.5f, 2.0f, 2.0f, -1.0f};
  Sampler greedy(0.0f, 1);
  EXPECT_EQ(greedy.Sample(logits), 1);
  Sampler a(1.0f, 42), b(1.0f, 42);
  std::vector<int> counts(4);
  for (int i = 0; i < 4000; ++i) {
    const int ta = a.Sample(logits);
    ASSERT_EQ(ta, b.Sample(logits));
    ++counts[ta];
  }
  // p = softmax(logits) = {0.0982, 0.4400, 0.4400, 0.0219}.
  EXPECT_NEAR(counts[0] / 4000.0, 0.0982, 0.015);
  EXPECT_NEAR(counts[1] / 4000.0, 0.4400, 0.03);
  EXPECT_NEAR(counts[3] / 4000.0, 0.0219, 0.01);
}

TEST(TransformerTest, RejectsBadTokens) {
  const auto header = SmallHeader();
  const std::string path = WriteCheckpoint("tokens", header, FloatsOf(header));
  absl::StatusOr<Transformer> model = Transformer::Load(path);
  std::remove(path.c_str());
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_THAT(model->Forward({}).status().message(), HasSubstr("tokens: empty"));
  EXPECT_THAT(model->Forward({1, 32}).status().message(), HasSubstr("tokens[1]: 32"));
  EXPECT_THAT(model->Forward(std::vector<int32_t>(17, 1)).status().message(),
              HasSubstr("exceed the model's seq_len 16"));
  auto cache = FullKvCache::Create(model->config(), 1);
  ASSERT_TRUE(cache.ok());
  std::vector<float> logits(32);
  EXPECT_THAT(model->DecodeStep(-1, cache->get(), absl::MakeSpan(logits)).message(),
              HasSubstr("token: -1"));
  EXPECT_EQ((*cache)->position(), 0);
  ASSERT_TRUE(model->DecodeStep(1, cache->get(), absl::MakeSpan(logits)).ok());
  EXPECT_EQ(model->DecodeStep(1, cache->get(), absl::MakeSpan(logits)).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ((*cache)->position(), 1);
}

// Forward and DecodeStep are separate code paths; they must agree.
void ExpectIncrementalMatchesForward(const Transformer& model, const std::vector<int32_t>& tokens,
                                     double tol) {
  absl::StatusOr<ForwardOutput> fwd = model.Forward(tokens);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  auto cache = FullKvCache::Create(model.config(), static_cast<int>(tokens.size()));
  ASSERT_TRUE(cache.ok());
  std::vector<float> logits(model.config().vocab_size);
  double max_diff = 0;
  for (size_t t = 0; t < tokens.size(); ++t) {
    ASSERT_TRUE(model.DecodeStep(tokens[t], cache->get(), absl::MakeSpan(logits)).ok());
    for (int i = 0; i < model.config().vocab_size; ++i) {
      max_diff = std::max(max_diff, std::abs(double{logits[i]} - fwd->logits_at(t)[i]));
    }
  }
  EXPECT_LT(max_diff, tol);
  std::printf("max |logit(incremental) - logit(forward)| over %zu positions: %.3g\n", tokens.size(),
              max_diff);
}

TEST(TransformerTest, IncrementalMatchesForwardOnASyntheticModel) {
  const auto header = SmallHeader(-32);
  const std::string path = WriteCheckpoint("incr", header, FloatsOf(header), 0, 0.5f);
  absl::StatusOr<Transformer> model = Transformer::Load(path);
  std::remove(path.c_str());
  ASSERT_TRUE(model.ok()) << model.status();
  ExpectIncrementalMatchesForward(*model, {1, 5, 9, 31, 0, 7, 7, 2, 30, 11, 4, 1, 3, 8, 12, 6},
                                  1e-4);
}

class RealModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    KVC_REQUIRE_MODEL(path);
    absl::StatusOr<Transformer> model = Transformer::Load(path);
    ASSERT_TRUE(model.ok()) << model.status();
    model_ = std::make_unique<Transformer>(*std::move(model));
  }
  std::unique_ptr<Transformer> model_;
};

TEST_F(RealModelTest, HeaderIsStories260K) {
  const LlamaConfig& c = model_->config();
  EXPECT_EQ(c.dim, 64);
  EXPECT_EQ(c.hidden_dim, 172);
  EXPECT_EQ(c.n_layers, 5);
  EXPECT_EQ(c.n_heads, 8);
  EXPECT_EQ(c.n_kv_heads, 4);
  EXPECT_EQ(c.vocab_size, 512);
  EXPECT_EQ(c.seq_len, 512);
  EXPECT_TRUE(c.shared_classifier);
}

TEST_F(RealModelTest, IncrementalDecodingReproducesForward) {
  Sampler sampler(1.0f, 7);
  absl::StatusOr<std::vector<int32_t>> seq = model_->Generate({kBosToken}, 199, &sampler);
  ASSERT_TRUE(seq.ok()) << seq.status();
  ExpectIncrementalMatchesForward(*model_, *seq, 1e-3);
}

TEST_F(RealModelTest, SampledTextIsLikelyUnderTheModel) {
  // Uniform guessing costs ln(512) = 6.24 nats per token; a trained model's own samples cost about
  // their entropy. Temperature 1 (unbiased samples) and 0.8.
  const double uniform = std::log(512.0);
  for (float temperature : {1.0f, 0.8f}) {
    double total = 0;
    const int kSeqs = 4;
    for (int seed = 1; seed <= kSeqs; ++seed) {
      Sampler sampler(temperature, seed);
      absl::StatusOr<std::vector<int32_t>> seq = model_->Generate({kBosToken}, 255, &sampler);
      ASSERT_TRUE(seq.ok()) << seq.status();
      absl::StatusOr<double> nll = model_->MeanNll(*seq);
      ASSERT_TRUE(nll.ok()) << nll.status();
      total += *nll;
    }
    const double mean = total / kSeqs;
    std::printf("temperature %.1f: mean NLL %.3f nats/token (uniform: %.3f)\n", temperature, mean,
                uniform);
    EXPECT_LT(mean, 0.6 * uniform);
  }
}

TEST_F(RealModelTest, SamplingIsReproducible) {
  Sampler a(1.0f, 3), b(1.0f, 3), c(1.0f, 4);
  auto sa = model_->Generate({kBosToken}, 40, &a);
  auto sb = model_->Generate({kBosToken}, 40, &b);
  auto sc = model_->Generate({kBosToken}, 40, &c);
  ASSERT_TRUE(sa.ok() && sb.ok() && sc.ok());
  EXPECT_EQ(*sa, *sb);
  EXPECT_NE(*sa, *sc);
}

}  // namespace
}  // namespace kvc::model

// Hugging Face checkpoints: config.json rules, the safetensors loader's checks, and that a
// llama2.c model written as a Hugging Face directory (f32, bf16, f16, one file or shards) gives
// the logits of the original.
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "fidelity/hf_model_util.h"
#include "fidelity/model_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/model/checkpoint.h"
#include "kvc/model/hf_config.h"
#include "kvc/model/transformer.h"

namespace kvc::model {
namespace {

using ::kvc::testing::ConfigJson;
using ::kvc::testing::FreshDir;
using ::kvc::testing::HfShape;
using ::kvc::testing::HfTensor;
using ::kvc::testing::RandomLlamaTensors;
using ::kvc::testing::RemoveDir;
using ::kvc::testing::WriteHfDir;
using ::testing::HasSubstr;
using Json = nlohmann::json;

// SmolLM2-135M-Instruct's config.json as transformers 5 writes it.
constexpr char kSmolLm2Config[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 1,
  "dtype": "float32", "eos_token_id": 2, "head_dim": 64, "hidden_act": "silu",
  "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
  "mlp_bias": false, "model_type": "llama", "num_attention_heads": 9, "num_hidden_layers": 30,
  "num_key_value_heads": 3, "pad_token_id": 2, "pretraining_tp": 1,
  "rms_norm_eps": 9.999999747378752e-06,
  "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
  "tie_word_embeddings": true, "vocab_size": 49152})";

TEST(HfConfigTest, ReadsSmolLm2) {
  absl::StatusOr<LlamaConfig> c = ParseHuggingFaceConfig(kSmolLm2Config);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->dim, 576);
  EXPECT_EQ(c->hidden_dim, 1536);
  EXPECT_EQ(c->n_layers, 30);
  EXPECT_EQ(c->n_heads, 9);
  EXPECT_EQ(c->n_kv_heads, 3);
  EXPECT_EQ(c->head_dim(), 64);
  EXPECT_EQ(c->vocab_size, 49152);
  EXPECT_EQ(c->seq_len, 8192);
  EXPECT_TRUE(c->shared_classifier);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-5f);
  EXPECT_EQ(c->rope.theta, 100000.0);
  EXPECT_EQ(c->rope.pairs, RopePairs::kHalfSplit);
  EXPECT_EQ(c->rope.scaling, RopeScaling::kNone);
  EXPECT_EQ(c->bos_token, 1);
  absl::StatusOr<RopeParams> engine = EngineRope(*c);
  ASSERT_TRUE(engine.ok());
  EXPECT_EQ(engine->theta, 100000.0);
  EXPECT_TRUE(engine->half_split);
}

TEST(HfConfigTest, DefaultsAndTheLegacyRopeKeys) {
  Json j = ConfigJson(HfShape{});
  j.erase("head_dim");
  j.erase("num_key_value_heads");
  j.erase("rms_norm_eps");
  j.erase("rope_theta");
  j.erase("tie_word_embeddings");
  j.erase("bos_token_id");
  j.erase("max_position_embeddings");
  absl::StatusOr<LlamaConfig> c = ParseHuggingFaceConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim(), 8);  // 32 / 4
  EXPECT_EQ(c->n_kv_heads, 4);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->rope.theta, 10000.0);
  EXPECT_FALSE(c->shared_classifier);
  EXPECT_EQ(c->bos_token, -1);
  EXPECT_EQ(c->seq_len, 2048);

  j["rope_theta"] = 500000.0;
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  c = ParseHuggingFaceConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.theta, 500000.0);
  EXPECT_EQ(c->rope.scaling, RopeScaling::kLinear);
  EXPECT_EQ(c->rope.factor, 4.0);
  EXPECT_EQ(EngineRope(*c)->linear_factor, 4.0);

  j["rope_scaling"] = {{"rope_type", "llama3"},
                       {"factor", 8.0},
                       {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0},
                       {"original_max_position_embeddings", 64}};
  c = ParseHuggingFaceConfig(j.dump());
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->rope.scaling, RopeScaling::kLlama3);
  EXPECT_EQ(c->rope.original_max_positions, 64);
  EXPECT_THAT(EngineRope(*c).status().message(), HasSubstr("llama3"));
  // Low frequencies are divided by the factor, high ones kept.
  const std::vector<double> inv = RopeInverseFrequencies(c->rope, 8);
  EXPECT_DOUBLE_EQ(inv[0], 1.0);
  EXPECT_DOUBLE_EQ(inv[3], std::pow(500000.0, -6.0 / 8) / 8.0);
}

TEST(HfConfigTest, RejectsWhatTheModelCannotRun) {
  struct Case {
    const char* key;
    Json value;  // null: erase the key
    const char* message;
  };
  const Case cases[] = {
      {"model_type", "mistral", "model_type: 'mistral' is not supported"},
      {"architectures", Json::array({"GPT2LMHeadModel"}), "has no LlamaForCausalLM"},
      {"hidden_act", "gelu", "hidden_act: 'gelu' is not supported (only silu"},
      {"attention_bias", true, "attention_bias: true is not supported"},
      {"mlp_bias", true, "mlp_bias: true is not supported"},
      {"hidden_size", nullptr, "hidden_size: required key is missing"},
      {"hidden_size", "32", "hidden_size: \"32\" is not an integer"},
      {"num_hidden_layers", 0, "num_hidden_layers: 0 is outside [1,"},
      {"vocab_size", 1.5, "vocab_size: 1.5 is not an integer"},
      {"num_key_value_heads", 3, "n_heads: 4 is not a multiple of n_kv_heads 3"},
      {"head_dim", 7, "head_dim: 7 is odd"},
      {"rms_norm_eps", -1.0, "rms_norm_eps: -1 must be a positive float"},
      {"rope_theta", 0.0, "rope_theta: 0 must be positive"},
      {"tie_word_embeddings", "yes", "tie_word_embeddings: \"yes\" is not true or false"},
      {"bos_token_id", 64, "bos_token: 64 is outside [0, 64)"},
      {"rope_scaling",
       {{"rope_type", "yarn"}, {"factor", 4.0}},
       "rope_scaling.rope_type: 'yarn' is not supported (supported: default, linear, llama3)"},
      {"rope_scaling", {{"type", "dynamic"}, {"factor", 2.0}}, "'dynamic' is not supported"},
      {"rope_scaling", {{"rope_type", "linear"}}, "rope_scaling.factor: required key is missing"},
      {"rope_scaling", {{"rope_type", "linear"}, {"factor", 0.5}}, "must be a finite number >= 1"},
      {"rope_scaling",
       {{"rope_type", "llama3"}, {"factor", 8.0}},
       "rope_scaling.low_freq_factor: required key is missing"},
      {"rope_scaling", "linear", "rope_scaling: is not an object or null"},
      {"rope_parameters",
       {{"rope_type", "longrope"}, {"rope_theta", 1e4}},
       "rope_parameters.rope_type: 'longrope' is not supported"},
      {"rope_parameters",
       {{"full_attention", {{"rope_type", "default"}}}},
       "per-layer-type RoPE parameters are not supported"},
      {"partial_rotary_factor", 0.5, "partial_rotary_factor: 0.5 is not supported"},
      {"quantization_config", {{"quant_method", "gguf"}}, "quantized checkpoints"},
  };
  for (const Case& c : cases) {
    Json j = ConfigJson(HfShape{});
    if (c.value.is_null()) {
      j.erase(c.key);
    } else {
      j[c.key] = c.value;
    }
    absl::Status s = ParseHuggingFaceConfig(j.dump()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.key;
  }
  EXPECT_THAT(ParseHuggingFaceConfig("{not json").status().message(), HasSubstr("not valid JSON"));
  EXPECT_THAT(ParseHuggingFaceConfig("[1, 2]").status().message(), HasSubstr("not a JSON object"));
  Json anonymous = ConfigJson(HfShape{});
  anonymous.erase("model_type");
  anonymous.erase("architectures");
  EXPECT_THAT(ParseHuggingFaceConfig(anonymous.dump()).status().message(),
              HasSubstr("cannot tell that this is a Llama"));
}

TEST(HfConfigTest, IndexRules) {
  auto map = ParseSafetensorsIndex(R"({"weight_map": {"a": "x.safetensors"}})", "idx");
  ASSERT_TRUE(map.ok());
  EXPECT_EQ(map->at("a"), "x.safetensors");
  EXPECT_THAT(ParseSafetensorsIndex("{}", "idx").status().message(),
              HasSubstr("no \"weight_map\""));
  EXPECT_THAT(ParseSafetensorsIndex(R"({"weight_map": {"a": "../x"}})", "idx").status().message(),
              HasSubstr("not a plain file name"));
  EXPECT_THAT(ParseSafetensorsIndex(R"({"weight_map": {"a": 3}})", "idx").status().message(),
              HasSubstr("is not a file name"));
  EXPECT_THAT(ParseSafetensorsIndex("nope", "idx").status().message(),
              HasSubstr("idx: not a JSON"));
}

class HfDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = FreshDir(::testing::UnitTest::GetInstance()->current_test_info()->name());
  }
  void TearDown() override { RemoveDir(dir_); }
  absl::Status Load() { return Checkpoint::LoadHuggingFace(dir_).status(); }
  std::string dir_;
};

TEST_F(HfDirTest, MissingFilesAreNotFound) {
  EXPECT_EQ(Load().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Load().message(), HasSubstr("config.json"));
  ASSERT_TRUE(kvc::testing::WriteText(dir_ + "/config.json", ConfigJson(HfShape{}).dump()).ok());
  EXPECT_EQ(Load().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Load().message(), HasSubstr("neither model.safetensors nor"));
  ASSERT_TRUE(kvc::testing::WriteText(dir_ + "/model.safetensors.index.json",
                                      R"({"weight_map": {"a": "gone.safetensors"}})")
                  .ok());
  EXPECT_EQ(Load().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(Load().message(), HasSubstr("shard 'gone.safetensors'"));
}

TEST_F(HfDirTest, NamesTheMissingTensor) {
  HfShape shape;
  std::vector<HfTensor> t = RandomLlamaTensors(shape, 1, false);
  t.erase(t.begin() + 3);  // model.layers.0.self_attn.k_proj.weight
  ASSERT_TRUE(WriteHfDir(dir_, ConfigJson(shape), t, StDType::kF32).ok());
  EXPECT_THAT(Load().message(),
              HasSubstr("missing tensor model.layers.0.self_attn.k_proj.weight (shape [16, 32])"));
}

TEST_F(HfDirTest, UntiedNeedsLmHead) {
  HfShape shape;
  shape.tied = false;
  ASSERT_TRUE(
      WriteHfDir(dir_, ConfigJson(shape), RandomLlamaTensors(shape, 1, false), StDType::kF32).ok());
  EXPECT_THAT(Load().message(),
              HasSubstr("missing tensor lm_head.weight (shape [64, 32]); tie_word_embeddings is "
                        "false"));
}

TEST_F(HfDirTest, ShapeMismatchGivesBothShapes) {
  HfShape shape;
  Json config = ConfigJson(shape);
  config["num_key_value_heads"] = 1;  // the files have 2 KV heads
  ASSERT_TRUE(WriteHfDir(dir_, config, RandomLlamaTensors(shape, 1, false), StDType::kF32).ok());
  EXPECT_THAT(Load().message(), HasSubstr("tensor model.layers.0.self_attn.k_proj.weight: shape "
                                          "[16, 32], expected [8, 32]"));
}

TEST_F(HfDirTest, RejectsBiasesUnknownTensorsAndIntegerWeights) {
  HfShape shape;
  std::vector<HfTensor> t = RandomLlamaTensors(shape, 1, false);
  t.push_back({"model.layers.0.self_attn.q_proj.bias", {32}, std::vector<float>(32)});
  ASSERT_TRUE(WriteHfDir(dir_, ConfigJson(shape), t, StDType::kF32).ok());
  EXPECT_THAT(Load().message(), HasSubstr("q_proj.bias: biases are not supported"));

  t.back() = {"model.layers.2.input_layernorm.weight", {32}, std::vector<float>(32)};
  ASSERT_TRUE(WriteHfDir(dir_, ConfigJson(shape), t, StDType::kF32).ok());
  EXPECT_THAT(Load().message(),
              HasSubstr("layers.2.input_layernorm.weight: not part of a 2-layer"));

  t.pop_back();
  t.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", {4}, std::vector<float>(4)});
  ASSERT_TRUE(WriteHfDir(dir_, ConfigJson(shape), t, StDType::kF32).ok());
  EXPECT_TRUE(Load().ok()) << Load();  // old checkpoints' RoPE cache is ignored

  StFile f;  // model.norm.weight as I32 (WriteHfDir converts floats only)
  for (const HfTensor& h : t) {
    StTensor st{h.name, StDType::kF32, h.shape, {}};
    st.data.resize(h.values.size() * 4);
    if (h.name == "model.norm.weight") st.dtype = StDType::kI32;
    f.tensors.push_back(std::move(st));
  }
  ASSERT_TRUE(WriteSafetensors(dir_ + "/model.safetensors", f).ok());
  EXPECT_THAT(Load().message(),
              HasSubstr("model.norm.weight: dtype I32 is not a float type (F32, BF16 or F16)"));
}

TEST_F(HfDirTest, RejectsAConfigLargerThanItsFiles) {
  HfShape shape;
  Json config = ConfigJson(shape);
  config["num_hidden_layers"] = 1 << 20;
  ASSERT_TRUE(WriteHfDir(dir_, config, RandomLlamaTensors(shape, 1, false), StDType::kF32).ok());
  EXPECT_THAT(Load().message(), HasSubstr("more than the"));
  config["num_hidden_layers"] = 2;
  config["hidden_size"] = 1 << 30;
  config["head_dim"] = 2;
  config["vocab_size"] = 1 << 30;
  ASSERT_TRUE(kvc::testing::WriteText(dir_ + "/config.json", config.dump()).ok());
  EXPECT_EQ(Load().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(HfDirTest, ShardRules) {
  HfShape shape;
  const std::vector<HfTensor> t = RandomLlamaTensors(shape, 1, false);
  ASSERT_TRUE(WriteHfDir(dir_, ConfigJson(shape), t, StDType::kBF16, 3).ok());
  ASSERT_TRUE(Load().ok()) << Load();
  // The index must say where each tensor is.
  Json index = {{"weight_map", Json::object()}};
  for (size_t i = 0; i < t.size(); ++i) {
    index["weight_map"][t[i].name] =
        absl::StrCat("model-0000", (i + 1) % 3 + 1, "-of-00003.safetensors");
  }
  ASSERT_TRUE(kvc::testing::WriteText(dir_ + "/model.safetensors.index.json", index.dump()).ok());
  EXPECT_THAT(Load().message(), HasSubstr("model.safetensors.index.json places it in"));
  // A tensor in two shards (t[1] is in shard 2, its copy at index 20 in shard 1): the index maps
  // the name to one of them, the copy in the other is refused.
  std::vector<HfTensor> twice = t;
  twice.push_back(t[1]);
  ASSERT_TRUE(WriteHfDir(dir_, ConfigJson(shape), twice, StDType::kF32, 2).ok());
  EXPECT_THAT(Load().message(), HasSubstr("model.layers.0.input_layernorm.weight: "
                                          "model.safetensors.index.json places it in"));
}

// The same weights in f32, bf16 and f16 (values that all three hold exactly), one file or shards,
// load to the same fp32 weights: identical logits.
TEST_F(HfDirTest, DtypesAndShardsGiveIdenticalLogits) {
  HfShape shape;
  shape.tied = false;
  const std::vector<HfTensor> t = RandomLlamaTensors(shape, 5, true);
  const std::vector<int32_t> tokens = {1, 5, 9, 63, 0, 7, 7, 2, 30, 11};
  std::vector<float> first;
  for (StDType dtype : {StDType::kF32, StDType::kBF16, StDType::kF16}) {
    for (int shards : {1, 2}) {
      RemoveDir(dir_);
      dir_ = FreshDir("dtypes");
      ASSERT_TRUE(WriteHfDir(dir_, ConfigJson(shape), t, dtype, shards).ok());
      absl::StatusOr<Transformer> model = Transformer::Load(dir_);
      ASSERT_TRUE(model.ok()) << model.status();
      absl::StatusOr<ForwardOutput> fwd = model->Forward(tokens);
      ASSERT_TRUE(fwd.ok());
      if (first.empty()) {
        first = fwd->logits;
      } else {
        EXPECT_EQ(fwd->logits, first) << StDTypeName(dtype) << " x" << shards;
      }
    }
  }
}

// stories260K (llama2.c) rewritten as a Hugging Face directory (wq/wk rows permuted to half-split
// pairs) is the same model.
TEST(HfEquivalenceTest, Llama2cAsHuggingFaceGivesTheSameLogits) {
  KVC_REQUIRE_MODEL(path);
  absl::StatusOr<Checkpoint> ck = Checkpoint::LoadLlama2c(path);
  ASSERT_TRUE(ck.ok()) << ck.status();
  const LlamaConfig& c = ck->config();
  HfShape shape{c.dim, c.hidden_dim, c.n_layers, c.n_heads,          c.n_kv_heads,
                0,     c.vocab_size, c.seq_len,  c.shared_classifier};
  Json config = ConfigJson(shape);
  config["rms_norm_eps"] = 1e-5;
  const std::string dir = FreshDir("stories");
  ASSERT_TRUE(
      WriteHfDir(dir, config, kvc::testing::TensorsFromLlama2c(*ck), StDType::kF32, 2).ok());
  absl::StatusOr<Transformer> hf = Transformer::Load(dir);
  RemoveDir(dir);
  ASSERT_TRUE(hf.ok()) << hf.status();
  EXPECT_EQ(hf->rope_pairs(), RopePairs::kHalfSplit);
  Transformer original(*std::move(ck));
  Sampler sampler(1.0f, 11);
  absl::StatusOr<std::vector<int32_t>> seq = original.Generate({kBosToken}, 150, &sampler);
  ASSERT_TRUE(seq.ok());
  absl::StatusOr<ForwardOutput> a = original.Forward(*seq);
  absl::StatusOr<ForwardOutput> b = hf->Forward(*seq);
  ASSERT_TRUE(a.ok() && b.ok());
  double max_diff = 0, scale = 0;
  for (size_t i = 0; i < a->logits.size(); ++i) {
    max_diff = std::max(max_diff, std::fabs(double{a->logits[i]} - b->logits[i]));
    scale = std::max(scale, std::fabs(double{a->logits[i]}));
  }
  std::printf("llama2.c vs its Hugging Face form: max |logit diff| %.3g (max |logit| %.3g)\n",
              max_diff, scale);
  EXPECT_LT(max_diff, 1e-4 * scale);
}

}  // namespace
}  // namespace kvc::model

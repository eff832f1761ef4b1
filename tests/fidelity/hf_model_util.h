// Writing Hugging Face Llama checkpoint directories for tests: config.json and safetensors (one
// file or shards with an index), from random weights or from a llama2.c checkpoint.
#ifndef KVC_TESTS_FIDELITY_HF_MODEL_UTIL_H_
#define KVC_TESTS_FIDELITY_HF_MODEL_UTIL_H_

#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvc/convert.h"
#include "kvc/model/checkpoint.h"
#include "kvc/safetensors.h"
#include "nlohmann/json.hpp"

namespace kvc::testing {

struct HfTensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> values;
};

// The sizes of a small Llama, as config.json spells them.
struct HfShape {
  int hidden = 32;
  int intermediate = 48;
  int layers = 2;
  int heads = 4;
  int kv_heads = 2;
  int head_dim = 8;  // written as "head_dim"; hidden / heads when 0 (key omitted)
  int vocab = 64;
  int max_positions = 128;
  bool tied = true;
};

inline nlohmann::json ConfigJson(const HfShape& s) {
  nlohmann::json j = {{"architectures", {"LlamaForCausalLM"}},
                      {"model_type", "llama"},
                      {"hidden_size", s.hidden},
                      {"intermediate_size", s.intermediate},
                      {"num_hidden_layers", s.layers},
                      {"num_attention_heads", s.heads},
                      {"num_key_value_heads", s.kv_heads},
                      {"vocab_size", s.vocab},
                      {"max_position_embeddings", s.max_positions},
                      {"rms_norm_eps", 1e-5},
                      {"rope_theta", 10000.0},
                      {"hidden_act", "silu"},
                      {"attention_bias", false},
                      {"tie_word_embeddings", s.tied},
                      {"bos_token_id", 1}};
  if (s.head_dim > 0) j["head_dim"] = s.head_dim;
  return j;
}

// Deterministic values that bf16 and f16 hold exactly: multiples of 2^-8 in [-scale, scale].
inline std::vector<float> GridValues(size_t n, uint64_t seed, float scale) {
  std::vector<float> v(n);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  const int steps = static_cast<int>(scale * 256);
  for (float& f : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    f = static_cast<float>(static_cast<int>(x % (2 * steps + 1)) - steps) / 256.0f;
  }
  return v;
}

// Every tensor of a LlamaForCausalLM of shape `s` (lm_head too when `with_lm_head`), random.
// RMSNorm weights are near 1.
inline std::vector<HfTensor> RandomLlamaTensors(const HfShape& s, uint64_t seed,
                                                bool with_lm_head) {
  const int64_t h = s.hidden, hd = s.head_dim > 0 ? s.head_dim : s.hidden / s.heads;
  const int64_t q = hd * s.heads, kv = hd * s.kv_heads, f = s.intermediate, v = s.vocab;
  std::vector<HfTensor> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, float scale, float offset = 0) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    std::vector<float> values = GridValues(n, seed + out.size() * 7919, scale);
    // 1 + k/64 has 7 significant bits: bf16 holds it exactly.
    if (offset != 0) {
      for (float& x : values) x = offset + std::round(x * 64) / 64;
    }
    out.push_back({std::move(name), std::move(shape), std::move(values)});
  };
  add("model.embed_tokens.weight", {v, h}, 1.0f);
  for (int l = 0; l < s.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {h}, 0.25f, 1.0f);
    add(p + "self_attn.q_proj.weight", {q, h}, 0.5f);
    add(p + "self_attn.k_proj.weight", {kv, h}, 0.5f);
    add(p + "self_attn.v_proj.weight", {kv, h}, 0.5f);
    add(p + "self_attn.o_proj.weight", {h, q}, 0.25f);
    add(p + "post_attention_layernorm.weight", {h}, 0.25f, 1.0f);
    add(p + "mlp.gate_proj.weight", {f, h}, 0.25f);
    add(p + "mlp.up_proj.weight", {f, h}, 0.25f);
    add(p + "mlp.down_proj.weight", {h, f}, 0.25f);
  }
  add("model.norm.weight", {h}, 0.25f, 1.0f);
  if (with_lm_head) add("lm_head.weight", {v, h}, 0.5f);
  return out;
}

// The llama2.c checkpoint's weights under Hugging Face names, with wq/wk rows permuted from
// interleaved RoPE pairs (2i, 2i+1) to half-split (i, i + head_dim/2).
inline std::vector<HfTensor> TensorsFromLlama2c(const model::Checkpoint& ck) {
  const model::LlamaConfig& c = ck.config();
  const int64_t h = c.dim, hd = c.head_dim(), q = c.q_dim(), kv = c.kv_dim(), f = c.hidden_dim;
  std::vector<HfTensor> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, const float* src) {
    size_t n = 1;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    out.push_back({std::move(name), std::move(shape), std::vector<float>(src, src + n)});
  };
  auto permuted = [&](std::string name, int64_t rows, const float* src) {
    HfTensor t{std::move(name), {rows, h}, std::vector<float>(static_cast<size_t>(rows * h))};
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t head = r / hd, j = r % hd, half = hd / 2;
      const int64_t from = head * hd + (j < half ? 2 * j : 2 * (j - half) + 1);
      std::copy(src + from * h, src + (from + 1) * h, t.values.begin() + r * h);
    }
    out.push_back(std::move(t));
  };
  add("model.embed_tokens.weight", {c.vocab_size, h}, ck.token_embedding());
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {h}, ck.attn_norm(l));
    permuted(p + "self_attn.q_proj.weight", q, ck.wq(l));
    permuted(p + "self_attn.k_proj.weight", kv, ck.wk(l));
    add(p + "self_attn.v_proj.weight", {kv, h}, ck.wv(l));
    add(p + "self_attn.o_proj.weight", {h, q}, ck.wo(l));
    add(p + "post_attention_layernorm.weight", {h}, ck.ffn_norm(l));
    add(p + "mlp.gate_proj.weight", {f, h}, ck.w1(l));
    add(p + "mlp.up_proj.weight", {f, h}, ck.w3(l));
    add(p + "mlp.down_proj.weight", {h, f}, ck.w2(l));
  }
  add("model.norm.weight", {h}, ck.final_norm());
  if (!c.shared_classifier) add("lm_head.weight", {c.vocab_size, h}, ck.classifier());
  return out;
}

// A fresh empty directory under the test's temporary directory.
inline std::string FreshDir(const std::string& name) {
  const std::string dir = absl::StrCat(::testing::TempDir(), "kvc_hf_", name, "_", ::getpid());
  std::string cmd = absl::StrCat("rm -rf '", dir, "'");
  if (std::system(cmd.c_str()) != 0) return "";
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

inline void RemoveDir(const std::string& dir) {
  const std::string cmd = absl::StrCat("rm -rf '", dir, "'");
  if (std::system(cmd.c_str()) != 0) std::fprintf(stderr, "cannot remove %s\n", dir.c_str());
}

inline absl::Status WriteText(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  return out ? absl::OkStatus() : absl::InternalError(absl::StrCat("cannot write ", path));
}

// Writes config.json and the tensors (converted to `dtype`) into `dir`: model.safetensors when
// shards == 1, else model-0000i-of-0000n.safetensors (tensors dealt round-robin) and
// model.safetensors.index.json.
inline absl::Status WriteHfDir(const std::string& dir, const nlohmann::json& config,
                               const std::vector<HfTensor>& tensors, StDType dtype,
                               int shards = 1) {
  absl::Status s = WriteText(absl::StrCat(dir, "/config.json"), config.dump(2));
  if (!s.ok()) return s;
  std::vector<StFile> files(shards);
  nlohmann::json index = {{"metadata", {{"total_size", 0}}},
                          {"weight_map", nlohmann::json::object()}};
  for (size_t i = 0; i < tensors.size(); ++i) {
    const HfTensor& t = tensors[i];
    StTensor st;
    st.name = t.name;
    st.dtype = dtype;
    st.shape = t.shape;
    st.data.resize(t.values.size() * StDTypeSize(dtype));
    absl::StatusOr<DType> dt = ToDType(dtype);
    if (!dt.ok()) return dt.status();
    FromFloat(t.values.data(), *dt, t.values.size(), st.data.data());
    const int shard = static_cast<int>(i % shards);
    files[shard].tensors.push_back(std::move(st));
    index["weight_map"][t.name] =
        absl::StrCat("model-0000", shard + 1, "-of-0000", shards, ".safetensors");
  }
  if (shards == 1) return WriteSafetensors(absl::StrCat(dir, "/model.safetensors"), files[0]);
  for (int i = 0; i < shards; ++i) {
    s = WriteSafetensors(
        absl::StrCat(dir, "/model-0000", i + 1, "-of-0000", shards, ".safetensors"), files[i]);
    if (!s.ok()) return s;
  }
  return WriteText(absl::StrCat(dir, "/model.safetensors.index.json"), index.dump(2));
}

}  // namespace kvc::testing

#endif  // KVC_TESTS_FIDELITY_HF_MODEL_UTIL_H_

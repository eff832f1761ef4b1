#include "kvc/model/hf_config.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kvc/status_macros.h"
#include "nlohmann/json.hpp"

namespace kvc::model {
namespace {

using Json = nlohmann::json;

absl::Status Bad(absl::string_view key, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(key, ": ", problem));
}

// An integer key in [min, INT32_MAX]; `fallback` when absent or null and fallback is set.
absl::StatusOr<int> GetInt(const Json& j, const char* key, std::optional<int> fallback,
                           int64_t min = 1) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return Bad(key, "required key is missing");
  }
  if (!it->is_number_integer()) return Bad(key, absl::StrCat(it->dump(), " is not an integer"));
  const int64_t v =
      it->is_number_unsigned() && it->get<uint64_t>() > INT64_MAX ? INT64_MAX : it->get<int64_t>();
  if (v < min || v > std::numeric_limits<int32_t>::max()) {
    return Bad(
        key, absl::StrCat(v, " is outside [", min, ", ", std::numeric_limits<int32_t>::max(), "]"));
  }
  return static_cast<int>(v);
}

absl::StatusOr<double> GetNumber(const Json& j, const char* key, std::optional<double> fallback,
                                 absl::string_view where = "") {
  const std::string name = where.empty() ? std::string(key) : absl::StrCat(where, ".", key);
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return Bad(name, "required key is missing");
  }
  if (!it->is_number()) return Bad(name, absl::StrCat(it->dump(), " is not a number"));
  const double v = it->get<double>();
  if (!std::isfinite(v)) return Bad(name, "is not finite");
  return v;
}

absl::StatusOr<bool> GetBool(const Json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return Bad(key, absl::StrCat(it->dump(), " is not true or false"));
  return it->get<bool>();
}

absl::StatusOr<std::string> GetString(const Json& j, const char* key,
                                      absl::string_view where = "") {
  const std::string name = where.empty() ? std::string(key) : absl::StrCat(where, ".", key);
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::string();
  if (!it->is_string()) return Bad(name, absl::StrCat(it->dump(), " is not a string"));
  return it->get<std::string>();
}

absl::Status CheckArchitecture(const Json& j) {
  ASSIGN_OR_RETURN(const std::string model_type, GetString(j, "model_type"));
  bool llama_arch = false;
  auto arch = j.find("architectures");
  const bool has_arch = arch != j.end() && !arch->is_null();
  if (has_arch) {
    if (!arch->is_array()) return Bad("architectures", "is not a list");
    for (const Json& a : *arch) {
      if (a.is_string() && a.get<std::string>() == "LlamaForCausalLM") llama_arch = true;
    }
    if (!llama_arch) {
      return Bad("architectures", absl::StrCat(arch->dump(),
                                               " has no LlamaForCausalLM (only "
                                               "Llama checkpoints are supported)"));
    }
  }
  if (!model_type.empty() && model_type != "llama") {
    return Bad("model_type",
               absl::StrCat("'", model_type, "' is not supported (only \"llama\" checkpoints)"));
  }
  if (model_type.empty() && !has_arch) {
    return Bad("model_type", "missing, and no architectures: cannot tell that this is a Llama");
  }
  ASSIGN_OR_RETURN(std::string act, GetString(j, "hidden_act"));
  if (act.empty()) act = "silu";
  if (act != "silu") {
    return Bad("hidden_act", absl::StrCat("'", act, "' is not supported (only silu: SwiGLU)"));
  }
  for (const char* key : {"attention_bias", "mlp_bias"}) {
    ASSIGN_OR_RETURN(const bool bias, GetBool(j, key, false));
    if (bias) return Bad(key, "true is not supported (projections without bias only)");
  }
  if (j.contains("quantization_config") && !j["quantization_config"].is_null()) {
    return Bad("quantization_config",
               "quantized checkpoints are not supported (save the model unquantized)");
  }
  return absl::OkStatus();
}

// The RoPE: transformers 5 writes rope_parameters {rope_theta, rope_type, ...}; earlier versions
// rope_theta beside rope_scaling {rope_type (or type), factor, ...} or null.
absl::Status ParseRope(const Json& j, RopeConfig* rope) {
  rope->pairs = RopePairs::kHalfSplit;
  const Json* params = nullptr;
  std::string where;
  auto rp = j.find("rope_parameters");
  if (rp != j.end() && !rp->is_null()) {
    if (!rp->is_object()) return Bad("rope_parameters", "is not an object");
    if (!rp->contains("rope_type") && !rp->contains("rope_theta") && !rp->empty() &&
        rp->begin()->is_object()) {
      return Bad("rope_parameters", "per-layer-type RoPE parameters are not supported");
    }
    params = &*rp;
    where = "rope_parameters";
    ASSIGN_OR_RETURN(const double top, GetNumber(j, "rope_theta", 10000.0));
    ASSIGN_OR_RETURN(rope->theta, GetNumber(*params, "rope_theta", top, where));
  } else {
    ASSIGN_OR_RETURN(rope->theta, GetNumber(j, "rope_theta", 10000.0));
    auto rs = j.find("rope_scaling");
    if (rs != j.end() && !rs->is_null()) {
      if (!rs->is_object()) return Bad("rope_scaling", "is not an object or null");
      params = &*rs;
      where = "rope_scaling";
    }
  }
  if (!(rope->theta > 0)) return Bad("rope_theta", absl::StrCat(rope->theta, " must be positive"));
  for (const Json* holder : {&j, params}) {
    if (holder == nullptr) continue;
    ASSIGN_OR_RETURN(const double partial, GetNumber(*holder, "partial_rotary_factor", 1.0));
    if (partial != 1.0) {
      return Bad("partial_rotary_factor", absl::StrCat(partial, " is not supported (only 1)"));
    }
  }
  if (params == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(std::string type, GetString(*params, "rope_type", where));
  if (type.empty()) {
    ASSIGN_OR_RETURN(type, GetString(*params, "type", where));
  }
  if (type.empty() || type == "default") return absl::OkStatus();
  if (type == "linear") {
    rope->scaling = RopeScaling::kLinear;
    ASSIGN_OR_RETURN(rope->factor, GetNumber(*params, "factor", std::nullopt, where));
  } else if (type == "llama3") {
    rope->scaling = RopeScaling::kLlama3;
    ASSIGN_OR_RETURN(rope->factor, GetNumber(*params, "factor", std::nullopt, where));
    ASSIGN_OR_RETURN(rope->low_freq_factor,
                     GetNumber(*params, "low_freq_factor", std::nullopt, where));
    ASSIGN_OR_RETURN(rope->high_freq_factor,
                     GetNumber(*params, "high_freq_factor", std::nullopt, where));
    absl::StatusOr<int> original =
        GetInt(*params, "original_max_position_embeddings", std::nullopt);
    if (!original.ok()) return Bad(where, original.status().message());
    rope->original_max_positions = *original;
  } else {
    return Bad(absl::StrCat(where, ".rope_type"),
               absl::StrCat("'", type, "' is not supported (supported: default, linear, llama3)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<LlamaConfig> ParseHuggingFaceConfig(std::string_view json_text) {
  const Json j =
      Json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError("not valid JSON");
  if (!j.is_object()) return absl::InvalidArgumentError("not a JSON object");
  RETURN_IF_ERROR(CheckArchitecture(j));
  LlamaConfig c;
  ASSIGN_OR_RETURN(c.dim, GetInt(j, "hidden_size", std::nullopt));
  ASSIGN_OR_RETURN(c.hidden_dim, GetInt(j, "intermediate_size", std::nullopt));
  ASSIGN_OR_RETURN(c.n_layers, GetInt(j, "num_hidden_layers", std::nullopt));
  ASSIGN_OR_RETURN(c.n_heads, GetInt(j, "num_attention_heads", std::nullopt));
  ASSIGN_OR_RETURN(c.n_kv_heads, GetInt(j, "num_key_value_heads", c.n_heads));
  ASSIGN_OR_RETURN(c.vocab_size, GetInt(j, "vocab_size", std::nullopt));
  ASSIGN_OR_RETURN(c.seq_len, GetInt(j, "max_position_embeddings", 2048));
  ASSIGN_OR_RETURN(c.explicit_head_dim, GetInt(j, "head_dim", 0, 0));
  if (c.explicit_head_dim == 0 && c.dim % c.n_heads != 0) {
    return Bad("hidden_size", absl::StrCat(c.dim, " is not divisible by num_attention_heads ",
                                           c.n_heads, " and head_dim is not given"));
  }
  ASSIGN_OR_RETURN(const double eps, GetNumber(j, "rms_norm_eps", 1e-6));
  if (!(eps > 0) || eps > std::numeric_limits<float>::max()) {
    return Bad("rms_norm_eps", absl::StrCat(eps, " must be a positive float"));
  }
  c.rms_norm_eps = static_cast<float>(eps);
  ASSIGN_OR_RETURN(const bool tied, GetBool(j, "tie_word_embeddings", false));
  c.shared_classifier = tied;
  ASSIGN_OR_RETURN(c.bos_token, GetInt(j, "bos_token_id", -1, 0));
  RETURN_IF_ERROR(ParseRope(j, &c.rope));
  if (absl::Status s = ValidateConfig(c); !s.ok()) {
    // Name the config.json keys behind the model's field names.
    return absl::InvalidArgumentError(absl::StrCat(
        s.message(),
        " (from hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, "
        "num_key_value_heads, vocab_size, max_position_embeddings, head_dim, bos_token_id)"));
  }
  return c;
}

absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(std::string_view json_text,
                                                                         const std::string& where) {
  const Json j = Json::parse(json_text.begin(), json_text.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
  }
  auto map = j.find("weight_map");
  if (map == j.end() || !map->is_object() || map->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": no \"weight_map\" object naming each tensor's shard"));
  }
  std::map<std::string, std::string> out;
  for (auto it = map->begin(); it != map->end(); ++it) {
    if (!it.value().is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, ": weight_map[\"", it.key(), "\"]: ", it.value().dump(), " is not a file name"));
    }
    const std::string file = it.value().get<std::string>();
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": weight_map[\"", it.key(), "\"]: '", file,
                       "' is not a plain file name in the checkpoint directory"));
    }
    out[it.key()] = file;
  }
  return out;
}

}  // namespace kvc::model

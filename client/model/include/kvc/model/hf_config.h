// The JSON files of a Hugging Face Llama checkpoint: config.json and
// model.safetensors.index.json. Checkpoint::LoadHuggingFace (kvc/model/checkpoint.h) uses these;
// they are separate so that each rule can be tested without writing weights. Pure functions,
// thread-safe.
#ifndef KVC_MODEL_HF_CONFIG_H_
#define KVC_MODEL_HF_CONFIG_H_

#include <map>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "kvc/model/checkpoint.h"

namespace kvc::model {

// The model config of a LlamaForCausalLM config.json (keys and defaults: Checkpoint::
// LoadHuggingFace). The result passes ValidateConfig and has half-split RoPE pairs.
// INVALID_ARGUMENT naming the key: not JSON or not an object; a required key missing; a key of
// the wrong JSON type, out of range, or with a value that is not supported: model_type other
// than "llama", architectures without "LlamaForCausalLM", hidden_act other than "silu",
// attention_bias or mlp_bias true, rope type other than default/linear/llama3 (e.g. "dynamic",
// "yarn"), partial_rotary_factor != 1, quantization_config present.
absl::StatusOr<LlamaConfig> ParseHuggingFaceConfig(std::string_view json_text);

// model.safetensors.index.json's "weight_map": tensor name -> shard file name. INVALID_ARGUMENT
// (message starting with `where`) when it is not JSON, has no weight_map object, maps a name to a
// non-string, or names a shard that is not a plain file name (empty, ".", "..", or with '/').
absl::StatusOr<std::map<std::string, std::string>> ParseSafetensorsIndex(std::string_view json_text,
                                                                         const std::string& where);

}  // namespace kvc::model

#endif  // KVC_MODEL_HF_CONFIG_H_

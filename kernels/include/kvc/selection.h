// The CPU engine's stages, exposed for tests, benchmarks and the CUDA backend's reference checks.
// A Backend (kvc/backend.h) composes them: SelectTokens -> SelectChannels -> PackLayer.
// All functions are thread-compatible and allocate their outputs; inputs are host memory.
#ifndef KVC_SELECTION_H_
#define KVC_SELECTION_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

struct TokenSelection {
  int num_kv_heads = 0;
  int budget = 0;  // kept tokens per head (the same for every head)
  // [num_kv_heads, budget] original prompt positions, strictly ascending per head. With
  // Granularity::kPerLayer every head holds the same set.
  std::vector<int32_t> positions;
};

struct ChannelSelection {
  int key_channels = 0;    // T_k (== D when keys are not pruned)
  int value_channels = 0;  // T_v (== D when values are not pruned)
  std::vector<int32_t> key_idx;    // [num_kv_heads, T_k], strictly ascending per head
  std::vector<int32_t> value_idx;  // [num_kv_heads, T_v], strictly ascending per head
};

// Per-token importance used by the eviction policy: [num_kv_heads, S] (group-aggregated over the
// query heads of each KV head), higher = more important. For streaming/none every score is 0;
// knorm returns -||k||_2; random returns seeded uniform noise. Sinks, recent windows and pooling
// are applied by SelectTokens, not here, except snapkv pooling, which is part of its score.
absl::StatusOr<std::vector<float>> ScoreTokens(const LayerInput& in, const EvictionSpec& spec);

// Kept positions per KV head: protected tokens (sinks / recent / observation window) first, then
// the highest scores (ties broken by the lower position), sorted ascending.
absl::StatusOr<TokenSelection> SelectTokens(const LayerInput& in, const CompressionSpec& spec);

// Channel selection on the kept tokens that will be pruned (all but the most recent r).
absl::StatusOr<ChannelSelection> SelectChannels(const LayerInput& in, const TokenSelection& tokens,
                                                const CompressionSpec& spec);

}  // namespace kvc

#endif  // KVC_SELECTION_H_

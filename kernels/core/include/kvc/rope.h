// The rotary position embedding (RoPE) of a model, as the engine needs it to move keys (the
// contiguous export) and queries (expected attention) between positions.
//
// Thread-safety: pure functions.
#ifndef KVC_ROPE_H_
#define KVC_ROPE_H_

#include "absl/status/status.h"

namespace kvc {

// The rotary embedding the keys were stored with: channel pair p (p < rotary_dims / 2) turns by
// angle (position / linear_factor) * theta^(-2p / rotary_dims). Pairs are (2p, 2p + 1) when
// interleaved (llama2.c, GPT-J), (p, p + rotary_dims / 2) when half-split (Hugging Face Llama,
// GPT-NeoX). Channels past rotary_dims are not rotated.
struct RopeParams {
  double theta = 10000.0;
  int rotary_dims = 0;  // 0 = head_dim
  bool half_split = false;
  double linear_factor = 1.0;
};

// INVALID_ARGUMENT naming the field: theta <= 0 or not finite, rotary_dims odd, negative or above
// head_dim, linear_factor < 1 or not finite.
absl::Status ValidateRope(const RopeParams& rope, int head_dim);

// Channel indices of rotary pair p: (2p, 2p + 1) interleaved, (p, p + rotary_dims / 2) half-split.
inline int RopePairFirst(const RopeParams& r, int rotary_dims, int p) {
  return r.half_split ? p : 2 * p;
}
inline int RopePairSecond(const RopeParams& r, int rotary_dims, int p) {
  return r.half_split ? p + rotary_dims / 2 : 2 * p + 1;
}

// Rotates a float vector x[head_dim] in place by `position` (negative turns back), in double.
// rope must be valid for head_dim.
void RotateVector(const RopeParams& rope, int head_dim, double position, float* x);

}  // namespace kvc

#endif  // KVC_ROPE_H_

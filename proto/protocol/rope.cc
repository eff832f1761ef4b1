#include "server/contiguous.h"

#include "absl/strings/str_cat.h"

namespace kvc::server {

namespace pb = kvcache::v1;

absl::StatusOr<RopeParams> RopeFromProto(const pb::RopeSpec& rope, int head_dim) {
  RopeParams p;
  p.theta = rope.theta();
  p.rotary_dims = static_cast<int>(rope.rotary_dims());
  switch (rope.style()) {
    case pb::ROPE_INTERLEAVED:
      p.half_split = false;
      break;
    case pb::ROPE_HALF_SPLIT:
      p.half_split = true;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("rope.style: ", static_cast<int>(rope.style()),
                       " is not ROPE_INTERLEAVED or ROPE_HALF_SPLIT (FORMAT_DENSE_CONTIGUOUS "
                       "needs the RoPE the keys were stored with)"));
  }
  switch (rope.scaling()) {
    case pb::ROPE_SCALING_UNSPECIFIED:
    case pb::ROPE_SCALING_NONE:
      break;
    case pb::ROPE_SCALING_LINEAR:
      p.linear_factor = rope.scaling_factor();
      break;
    case pb::ROPE_SCALING_DYNAMIC_NTK:
      return absl::FailedPreconditionError(
          "rope.scaling: DYNAMIC_NTK rescales the frequencies by the sequence length, so keys "
          "stored at one length cannot be moved to another exactly; fetch FORMAT_DENSE");
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("rope.scaling: ", static_cast<int>(rope.scaling()),
                       " is not NONE, LINEAR or "
                       "DYNAMIC_NTK"));
  }
  if (absl::Status s = ValidateRope(p, head_dim); !s.ok()) return s;
  return p;
}

absl::Status CheckUniformKept(const pb::CacheInfo& info) {
  if (info.compression().eviction().adaptive()) {
    return absl::FailedPreconditionError(
        "FORMAT_DENSE_CONTIGUOUS: the cache was stored with head-adaptive budgets, so its KV "
        "heads keep different counts; a stock engine needs one count for every head (fetch "
        "FORMAT_DENSE, padded with position -1, or FORMAT_PACKED)");
  }
  for (int l = 1; l < info.kept_tokens_size(); ++l) {
    if (info.kept_tokens(l) != info.kept_tokens(0)) {
      return absl::FailedPreconditionError(
          absl::StrCat("FORMAT_DENSE_CONTIGUOUS: layer ", l, " keeps ", info.kept_tokens(l),
                       " tokens per KV head but layer 0 keeps ", info.kept_tokens(0),
                       "; a stock engine needs one count for every layer (no layer_budgets)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvc::server

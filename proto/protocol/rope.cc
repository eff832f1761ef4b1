// The RoPE a request declares, mapped onto the engine's (kvc/protocol/convert.h). PutCache uses it
// for the policies that move queries between positions (expected attention), GetCache for the
// contiguous export.
#include "absl/strings/str_cat.h"
#include "kvc/protocol/convert.h"

namespace kvc {

absl::StatusOr<RopeParams> RopeFromProto(const kvcache::v1::RopeSpec& rope, int head_dim,
                                         RopeUse use) {
  const bool put = use == RopeUse::kPutHeader;
  const char* needed_for = put ? "the expected policy needs the RoPE the model applied"
                               : "FORMAT_DENSE_CONTIGUOUS needs the RoPE the keys were stored with";
  RopeParams p;
  p.theta = rope.theta();
  // Checked before narrowing to int, so the message quotes the value sent.
  if (rope.rotary_dims() > static_cast<uint32_t>(head_dim)) {
    return absl::InvalidArgumentError(absl::StrCat("rope.rotary_dims: ", rope.rotary_dims(),
                                                   " exceeds head_dim ", head_dim,
                                                   " (0 = head_dim)"));
  }
  p.rotary_dims = static_cast<int>(rope.rotary_dims());
  switch (rope.style()) {
    case kvcache::v1::ROPE_INTERLEAVED:
      p.half_split = false;
      break;
    case kvcache::v1::ROPE_HALF_SPLIT:
      p.half_split = true;
      break;
    case kvcache::v1::ROPE_STYLE_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat("rope.style: unset; ", needed_for,
                                                     " (ROPE_INTERLEAVED or ROPE_HALF_SPLIT)"));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("rope.style: ", static_cast<int>(rope.style()),
                       " is not ROPE_INTERLEAVED or ROPE_HALF_SPLIT"));
  }
  switch (rope.scaling()) {
    case kvcache::v1::ROPE_SCALING_UNSPECIFIED:
    case kvcache::v1::ROPE_SCALING_NONE:
      break;
    case kvcache::v1::ROPE_SCALING_LINEAR:
      p.linear_factor = rope.scaling_factor();
      break;
    case kvcache::v1::ROPE_SCALING_DYNAMIC_NTK:
      if (put) {
        return absl::InvalidArgumentError(
            "rope.scaling: DYNAMIC_NTK rescales the frequencies by the sequence length, so the "
            "expected policy cannot rotate its query statistics to future positions exactly; "
            "send the RoPE with NONE or LINEAR scaling");
      }
      return absl::FailedPreconditionError(
          "rope.scaling: DYNAMIC_NTK rescales the frequencies by the sequence length, so keys "
          "stored at one length cannot be moved to another exactly; fetch FORMAT_DENSE");
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("rope.scaling: ", static_cast<int>(rope.scaling()),
                       " is not NONE, LINEAR or DYNAMIC_NTK"));
  }
  if (absl::Status s = ValidateRope(p, head_dim); !s.ok()) return s;
  return p;
}

kvcache::v1::RopeSpec RopeToProto(const RopeParams& rope) {
  kvcache::v1::RopeSpec p;
  p.set_theta(rope.theta);
  p.set_rotary_dims(static_cast<uint32_t>(rope.rotary_dims));
  p.set_style(rope.half_split ? kvcache::v1::ROPE_HALF_SPLIT : kvcache::v1::ROPE_INTERLEAVED);
  if (rope.linear_factor != 1.0) {
    p.set_scaling(kvcache::v1::ROPE_SCALING_LINEAR);
    p.set_scaling_factor(rope.linear_factor);
  }
  return p;
}

}  // namespace kvc

#include "server/contiguous.h"

#include "absl/strings/str_cat.h"
#include "kvc/compact.h"
#include "kvc/spec.h"

namespace kvc::server {

namespace pb = kvcache::v1;

absl::StatusOr<RopeParams> RopeFromProto(const pb::RopeSpec& rope, int head_dim, RopeUse use) {
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
    case pb::ROPE_INTERLEAVED:
      p.half_split = false;
      break;
    case pb::ROPE_HALF_SPLIT:
      p.half_split = true;
      break;
    case pb::ROPE_STYLE_UNSPECIFIED:
      return absl::InvalidArgumentError(absl::StrCat("rope.style: unset; ", needed_for,
                                                     " (ROPE_INTERLEAVED or ROPE_HALF_SPLIT)"));
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("rope.style: ", static_cast<int>(rope.style()),
                       " is not ROPE_INTERLEAVED or ROPE_HALF_SPLIT"));
  }
  switch (rope.scaling()) {
    case pb::ROPE_SCALING_UNSPECIFIED:
    case pb::ROPE_SCALING_NONE:
      break;
    case pb::ROPE_SCALING_LINEAR:
      p.linear_factor = rope.scaling_factor();
      break;
    case pb::ROPE_SCALING_DYNAMIC_NTK:
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

absl::Status CheckUniformKept(const pb::CacheInfo& info, const CacheEntry& entry) {
  if (info.compression().eviction().adaptive()) {
    // Head-adaptive budgets may still give every head the same count (adaptive_floor = 1 always
    // does): only the stored counts tell. A blob that does not parse is reported (DATA_LOSS) when
    // its layer is exported.
    for (size_t l = 0; l < entry.layers.size(); ++l) {
      absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(entry.layers[l]);
      if (!view.ok()) continue;
      for (int h = 1; h < view->num_kv_heads(); ++h) {
        if (view->head(h).n_kept != view->head(0).n_kept) {
          return absl::FailedPreconditionError(absl::StrCat(
              "FORMAT_DENSE_CONTIGUOUS: the cache was stored with head-adaptive budgets and its KV "
              "heads keep different counts (layer ",
              l, ": head ", h, " keeps ", view->head(h).n_kept, ", head 0 keeps ",
              view->head(0).n_kept,
              "); a stock engine needs one count for every head (fetch FORMAT_DENSE, padded with "
              "position -1, or FORMAT_PACKED)"));
        }
      }
    }
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

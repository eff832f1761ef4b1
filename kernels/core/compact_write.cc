// The compact format's writer side that needs no engine: PackedSize (the size PackLayer in
// kernels/cpu produces), EstimateStoredBytes (a cache's size before any layer arrived) and
// InPlaceLayer (a layer stored whole, written as its bytes arrive).
#include "core/compact_write.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/compact_layout.h"
#include "kvc/checked_math.h"
#include "kvc/compact.h"
#include "kvc/status_macros.h"
#include "kvc/stream_copy.h"

namespace kvc {

using internal::ComputeHeadLayout;
using internal::PadBlock;
using internal::PutBlock;
using internal::RecentCount;
using internal::WriteLayerMeta;

size_t PackedSize(const LayerShape& shape, DType dtype, const TokenSelection& tokens,
                  const ChannelSelection& channels, const CompressionSpec& spec) {
  const int g = spec.quant.bits > 0 ? spec.quant.group_size : 0;
  auto section = [&](int n_kept) {
    const int r =
        RecentCount(n_kept, channels.key_channels, channels.value_channels, shape.head_dim, spec);
    return ComputeHeadLayout(n_kept, r, channels.key_channels, channels.value_channels,
                             shape.head_dim, DTypeSize(dtype), KeyBits(spec.quant),
                             ValueBits(spec.quant), g)
        .size;
  };
  size_t total = internal::SectionsBegin(shape.num_kv_heads);
  if (!tokens.ragged()) {
    return total + static_cast<size_t>(shape.num_kv_heads) * section(tokens.budget);
  }
  for (int n : tokens.counts) total += section(n);
  return total;
}

bool InPlaceLayer::KeepsEverything(const CompressionSpec& spec) {
  return spec.eviction.policy == EvictionPolicy::kNone &&
         spec.channels.key_policy == ChannelPolicy::kNone && !spec.channels.prune_values &&
         spec.quant.bits == 0;
}

absl::StatusOr<InPlaceLayer> InPlaceLayer::Create(const LayerShape& shape, DType dtype,
                                                  Layout layout, int layer_index,
                                                  const CompressionSpec& spec) {
  RETURN_IF_ERROR(ValidateShape(shape, IsKnownPolicy(spec.eviction.policy) &&
                                           Policy(spec.eviction.policy).rows_after_context));
  if (static_cast<int>(dtype) > static_cast<int>(DType::kBF16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype: ", static_cast<int>(dtype), " is not a known dtype"));
  }
  if (layout != Layout::kHND && layout != Layout::kNHD) {
    return absl::InvalidArgumentError(
        absl::StrCat("layout: ", static_cast<int>(layout), " is not a known layout"));
  }
  RETURN_IF_ERROR(ValidateSpec(spec, shape, layer_index));
  if (!KeepsEverything(spec)) {
    return absl::InvalidArgumentError(
        "spec: an in-place layer needs eviction, channel pruning and quantization all off");
  }
  InPlaceLayer l;
  const int s = shape.seq_len, d = shape.head_dim;
  const size_t elem = DTypeSize(dtype);
  const internal::HeadLayout hl = internal::ComputeHeadLayout(s, 0, d, d, d, elem, 0, 0, 0);
  l.layout_ = layout;
  l.heads_ = shape.num_kv_heads;
  l.row_bytes_ = static_cast<size_t>(d) * elem;
  l.head_bytes_ = static_cast<uint64_t>(s) * l.row_bytes_;
  l.tensor_bytes_ = l.head_bytes_ * static_cast<uint64_t>(l.heads_);
  l.sections_ = internal::SectionsBegin(l.heads_);
  l.section_size_ = hl.size;
  l.keys_at_ = hl.key_old;
  l.values_at_ = hl.value_old;
  try {
    l.layer_.bytes.resize(l.sections_ + static_cast<size_t>(l.heads_) * hl.size);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", l.sections_ + static_cast<size_t>(l.heads_) * hl.size,
                     " bytes for layer ", layer_index));
  }
  uint8_t* blob = l.layer_.bytes.data();
  WriteLayerMeta(
      shape, dtype, layer_index, spec, [s](int) { return s; }, [](int) { return 0; }, d, d,
      [&hl](int) { return hl.size; }, blob);
  std::vector<int32_t> positions(std::max(s, d));
  for (size_t i = 0; i < positions.size(); ++i) positions[i] = static_cast<int32_t>(i);
  for (int h = 0; h < l.heads_; ++h) {
    uint8_t* section = blob + l.sections_ + static_cast<size_t>(h) * hl.size;
    PutBlock(section, hl.positions, positions.data(), sizeof(int32_t) * s);
    PutBlock(section, hl.key_idx, positions.data(), sizeof(int32_t) * d);
    PutBlock(section, hl.value_idx, positions.data(), sizeof(int32_t) * d);
    PadBlock(section, hl.key_old, l.head_bytes_);
    PadBlock(section, hl.value_old, l.head_bytes_);
  }
  return l;
}

void InPlaceLayer::Write(bool values, uint64_t offset, const uint8_t* data, size_t size,
                         absl::FunctionRef<void(size_t, const uint8_t*, size_t)> placed) {
  uint8_t* const base = layer_.bytes.data();
  uint8_t* const blob = base + sections_ + (values ? values_at_ : keys_at_);
  while (size > 0) {
    size_t take;
    uint8_t* dst;
    if (layout_ == Layout::kHND) {  // [H, S, D]: a head's rows are contiguous, as in the blob
      const uint64_t h = offset / head_bytes_, within = offset % head_bytes_;
      take = static_cast<size_t>(std::min<uint64_t>(size, head_bytes_ - within));
      dst = blob + h * section_size_ + within;
    } else {  // [S, H, D]: row (t, h) goes to row t of head h's block
      const uint64_t token_bytes = row_bytes_ * static_cast<uint64_t>(heads_);
      const uint64_t t = offset / token_bytes, in_token = offset % token_bytes;
      const uint64_t h = in_token / row_bytes_, c = in_token % row_bytes_;
      take = static_cast<size_t>(std::min<uint64_t>(size, row_bytes_ - c));
      dst = blob + h * section_size_ + t * row_bytes_ + c;
    }
    const size_t at = static_cast<size_t>(dst - base);
    take = std::min(take, kPieceBytes - at % kPieceBytes);  // pieces end on kPieceBytes multiples
    StreamCopy(dst, data, take);
    placed(at, data, take);
    data += take;
    offset += take;
    size -= take;
  }
}

absl::StatusOr<uint64_t> EstimateStoredBytes(const LayerShape& s, DType dtype,
                                             const CompressionSpec& spec, int num_layers) {
  const uint64_t es = DTypeSize(dtype);
  const bool pruning = spec.channels.key_policy != ChannelPolicy::kNone;
  const int tk = pruning ? KeptChannels(spec.channels.key_lambda, s.head_dim) : s.head_dim;
  const int tv = spec.channels.prune_values ? KeptChannels(spec.channels.value_lambda, s.head_dim)
                                            : s.head_dim;
  // Quantized elements cost bits/8 bytes, otherwise the dtype size; counted in bits and rounded
  // down per head, and scales are not counted, so this stays a lower bound.
  const uint64_t key_bits = KeyBits(spec.quant) > 0 ? KeyBits(spec.quant) : 8 * es;
  const uint64_t value_bits = ValueBits(spec.quant) > 0 ? ValueBits(spec.quant) : 8 * es;
  // Both factors are small: tk, tv <= kMaxHeadDim and bits <= 64.
  const uint64_t token_bits = static_cast<uint64_t>(tk) * key_bits + tv * value_bits;
  const uint64_t heads = static_cast<uint64_t>(s.num_kv_heads);
  uint64_t total = 0;
  for (int l = 0; l < num_layers; ++l) {
    const uint64_t kept = static_cast<uint64_t>(EffectiveBudget(spec.eviction, l, s.seq_len));
    ASSIGN_OR_RETURN(const uint64_t data_bits,
                     CheckedProduct("shape", {{"kept_tokens", kept},
                                              {"bits_per_kept_token", token_bits}}));
    // Per head: its descriptor, the kept data and one int32 position per kept token. With
    // head-adaptive budgets the heads keep different counts, but H * kept in all, each head at
    // least its count times these per-token bytes: H times a per-head floor stays below that.
    uint64_t per_head = sizeof(HeadDesc) + data_bits / 8;
    uint64_t layer = sizeof(LayerHeader);
    if (!CheckedMulAdd(kept, 4, &per_head) || !CheckedMulAdd(heads, per_head, &layer) ||
        !CheckedMulAdd(1, layer, &total)) {
      return ProductOverflowError("shape", {{"num_kv_heads", heads},
                                            {"stored_bytes_per_head", per_head},
                                            {"num_layers", static_cast<uint64_t>(num_layers)}});
    }
  }
  return total;
}

}  // namespace kvc

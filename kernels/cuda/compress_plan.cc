#include "cuda/compress_plan.h"

#include <algorithm>

#include "core/compact_layout.h"
#include "core/compact_write.h"

namespace kvc::cuda {

CompressPlan MakeCompressPlan(const LayerInput& in, const CompressionSpec& spec) {
  const LayerShape& sh = in.shape;
  const int s = sh.seq_len, d = sh.head_dim;
  CompressPlan p;
  const EvictionSpec& e = spec.eviction;
  p.budget = EffectiveBudget(e, in.layer_index, s);
  // The policy row's protected window, computed as the CPU engine does (kvc/spec.h).
  const ProtectedTokens prot = ProtectedFor(e, sh, p.budget);
  p.sink_end = prot.sinks;
  p.recent_begin = s - prot.recent;

  const bool prune_keys = spec.channels.key_policy != ChannelPolicy::kNone;
  p.key_channels = prune_keys ? KeptChannels(spec.channels.key_lambda, d) : d;
  p.value_channels = spec.channels.prune_values ? KeptChannels(spec.channels.value_lambda, d) : d;
  // Same rule as PackLayer: the recent window exists only when something is actually reduced.
  const bool reduced = p.key_channels < d || p.value_channels < d || spec.quant.bits > 0;
  p.n_recent = reduced ? std::clamp(spec.recent_tokens, 0, p.budget) : 0;

  const int hkv = sh.num_kv_heads, b = p.budget, r = p.n_recent;
  const int bits = KeyBits(spec.quant), g = bits > 0 ? spec.quant.group_size : 0;
  // The CPU writer's layout function, so that both backends produce byte-identical blobs.
  const internal::HeadLayout l =
      internal::ComputeHeadLayout(b, r, p.key_channels, p.value_channels, d, DTypeSize(in.dtype),
                                  bits, ValueBits(spec.quant), g);
  p.offsets.resize(hkv);
  p.descs.resize(hkv);
  for (int h = 0; h < hkv; ++h) {
    const uint64_t start = internal::SectionsBegin(hkv) + static_cast<uint64_t>(h) * l.size;
    HeadOffsets& o = p.offsets[h];
    o = HeadOffsets{start + l.positions,   start + l.key_idx,    start + l.value_idx,
                    start + l.key_old,     start + l.key_scale,  start + l.key_zero,
                    start + l.key_codes,   start + l.key_recent, start + l.value_old,
                    start + l.value_scale, start + l.value_zero, start + l.value_codes,
                    start + l.value_recent};
    HeadDesc& desc = p.descs[h];
    desc.n_kept = b;
    desc.n_recent = r;
    desc.key_channels = p.key_channels;
    desc.value_channels = p.value_channels;
    desc.offset = start;
    desc.size = l.size;
  }
  p.blob_bytes = internal::SectionsBegin(hkv) + static_cast<size_t>(hkv) * l.size;
  return p;
}
LayerHeader MakeLayerHeader(const LayerInput& in, const CompressionSpec& spec) {
  return internal::MakeLayerHeader(in.shape, in.dtype, in.layer_index, spec);
}

}  // namespace kvc::cuda

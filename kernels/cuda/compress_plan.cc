#include "cuda/compress_plan.h"

#include <algorithm>

#include "core/compact_layout.h"
#include "core/compact_write.h"

namespace kvc::cuda {
namespace {

// Tokens of the budget reserved for the recent window: the request's recent_fraction when set
// (>= 0), else the policy's default (h2o 1/2, keyformer 0.3).
int RecentTokens(const EvictionSpec& e, int budget, double default_fraction) {
  const double f = e.recent_fraction >= 0 ? e.recent_fraction : default_fraction;
  return std::min(budget, static_cast<int>(f * budget));
}

}  // namespace

CompressPlan MakeCompressPlan(const LayerInput& in, const CompressionSpec& spec) {
  const LayerShape& sh = in.shape;
  const int s = sh.seq_len, d = sh.head_dim;
  CompressPlan p;
  const EvictionSpec& e = spec.eviction;
  p.budget = EffectiveBudget(e, in.layer_index, s);
  int recent = 0;
  switch (e.policy) {
    case EvictionPolicy::kNone:
      recent = s;
      break;
    case EvictionPolicy::kStreaming:
      p.sink_end = std::min(e.sink_tokens, p.budget);
      recent = p.budget - p.sink_end;
      break;
    case EvictionPolicy::kH2O:
      recent = RecentTokens(e, p.budget, 0.5);
      p.needs_attention_scores = true;
      break;
    case EvictionPolicy::kSnapKV:
      recent = std::min(sh.obs_window, p.budget);
      p.needs_attention_scores = true;
      break;
    case EvictionPolicy::kKeyformer:
      recent = RecentTokens(e, p.budget, 0.3);
      p.needs_attention_scores = true;
      break;
    case EvictionPolicy::kKeyDiff:
    case EvictionPolicy::kExpectedAttention:
      recent = RecentTokens(e, p.budget, 0.0);
      break;
    case EvictionPolicy::kKNorm:
    case EvictionPolicy::kRandom:
      break;
  }
  p.recent_begin = s - std::clamp(recent, 0, p.budget - p.sink_end);

  const bool prune_keys = spec.channels.key_policy != ChannelPolicy::kNone;
  p.key_channels = prune_keys ? KeptChannels(spec.channels.key_lambda, d) : d;
  p.value_channels = spec.channels.prune_values ? KeptChannels(spec.channels.value_lambda, d) : d;
  // Same rule as PackLayer: the recent window exists only when something is actually reduced.
  const bool reduced = p.key_channels < d || p.value_channels < d || spec.quant.bits > 0;
  p.n_recent = reduced ? std::clamp(spec.recent_tokens, 0, p.budget) : 0;

  const int hkv = sh.num_kv_heads, b = p.budget, r = p.n_recent;
  const int bits = spec.quant.bits, g = bits > 0 ? spec.quant.group_size : 0;
  // The CPU writer's layout function, so that both backends produce byte-identical blobs.
  const internal::HeadLayout l = internal::ComputeHeadLayout(b, r, p.key_channels, p.value_channels,
                                                             d, DTypeSize(in.dtype), bits, g);
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

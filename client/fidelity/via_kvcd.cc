#include "kvc/fidelity/via_kvcd.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kvc/status_macros.h"

namespace kvc::fidelity {

kvcache::v1::CompressionConfig SpecToProto(const CompressionSpec& spec) {
  kvcache::v1::CompressionConfig c;
  auto* e = c.mutable_eviction();
  e->set_policy(std::string(PolicyName(spec.eviction.policy)));
  e->set_budget(static_cast<uint32_t>(std::max(spec.eviction.budget, 0)));
  e->set_keep_ratio(spec.eviction.keep_ratio);
  for (int b : spec.eviction.layer_budgets) e->add_layer_budgets(static_cast<uint32_t>(b));
  e->set_granularity(spec.eviction.granularity == Granularity::kPerLayer
                         ? kvcache::v1::GRANULARITY_PER_LAYER
                         : kvcache::v1::GRANULARITY_PER_HEAD);
  e->set_sink_tokens(static_cast<uint32_t>(spec.eviction.sink_tokens));
  // Negative means "the policy's default" in both the struct and the server's conversion, which
  // applies it only when the field is present: leave it absent then.
  if (spec.eviction.recent_fraction >= 0) e->set_recent_fraction(spec.eviction.recent_fraction);
  e->set_pool_kernel(static_cast<uint32_t>(spec.eviction.pool_kernel));
  e->set_pool(spec.eviction.pool == PoolKind::kAvg ? "avg" : "max");
  e->set_tau(spec.eviction.tau);
  e->set_seed(spec.eviction.seed);
  e->set_adaptive(spec.eviction.adaptive);
  e->set_adaptive_floor(spec.eviction.adaptive_floor);
  e->set_value_weight(std::string(ValueWeightName(spec.eviction.value_weight)));
  e->set_value_eps(spec.eviction.value_eps);
  e->set_horizon(static_cast<uint32_t>(spec.eviction.horizon));
  e->set_query_stats(spec.eviction.query_stats);
  auto* ch = c.mutable_channels();
  ch->set_key_policy(std::string(PolicyName(spec.channels.key_policy)));
  ch->set_key_lambda(spec.channels.key_lambda);
  ch->set_prune_values(spec.channels.prune_values);
  ch->set_value_lambda(spec.channels.value_lambda);
  c.mutable_quant()->set_bits(static_cast<uint32_t>(spec.quant.bits));
  c.mutable_quant()->set_group_size(static_cast<uint32_t>(spec.quant.group_size));
  c.set_recent_tokens(static_cast<uint32_t>(spec.recent_tokens));
  return c;
}

Compressor KvcdCompressor(Client* client, const std::string& id_prefix) {
  auto counter = std::make_shared<uint64_t>(0);
  return [client, id_prefix, counter](const PrefixCache& prefix, const CompressionSpec& spec,
                                      int sequence) -> absl::StatusOr<std::vector<CompactLayer>> {
    const std::string id = absl::StrCat(id_prefix, "-", (*counter)++, "-s", sequence);
    PutHeader header;
    header.set_cache_id(id);
    auto* shape = header.mutable_shape();
    shape->set_num_layers(static_cast<uint32_t>(prefix.num_layers()));
    shape->set_num_kv_heads(static_cast<uint32_t>(prefix.num_kv_heads));
    shape->set_num_q_heads(static_cast<uint32_t>(prefix.num_q_heads));
    shape->set_head_dim(static_cast<uint32_t>(prefix.head_dim));
    shape->set_seq_len(static_cast<uint32_t>(prefix.prefix_len));
    shape->set_obs_window(static_cast<uint32_t>(prefix.obs_window));
    header.set_dtype(kvcache::v1::DTYPE_F32);
    header.set_layout(kvcache::v1::LAYOUT_HND);
    *header.mutable_compression() = SpecToProto(spec);
    header.set_overwrite(true);
    auto* rope = header.mutable_rope();
    rope->set_theta(prefix.rope.theta);
    rope->set_rotary_dims(static_cast<uint32_t>(prefix.rope.rotary_dims));
    rope->set_style(prefix.rope.half_split ? kvcache::v1::ROPE_HALF_SPLIT
                                           : kvcache::v1::ROPE_INTERLEAVED);
    std::vector<LayerTensors> tensors;
    for (int l = 0; l < prefix.num_layers(); ++l) {
      const LayerInput in = prefix.Input(l);
      tensors.push_back({in.k, in.v, in.q_obs, spec.eviction.query_stats ? in.q_stats : nullptr});
    }
    RETURN_IF_ERROR(client->PutCache(header, tensors).status());
    GetOptions get;
    get.format = CacheFormat::kPacked;
    absl::StatusOr<CacheData> data = client->GetCache(id, get);
    // Delete even when the fetch failed, so a sweep leaves nothing behind.
    absl::Status deleted = client->DeleteCache(id).status();
    if (!data.ok()) return data.status();
    RETURN_IF_ERROR(deleted);
    std::vector<CompactLayer> out;
    for (LayerData& layer : data->layers) out.push_back(CompactLayer{ToByteVector(layer.packed)});
    if (static_cast<int>(out.size()) != prefix.num_layers()) {
      return absl::InternalError(absl::StrCat("GetCache(", id, ") returned ", out.size(),
                                              " layers, expected ", prefix.num_layers()));
    }
    return out;
  };
}

}  // namespace kvc::fidelity

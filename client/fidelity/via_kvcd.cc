#include "kvc/fidelity/via_kvcd.h"

#include <algorithm>
#include <memory>

#include "absl/strings/str_cat.h"
#include "kvc/status_macros.h"

namespace kvc::fidelity {

Compressor KvcdCompressor(Client* client, const std::string& id_prefix) {
  auto counter = std::make_shared<uint64_t>(0);
  return [client, id_prefix, counter](const PrefixCache& prefix, const CompressionSpec& spec,
                                      int sequence) -> absl::StatusOr<std::vector<CompactLayer>> {
    const std::string id = absl::StrCat(id_prefix, "-", (*counter)++, "-s", sequence);
    PutHeader header;
    header.set_cache_id(id);
    *header.mutable_shape() = ShapeToProto(prefix.shape(), prefix.num_layers());
    header.set_dtype(ToProto(DType::kF32));
    header.set_layout(ToProto(Layout::kHND));
    *header.mutable_compression() = SpecToProto(spec);
    header.set_overwrite(true);
    *header.mutable_rope() = RopeToProto(prefix.rope);
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

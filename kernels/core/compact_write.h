// What every writer of the compact format writes the same way (the CPU engine's PackLayer,
// InPlaceLayer, the CUDA backend's plan): the recent-row rule, the layer header, the descriptor
// table and the zero padding between blocks. Internal to kernels/.
#ifndef KVC_KERNELS_CORE_COMPACT_WRITE_H_
#define KVC_KERNELS_CORE_COMPACT_WRITE_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

#include "core/compact_layout.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc::internal {

// Recent rows r: only when something is reduced (pruning or quantization); see CompressionSpec.
inline int RecentCount(int n_kept, int key_channels, int value_channels, int head_dim,
                       const CompressionSpec& spec) {
  const bool reduced = key_channels < head_dim || value_channels < head_dim || spec.quant.bits > 0;
  if (!reduced) return 0;
  return std::clamp(spec.recent_tokens, 0, n_kept);
}

// The header of a layer compressed from a shape, dtype and spec (every writer's header).
inline LayerHeader MakeLayerHeader(const LayerShape& s, DType dtype, int layer_index,
                                   const CompressionSpec& spec) {
  LayerHeader header;
  header.dtype = static_cast<uint8_t>(dtype);
  header.quant_bits = static_cast<uint8_t>(KeyBits(spec.quant));
  if (ValueBits(spec.quant) != KeyBits(spec.quant)) {  // else a version 1 blob, as before
    header.version = kCompactVersionValueBits;
    header.value_quant_bits = static_cast<uint8_t>(ValueBits(spec.quant));
  }
  header.layer_index = layer_index;
  header.num_kv_heads = s.num_kv_heads;
  header.head_dim = s.head_dim;
  header.seq_len = s.seq_len;
  header.quant_group = spec.quant.bits > 0 ? spec.quant.group_size : 0;
  header.eviction_policy = static_cast<uint8_t>(spec.eviction.policy);
  header.channel_policy = static_cast<uint8_t>(spec.channels.key_policy);
  return header;
}

// Writes the header and the descriptor table; head h keeps n_kept(h) tokens, r(h) of them recent,
// in a section of size(h) bytes, back to back after the table.
template <typename NKept, typename NRecent, typename Size>
void WriteLayerMeta(const LayerShape& s, DType dtype, int layer_index, const CompressionSpec& spec,
                    NKept n_kept, NRecent n_recent, int tk, int tv, Size section_size,
                    uint8_t* blob) {
  const LayerHeader header = MakeLayerHeader(s, dtype, layer_index, spec);
  std::memcpy(blob, &header, sizeof(header));
  size_t offset = SectionsBegin(s.num_kv_heads);
  for (int h = 0; h < s.num_kv_heads; ++h) {
    HeadDesc desc;
    desc.n_kept = n_kept(h);
    desc.n_recent = n_recent(h);
    desc.key_channels = tk;
    desc.value_channels = tv;
    desc.offset = offset;
    desc.size = section_size(h);
    offset += desc.size;
    std::memcpy(blob + sizeof(header) + sizeof(HeadDesc) * static_cast<size_t>(h), &desc,
                sizeof(desc));
  }
}

// Zeroes the padding after a block of `bytes` at offset `at` of a head section, up to the next
// 16-byte boundary (where the next block starts). The blob buffer is not zero-filled when it is
// sized (ByteVector), so this is what keeps the format's "padding is zero" promise.
inline void PadBlock(uint8_t* section, size_t at, size_t bytes) {
  const size_t end = at + bytes;
  std::memset(section + end, 0, AlignUp(end) - end);
}

inline void PutBlock(uint8_t* section, size_t at, const void* p, size_t bytes) {
  std::memcpy(section + at, p, bytes);
  PadBlock(section, at, bytes);
}

}  // namespace kvc::internal

#endif  // KVC_KERNELS_CORE_COMPACT_WRITE_H_

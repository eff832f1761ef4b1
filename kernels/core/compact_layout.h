// Byte layout of one head section of a compact layer (see kvc/compact.h), shared by the writer
// (PackLayer) and the reader (CompactLayerView). Internal to kernels/.
#ifndef KVC_CORE_COMPACT_LAYOUT_H_
#define KVC_CORE_COMPACT_LAYOUT_H_

#include <cstddef>
#include <cstdint>

#include "core/quantize.h"
#include "kvc/compact.h"

namespace kvc::internal {

inline constexpr size_t kBlockAlign = 16;
inline constexpr size_t AlignUp(size_t x) { return (x + kBlockAlign - 1) & ~(kBlockAlign - 1); }

// Offset of the first head section: header plus descriptor table (both multiples of 16 bytes).
inline constexpr size_t SectionsBegin(int num_kv_heads) {
  return sizeof(LayerHeader) + sizeof(HeadDesc) * static_cast<size_t>(num_kv_heads);
}

// Offsets of every block relative to the start of the head section; each is 16-byte aligned.
// Quantization blocks are meaningful only when bits > 0, key_old/value_old only when bits == 0.
struct HeadLayout {
  size_t positions = 0, key_idx = 0, value_idx = 0;
  size_t key_old = 0, key_scale = 0, key_zero = 0, key_codes = 0, key_recent = 0;
  size_t value_old = 0, value_scale = 0, value_zero = 0, value_codes = 0, value_recent = 0;
  size_t size = 0;  // whole section, padded to 16 bytes
};

// Preconditions (checked by callers): 0 <= n_recent <= n_kept, 1 <= tk, tv <= d, bits and vbits
// (the keys' and the values') in {0, 2, 4, 8}, g >= 1 when either is > 0. All counts fit in
// int32, so no size_t overflow occurs.
inline HeadLayout ComputeHeadLayout(int n_kept, int n_recent, int tk, int tv, int d,
                                    size_t elem_size, int bits, int vbits, int g) {
  HeadLayout l;
  const size_t m = static_cast<size_t>(n_kept - n_recent);
  const size_t r = static_cast<size_t>(n_recent);
  size_t off = 0;
  auto take = [&off](size_t bytes) {
    const size_t at = off;
    off = AlignUp(off + bytes);
    return at;
  };
  l.positions = take(sizeof(int32_t) * static_cast<size_t>(n_kept));
  l.key_idx = take(sizeof(int32_t) * static_cast<size_t>(tk));
  l.value_idx = take(sizeof(int32_t) * static_cast<size_t>(tv));
  if (bits == 0) {
    l.key_old = take(m * tk * elem_size);
  } else {
    const size_t kgroups = static_cast<size_t>(quant::NumGroups(static_cast<int>(m), g));
    l.key_scale = take(sizeof(float) * kgroups * tk);
    l.key_zero = take(sizeof(float) * kgroups * tk);
    l.key_codes = take(m * quant::CodeRowBytes(tk, bits));
  }
  l.key_recent = take(r * d * elem_size);
  if (vbits == 0) {
    l.value_old = take(m * tv * elem_size);
  } else {
    const size_t vgroups = static_cast<size_t>(quant::NumGroups(tv, g));
    l.value_scale = take(sizeof(float) * m * vgroups);
    l.value_zero = take(sizeof(float) * m * vgroups);
    l.value_codes = take(m * quant::CodeRowBytes(tv, vbits));
  }
  l.value_recent = take(r * d * elem_size);
  l.size = off;
  return l;
}

}  // namespace kvc::internal

#endif  // KVC_CORE_COMPACT_LAYOUT_H_

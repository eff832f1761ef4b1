// PackLayer and PackedSize: the writer side of the compact format (kvc/compact.h). The reader
// side (CompactLayerView, DENSE export) is in compact_view.cc.
#include "kvc/compact.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "cpu/compact_layout.h"
#include "cpu/gather.h"
#include "cpu/quantize.h"
#include "kvc/convert.h"
#include "kvc/status_macros.h"

namespace kvc {
namespace {

using internal::AlignUp;
using internal::ComputeHeadLayout;
using internal::HeadLayout;

// Checks one head's index list: strictly ascending and inside [0, limit).
absl::Status CheckAscending(const int32_t* v, int n, int limit, absl::string_view field,
                            absl::string_view limit_name, int h) {
  for (int i = 0; i < n; ++i) {
    if (v[i] < 0 || v[i] >= limit) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[head ", h, "][", i, "]: ", v[i],
                                                     " is outside [0, ", limit_name, " ", limit,
                                                     ")"));
    }
    if (i > 0 && v[i] <= v[i - 1]) {
      return absl::InvalidArgumentError(absl::StrCat(field, "[head ", h, "][", i, "]: ", v[i],
                                                     " is not greater than the previous ", v[i - 1],
                                                     " (must be strictly ascending)"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckChannelList(const std::vector<int32_t>& idx, int count, int heads, int d,
                              absl::string_view name) {
  if (count < 1 || count > d) {
    return absl::InvalidArgumentError(
        absl::StrCat("channels.", name, "_channels: ", count, " is outside [1, head_dim ", d, "]"));
  }
  // An empty index list with every channel kept means "identity" (nothing was pruned).
  if (idx.empty() && count == d) return absl::OkStatus();
  const size_t want = static_cast<size_t>(heads) * count;
  if (idx.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat("channels.", name, "_idx: size ", idx.size(),
                                                   " != num_kv_heads * ", name,
                                                   "_channels = ", want));
  }
  for (int h = 0; h < heads; ++h) {
    RETURN_IF_ERROR(CheckAscending(idx.data() + static_cast<size_t>(h) * count, count, d,
                                   absl::StrCat("channels.", name, "_idx"), "head_dim", h));
  }
  return absl::OkStatus();
}

absl::Status CheckPackInputs(const LayerInput& in, const TokenSelection& tokens,
                             const ChannelSelection& channels, const CompressionSpec& spec) {
  const LayerShape& s = in.shape;
  if (s.num_kv_heads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("in.shape.num_kv_heads: ", s.num_kv_heads, " must be >= 1"));
  }
  if (s.seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("in.shape.seq_len: ", s.seq_len, " must be >= 1"));
  }
  if (s.head_dim < kMinHeadDim || s.head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "in.shape.head_dim: ", s.head_dim, " is outside [", kMinHeadDim, ", ", kMaxHeadDim, "]"));
  }
  if (static_cast<int>(in.dtype) > static_cast<int>(DType::kBF16)) {
    return absl::InvalidArgumentError(
        absl::StrCat("in.dtype: ", static_cast<int>(in.dtype), " is not a known dtype"));
  }
  if (in.layout != Layout::kHND && in.layout != Layout::kNHD) {
    return absl::InvalidArgumentError(
        absl::StrCat("in.layout: ", static_cast<int>(in.layout), " is not a known layout"));
  }
  if (in.k == nullptr) return absl::InvalidArgumentError("in.k: null");
  if (in.v == nullptr) return absl::InvalidArgumentError("in.v: null");
  if (tokens.num_kv_heads != s.num_kv_heads) {
    return absl::InvalidArgumentError(absl::StrCat("tokens.num_kv_heads: ", tokens.num_kv_heads,
                                                   " does not match in.shape.num_kv_heads ",
                                                   s.num_kv_heads));
  }
  if (tokens.budget < 1 || tokens.budget > s.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens.budget: ", tokens.budget, " is outside [1, seq_len ", s.seq_len, "]"));
  }
  const size_t want = static_cast<size_t>(s.num_kv_heads) * tokens.budget;
  if (tokens.positions.size() != want) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tokens.positions: size ", tokens.positions.size(), " != num_kv_heads * budget = ", want));
  }
  for (int h = 0; h < s.num_kv_heads; ++h) {
    RETURN_IF_ERROR(CheckAscending(tokens.positions.data() + static_cast<size_t>(h) * tokens.budget,
                                   tokens.budget, s.seq_len, "tokens.positions", "seq_len", h));
  }
  RETURN_IF_ERROR(
      CheckChannelList(channels.key_idx, channels.key_channels, s.num_kv_heads, s.head_dim, "key"));
  RETURN_IF_ERROR(CheckChannelList(channels.value_idx, channels.value_channels, s.num_kv_heads,
                                   s.head_dim, "value"));
  const int bits = spec.quant.bits;
  if (bits != 0 && bits != 2 && bits != 4 && bits != 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.quant.bits: ", bits, " is not 0, 2, 4 or 8"));
  }
  if (bits > 0 && spec.quant.group_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.quant.group_size: ", spec.quant.group_size, " must be >= 1"));
  }
  if (spec.recent_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("spec.recent_tokens: ", spec.recent_tokens, " must be >= 0"));
  }
  return absl::OkStatus();
}

// Recent rows r: only when something is reduced (pruning or quantization); see CompressionSpec.
int RecentCount(int n_kept, int key_channels, int value_channels, int head_dim,
                const CompressionSpec& spec) {
  const bool reduced = key_channels < head_dim || value_channels < head_dim || spec.quant.bits > 0;
  if (!reduced) return 0;
  return std::clamp(spec.recent_tokens, 0, n_kept);
}

// Appends to a reserved vector. Full rows are appended with insert (no zero fill of the
// destination: the gather writes every byte once); other blocks grow the vector block by block so
// the zero fill stays in cache right before the gather overwrites it.
class BlobWriter {
 public:
  explicit BlobWriter(std::vector<uint8_t>* out) : out_(out) {}
  // GCC 12 reports a false -Wstringop-overflow for vector::insert into reserved storage.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wstringop-overflow"
#endif
  void Append(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    out_->insert(out_->end(), b, b + n);
  }
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
  uint8_t* Grow(size_t n) {
    const size_t at = out_->size();
    out_->resize(at + n);
    return out_->data() + at;
  }
  void Pad() { out_->resize(AlignUp(out_->size())); }
  size_t size() const { return out_->size(); }

 private:
  std::vector<uint8_t>* out_;
};

// A large blob is a fresh allocation on every call, and first-touch page faults on 4 KiB pages
// cost as much as the gather itself for multi-MiB layers. Asking for transparent huge pages on
// the interior of the buffer cuts the fault count ~500x where the kernel allows it (THP in
// "madvise" or "always" mode); elsewhere the call fails harmlessly.
void AdviseHugePages(uint8_t* p, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(p) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)p;
  (void)bytes;
#endif
}

// Source rows of one tensor (K or V) for head h: row(t) points at the D elements of token t.
struct RowSource {
  const uint8_t* base;
  Layout layout;
  int heads, seq_len, head_dim;
  size_t elem;
  int h;
  const uint8_t* row(int t) const {
    return base + ElementOffset(layout, heads, seq_len, head_dim, h, t, 0) * elem;
  }
};

// Kept rows are scattered over the source, so hardware prefetchers do not see them coming; asking
// for a row a dozen iterations ahead keeps enough misses in flight to hide most DRAM latency.
constexpr int kPrefetchRows = 12;
inline void PrefetchRow(const uint8_t* p, size_t bytes) {
  for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
}

// Appends full rows for positions pos[0..n). In HND, runs of consecutive positions are contiguous
// in memory and are copied with one memcpy.
void AppendFullRows(const RowSource& src, const int32_t* pos, int n, BlobWriter* w) {
  const size_t row_bytes = static_cast<size_t>(src.head_dim) * src.elem;
  int i = 0;
  while (i < n) {
    if (i + kPrefetchRows < n) PrefetchRow(src.row(pos[i + kPrefetchRows]), row_bytes);
    int j = i + 1;
    if (src.layout == Layout::kHND) {
      while (j < n && pos[j] == pos[j - 1] + 1) ++j;
    }
    w->Append(src.row(pos[i]), row_bytes * static_cast<size_t>(j - i));
    i = j;
  }
}

template <typename T>
void GatherChannels(const RowSource& src, const int32_t* pos, int n, const int32_t* idx, int t,
                    T* dst) {
  const size_t row_bytes = static_cast<size_t>(src.head_dim) * sizeof(T);
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) PrefetchRow(src.row(pos[i + kPrefetchRows]), row_bytes);
    const T* __restrict row = reinterpret_cast<const T*>(src.row(pos[i]));
    T* __restrict out = dst + static_cast<size_t>(i) * t;
    int c = 0;
    for (; c + 4 <= t; c += 4) {  // independent loads, so several are in flight per cycle
      const T a = row[idx[c]], b = row[idx[c + 1]], d = row[idx[c + 2]], e = row[idx[c + 3]];
      out[c] = a;
      out[c + 1] = b;
      out[c + 2] = d;
      out[c + 3] = e;
    }
    for (; c < t; ++c) out[c] = row[idx[c]];
  }
}

// Appends rows pos[0..n) restricted to channels idx[0..t) in the source dtype.
void AppendRows(const RowSource& src, const int32_t* pos, int n, const int32_t* idx, int t,
                BlobWriter* w) {
  if (idx == nullptr || t == src.head_dim) {  // ascending and t == D: identity
    AppendFullRows(src, pos, n, w);
    return;
  }
  if (src.elem == 4) {
    uint8_t* dst = w->Grow(static_cast<size_t>(n) * t * src.elem);
    GatherChannels(src, pos, n, idx, t, reinterpret_cast<uint32_t*>(dst));
    return;
  }
  uint16_t* out =
      reinterpret_cast<uint16_t*>(w->Grow(static_cast<size_t>(n) * t * sizeof(uint16_t)));
  const gather::Plan16 plan = gather::MakePlan16(idx, t, src.head_dim);
  const size_t row_bytes = static_cast<size_t>(src.head_dim) * src.elem;
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) PrefetchRow(src.row(pos[i + kPrefetchRows]), row_bytes);
    gather::GatherRow16(reinterpret_cast<const uint16_t*>(src.row(pos[i])), plan,
                        out + static_cast<size_t>(i) * t);
  }
}

// Gathers rows pos[0..n), channels idx (null = all), converted to fp32: [n, t]. Whole rows are
// converted with the vectorized ToFloat (F16C where available) and then picked from, which is
// much cheaper than converting element by element through the scalar half decoder.
void GatherFloat(const RowSource& src, DType dtype, const int32_t* pos, int n, const int32_t* idx,
                 int t, float* out) {
  std::vector<float> row(idx != nullptr ? src.head_dim : 0);
  const size_t row_bytes = static_cast<size_t>(src.head_dim) * src.elem;
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) PrefetchRow(src.row(pos[i + kPrefetchRows]), row_bytes);
    float* o = out + static_cast<size_t>(i) * t;
    if (idx == nullptr) {
      ToFloat(src.row(pos[i]), dtype, t, o);
      continue;
    }
    ToFloat(src.row(pos[i]), dtype, src.head_dim, row.data());
    for (int c = 0; c < t; ++c) o[c] = row[idx[c]];
  }
}

struct QuantScratch {
  std::vector<float> x, scale, zero;
  std::vector<uint8_t> codes;
};

// Appends the quantized old block (scale, zero, codes; each padded) for keys or values.
void AppendQuantized(const RowSource& src, DType dtype, const int32_t* pos, int m,
                     const int32_t* idx, int t, int bits, int g, bool keys, QuantScratch* s,
                     BlobWriter* w) {
  s->x.resize(static_cast<size_t>(m) * t);
  GatherFloat(src, dtype, pos, m, idx, t, s->x.data());
  const size_t params = keys ? static_cast<size_t>(quant::NumGroups(m, g)) * t
                             : static_cast<size_t>(m) * quant::NumGroups(t, g);
  s->scale.resize(params);
  s->zero.resize(params);
  s->codes.resize(static_cast<size_t>(m) * quant::CodeRowBytes(t, bits));
  if (keys) {
    quant::QuantizeKeys(s->x.data(), m, t, bits, g, s->scale.data(), s->zero.data(),
                        s->codes.data());
  } else {
    quant::QuantizeValues(s->x.data(), m, t, bits, g, s->scale.data(), s->zero.data(),
                          s->codes.data());
  }
  w->Append(s->scale.data(), params * sizeof(float));
  w->Pad();
  w->Append(s->zero.data(), params * sizeof(float));
  w->Pad();
  w->Append(s->codes.data(), s->codes.size());
  w->Pad();
}

}  // namespace

size_t PackedSize(const LayerShape& shape, DType dtype, const TokenSelection& tokens,
                  const ChannelSelection& channels, const CompressionSpec& spec) {
  const int n_kept = tokens.budget;
  const int r =
      RecentCount(n_kept, channels.key_channels, channels.value_channels, shape.head_dim, spec);
  const int g = spec.quant.bits > 0 ? spec.quant.group_size : 0;
  const HeadLayout l = ComputeHeadLayout(n_kept, r, channels.key_channels, channels.value_channels,
                                         shape.head_dim, DTypeSize(dtype), spec.quant.bits, g);
  return internal::SectionsBegin(shape.num_kv_heads) +
         static_cast<size_t>(shape.num_kv_heads) * l.size;
}

absl::StatusOr<CompactLayer> PackLayer(const LayerInput& in, const TokenSelection& tokens,
                                       const ChannelSelection& channels,
                                       const CompressionSpec& spec) {
  RETURN_IF_ERROR(CheckPackInputs(in, tokens, channels, spec));
  const LayerShape& s = in.shape;
  const int heads = s.num_kv_heads, d = s.head_dim, n_kept = tokens.budget;
  const int tk = channels.key_channels, tv = channels.value_channels;
  const int bits = spec.quant.bits;
  const int g = bits > 0 ? spec.quant.group_size : 0;
  const int r = RecentCount(n_kept, tk, tv, d, spec);
  const int m = n_kept - r;
  const size_t elem = DTypeSize(in.dtype);
  const HeadLayout layout = ComputeHeadLayout(n_kept, r, tk, tv, d, elem, bits, g);
  const size_t total = internal::SectionsBegin(heads) + static_cast<size_t>(heads) * layout.size;

  // Identity channel lists are materialized once (the blob always stores the indices).
  std::vector<int32_t> identity(d);
  for (int c = 0; c < d; ++c) identity[c] = c;
  auto channel_list = [&](const std::vector<int32_t>& idx, int t, int h) {
    return idx.empty() ? identity.data() : idx.data() + static_cast<size_t>(h) * t;
  };

  CompactLayer out;
  out.bytes.reserve(total);
  AdviseHugePages(out.bytes.data(), total);
  BlobWriter w(&out.bytes);
  LayerHeader header;
  header.dtype = static_cast<uint8_t>(in.dtype);
  header.quant_bits = static_cast<uint8_t>(bits);
  header.layer_index = in.layer_index;
  header.num_kv_heads = heads;
  header.head_dim = d;
  header.seq_len = s.seq_len;
  header.quant_group = g;
  header.eviction_policy = static_cast<uint8_t>(spec.eviction.policy);
  header.channel_policy = static_cast<uint8_t>(spec.channels.key_policy);
  w.Append(&header, sizeof(header));
  for (int h = 0; h < heads; ++h) {
    HeadDesc desc;
    desc.n_kept = n_kept;
    desc.n_recent = r;
    desc.key_channels = tk;
    desc.value_channels = tv;
    desc.offset = internal::SectionsBegin(heads) + static_cast<size_t>(h) * layout.size;
    desc.size = layout.size;
    w.Append(&desc, sizeof(desc));
  }

  QuantScratch scratch;
  for (int h = 0; h < heads; ++h) {
    const size_t section = w.size();
    const int32_t* pos = tokens.positions.data() + static_cast<size_t>(h) * n_kept;
    const int32_t* kidx = channel_list(channels.key_idx, tk, h);
    const int32_t* vidx = channel_list(channels.value_idx, tv, h);
    const RowSource ksrc{
        static_cast<const uint8_t*>(in.k), in.layout, heads, s.seq_len, d, elem, h};
    const RowSource vsrc{
        static_cast<const uint8_t*>(in.v), in.layout, heads, s.seq_len, d, elem, h};
    w.Append(pos, sizeof(int32_t) * n_kept);
    w.Pad();
    w.Append(kidx, sizeof(int32_t) * tk);
    w.Pad();
    w.Append(vidx, sizeof(int32_t) * tv);
    w.Pad();
    if (bits == 0) {
      AppendRows(ksrc, pos, m, kidx, tk, &w);
      w.Pad();
    } else {
      AppendQuantized(ksrc, in.dtype, pos, m, kidx, tk, bits, g, /*keys=*/true, &scratch, &w);
    }
    AppendFullRows(ksrc, pos + m, r, &w);
    w.Pad();
    if (bits == 0) {
      AppendRows(vsrc, pos, m, vidx, tv, &w);
      w.Pad();
    } else {
      AppendQuantized(vsrc, in.dtype, pos, m, vidx, tv, bits, g, /*keys=*/false, &scratch, &w);
    }
    AppendFullRows(vsrc, pos + m, r, &w);
    w.Pad();
    if (w.size() - section != layout.size) {
      return absl::InternalError(absl::StrCat("PackLayer: head ", h, " section is ",
                                              w.size() - section, " bytes, layout says ",
                                              layout.size));
    }
  }
  return out;
}

}  // namespace kvc

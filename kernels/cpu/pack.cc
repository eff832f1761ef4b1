// PackLayer and the parallel writer behind it (cpu/pack.h): the engine's writer of the compact
// format (kvc/compact.h). The format's layout, PackedSize and InPlaceLayer are in kernels/core
// (compact_layout.h, compact_write.cc); the reader side (CompactLayerView, DENSE export) is in
// core/compact_view.cc.

#include "cpu/pack.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/compact_layout.h"
#include "core/compact_write.h"
#include "core/quantize.h"
#include "cpu/gather.h"
#include "kvc/compact.h"
#include "kvc/convert.h"
#include "kvc/selection.h"
#include "kvc/status_macros.h"
#include "kvc/thread_pool.h"

namespace kvc {
namespace {

using internal::ComputeHeadLayout;
using internal::HeadLayout;
using internal::PadBlock;
using internal::PutBlock;
using internal::RecentCount;
using internal::WriteLayerMeta;

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
  if (tokens.ragged()) {
    if (tokens.counts.size() != static_cast<size_t>(s.num_kv_heads)) {
      return absl::InvalidArgumentError(absl::StrCat("tokens.counts: size ", tokens.counts.size(),
                                                     " != num_kv_heads ", s.num_kv_heads));
    }
    size_t sum = 0;
    for (int h = 0; h < s.num_kv_heads; ++h) {
      if (tokens.counts[h] < 1 || tokens.counts[h] > s.seq_len) {
        return absl::InvalidArgumentError(absl::StrCat("tokens.counts[", h, "]: ", tokens.counts[h],
                                                       " is outside [1, seq_len ", s.seq_len, "]"));
      }
      sum += static_cast<size_t>(tokens.counts[h]);
    }
    if (tokens.positions.size() != sum) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tokens.positions: size ", tokens.positions.size(), " != sum of counts = ", sum));
    }
  } else {
    if (tokens.budget < 1 || tokens.budget > s.seq_len) {
      return absl::InvalidArgumentError(absl::StrCat("tokens.budget: ", tokens.budget,
                                                     " is outside [1, seq_len ", s.seq_len, "]"));
    }
    const size_t want = static_cast<size_t>(s.num_kv_heads) * tokens.budget;
    if (tokens.positions.size() != want) {
      return absl::InvalidArgumentError(absl::StrCat("tokens.positions: size ",
                                                     tokens.positions.size(),
                                                     " != num_kv_heads * budget = ", want));
    }
  }
  for (int h = 0; h < s.num_kv_heads; ++h) {
    RETURN_IF_ERROR(CheckAscending(tokens.head(h), tokens.count(h), s.seq_len, "tokens.positions",
                                   "seq_len", h));
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
  const int vbits = spec.quant.value_bits;
  if ((vbits != 0 && vbits != 2 && vbits != 4 && vbits != 8) || (vbits > 0 && bits == 0)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.quant.value_bits: ", vbits,
                                                   " is not 0, 2, 4 or 8 with bits > 0"));
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

// Copies full rows for positions pos[0..n) to dst ([n, D]). In HND, runs of consecutive
// positions are contiguous in memory and are copied with one memcpy.
void CopyFullRows(const RowSource& src, const int32_t* pos, int n, uint8_t* dst) {
  const size_t row_bytes = static_cast<size_t>(src.head_dim) * src.elem;
  int i = 0;
  while (i < n) {
    if (i + kPrefetchRows < n) PrefetchRow(src.row(pos[i + kPrefetchRows]), row_bytes);
    int j = i + 1;
    if (src.layout == Layout::kHND) {
      while (j < n && pos[j] == pos[j - 1] + 1) ++j;
    }
    const size_t bytes = row_bytes * static_cast<size_t>(j - i);
    std::memcpy(dst, src.row(pos[i]), bytes);
    dst += bytes;
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

// Writes rows pos[0..n) restricted to channels idx[0..t) in the source dtype to dst ([n, t]).
void GatherRows(const RowSource& src, const int32_t* pos, int n, const int32_t* idx, int t,
                uint8_t* dst) {
  if (t == src.head_dim) {  // strictly ascending and t == D: identity
    CopyFullRows(src, pos, n, dst);
    return;
  }
  if (src.elem == 4) {
    GatherChannels(src, pos, n, idx, t, reinterpret_cast<uint32_t*>(dst));
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  const gather::Plan16 plan = gather::MakePlan16(idx, t, src.head_dim);
  const size_t row_bytes = static_cast<size_t>(src.head_dim) * src.elem;
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetchRows < n) PrefetchRow(src.row(pos[i + kPrefetchRows]), row_bytes);
    const auto* row = reinterpret_cast<const uint16_t*>(src.row(pos[i]));
    uint16_t* o = out + static_cast<size_t>(i) * t;
    // Rows are written in order, so a row may spill into the rows after it as long as they
    // cover the spill; only the last few rows take the exact (slower) path.
    if (static_cast<int64_t>(n - 1 - i) * t >= gather::kGather16Slack) {
      gather::GatherRow16Slack(row, plan, o);
    } else {
      gather::GatherRow16(row, plan, o);
    }
  }
}

// Per-thread buffers of the quantize path, grown on demand and kept, so that a task does not
// allocate (and page-fault) on every call.
struct QuantScratch {
  std::vector<float> x, row;
  static QuantScratch& ForThisThread() {
    thread_local QuantScratch scratch;
    return scratch;
  }
};

// Gathers rows pos[0..n), channels idx[0..t), converted to fp32: [n, t]; pos has prefetch_n >= n
// rows, which are prefetched ahead across the caller's chunks. Whole rows are
// converted with the vectorized ToFloat (F16C where available) and then picked from, which is
// much cheaper than converting element by element through the scalar half decoder.
void GatherFloat(const RowSource& src, DType dtype, const int32_t* pos, int n, int prefetch_n,
                 const int32_t* idx, int t, std::vector<float>* row, float* out) {
  const bool all = t == src.head_dim;  // idx is then the identity
  row->resize(src.head_dim);
  const size_t row_bytes = static_cast<size_t>(src.head_dim) * src.elem;
  for (int i = 0; i < n; ++i) {
    if (i + kPrefetchRows < prefetch_n) PrefetchRow(src.row(pos[i + kPrefetchRows]), row_bytes);
    float* o = out + static_cast<size_t>(i) * t;
    if (all) {
      ToFloat(src.row(pos[i]), dtype, t, o);
      continue;
    }
    ToFloat(src.row(pos[i]), dtype, src.head_dim, row->data());
    for (int c = 0; c < t; ++c) o[c] = (*row)[idx[c]];
  }
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// One head's counts and section layout (heads differ when the token selection is ragged).
struct HeadPlan {
  HeadLayout layout;
  int n_kept = 0, r = 0, m = 0;
  size_t section = 0;         // offset of the section from the blob start
  size_t first_position = 0;  // index of the head's first entry in tokens->positions
};

// Everything a pack task needs; read-only while the tasks run.
struct PackPlan {
  const LayerInput* in;
  const TokenSelection* tokens;
  const ChannelSelection* channels;
  const int32_t* identity;  // 0..D-1, for channel lists that are empty (all channels kept)
  std::vector<HeadPlan> heads;
  int tk, tv, kbits, vbits, g;  // kbits, vbits: the keys' and the values' bits
  size_t elem;
  uint8_t* blob;

  const int32_t* ChannelList(bool values, int h) const {
    const std::vector<int32_t>& idx = values ? channels->value_idx : channels->key_idx;
    const int t = values ? tv : tk;
    return idx.empty() ? identity : idx.data() + static_cast<size_t>(h) * t;
  }
};

// Writes the quantized old block (scale, zero, codes; each padded) of keys or values straight into
// the section. Returns the seconds spent quantizing (the fp32 gather before it is not counted).
double WriteQuantized(const PackPlan& p, const HeadPlan& hp, const RowSource& src,
                      const int32_t* pos, const int32_t* idx, int t, bool values,
                      uint8_t* section) {
  const HeadLayout& l = hp.layout;
  const int m = hp.m;
  const size_t scale_at = values ? l.value_scale : l.key_scale;
  const size_t zero_at = values ? l.value_zero : l.key_zero;
  const size_t codes_at = values ? l.value_codes : l.key_codes;
  // Block offsets are 16-byte aligned within a blob that operator new aligned to 16 bytes.
  auto* scale = reinterpret_cast<float*>(section + scale_at);
  auto* zero = reinterpret_cast<float*>(section + zero_at);
  uint8_t* codes = section + codes_at;
  const int bits = values ? p.vbits : p.kbits;
  const size_t code_row = quant::CodeRowBytes(t, bits);
  const size_t value_groups = static_cast<size_t>(quant::NumGroups(t, p.g));
  // Rows are converted and quantized a chunk at a time, so the fp32 copy stays in L1/L2 instead
  // of making a round trip through memory. Values are quantized per row and keys per group of g
  // rows; key chunks are whole groups, so every group sees exactly the rows it would see in one
  // call over the whole block and the bytes do not depend on the chunking.
  constexpr size_t kChunkFloats = 8192;  // 32 KiB of fp32 rows
  // int64_t: with a huge g (up to INT32_MAX) a chunk is one group and first + chunk must not wrap.
  int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(kChunkFloats / static_cast<size_t>(t)));
  if (!values) chunk = p.g * std::max<int64_t>(1, chunk / p.g);
  QuantScratch& s = QuantScratch::ForThisThread();
  s.x.resize(static_cast<size_t>(std::min<int64_t>(chunk, m)) * t);
  double seconds = 0;
  for (int64_t first = 0; first < m; first += chunk) {
    const int r0 = static_cast<int>(first);
    const int rows = static_cast<int>(std::min<int64_t>(chunk, m - first));
    GatherFloat(src, p.in->dtype, pos + r0, rows, m - r0, idx, t, &s.row, s.x.data());
    const auto start = std::chrono::steady_clock::now();
    if (values) {
      const size_t at = static_cast<size_t>(r0) * value_groups;
      quant::QuantizeValues(s.x.data(), rows, t, bits, p.g, scale + at, zero + at,
                            codes + static_cast<size_t>(r0) * code_row);
    } else {
      const size_t at = static_cast<size_t>(r0 / p.g) * t;
      quant::QuantizeKeys(s.x.data(), rows, t, bits, p.g, scale + at, zero + at,
                          codes + static_cast<size_t>(r0) * code_row);
    }
    seconds += SecondsSince(start);
  }
  const size_t params = values ? static_cast<size_t>(m) * value_groups
                               : static_cast<size_t>(quant::NumGroups(m, p.g)) * t;
  PadBlock(section, scale_at, params * sizeof(float));
  PadBlock(section, zero_at, params * sizeof(float));
  PadBlock(section, codes_at, static_cast<size_t>(m) * code_row);
  return seconds;
}

// One task: the key half (positions, key_idx, old and recent keys) or the value half (value_idx,
// old and recent values) of head h's section. The halves are disjoint byte ranges, so tasks never
// write the same byte. Returns the seconds spent quantizing.
double WriteHalf(const PackPlan& p, int h, bool values) {
  const LayerInput& in = *p.in;
  const HeadPlan& hp = p.heads[h];
  const HeadLayout& l = hp.layout;
  const int d = in.shape.head_dim;
  uint8_t* section = p.blob + hp.section;
  const int32_t* pos = p.tokens->positions.data() + hp.first_position;
  const int32_t* idx = p.ChannelList(values, h);
  const int t = values ? p.tv : p.tk;
  const RowSource src{static_cast<const uint8_t*>(values ? in.v : in.k),
                      in.layout,
                      in.shape.num_kv_heads,
                      in.shape.seq_len,
                      d,
                      p.elem,
                      h};
  if (values) {
    PutBlock(section, l.value_idx, idx, sizeof(int32_t) * t);
  } else {
    PutBlock(section, l.positions, pos, sizeof(int32_t) * hp.n_kept);
    PutBlock(section, l.key_idx, idx, sizeof(int32_t) * t);
  }
  double quantize_seconds = 0;
  if ((values ? p.vbits : p.kbits) == 0) {
    const size_t old_at = values ? l.value_old : l.key_old;
    GatherRows(src, pos, hp.m, idx, t, section + old_at);
    PadBlock(section, old_at, static_cast<size_t>(hp.m) * t * p.elem);
  } else {
    quantize_seconds = WriteQuantized(p, hp, src, pos, idx, t, values, section);
  }
  const size_t recent_at = values ? l.value_recent : l.key_recent;
  CopyFullRows(src, pos + hp.m, hp.r, section + recent_at);
  PadBlock(section, recent_at, static_cast<size_t>(hp.r) * d * p.elem);
  return quantize_seconds;
}

}  // namespace

absl::StatusOr<CompactLayer> PackLayer(const LayerInput& in, const TokenSelection& tokens,
                                       const ChannelSelection& channels,
                                       const CompressionSpec& spec) {
  return cpu::PackLayerImpl(in, tokens, channels, spec, /*pool=*/nullptr, /*work=*/nullptr);
}

namespace cpu {

absl::StatusOr<CompactLayer> PackLayerImpl(const LayerInput& in, const TokenSelection& tokens,
                                           const ChannelSelection& channels,
                                           const CompressionSpec& spec, ThreadPool* pool,
                                           PackWork* work) {
  RETURN_IF_ERROR(CheckPackInputs(in, tokens, channels, spec));
  const LayerShape& s = in.shape;
  const int heads = s.num_kv_heads, d = s.head_dim;
  PackPlan p;
  p.in = &in;
  p.tokens = &tokens;
  p.channels = &channels;
  p.tk = channels.key_channels;
  p.tv = channels.value_channels;
  p.kbits = KeyBits(spec.quant);
  p.vbits = ValueBits(spec.quant);
  p.g = p.kbits > 0 ? spec.quant.group_size : 0;
  p.elem = DTypeSize(in.dtype);
  // Sections back to back in head order; with a ragged selection each head has its own counts.
  p.heads.resize(heads);
  size_t total = internal::SectionsBegin(heads), first_position = 0;
  for (int h = 0; h < heads; ++h) {
    HeadPlan& hp = p.heads[h];
    hp.n_kept = tokens.count(h);
    if (h > 0 && hp.n_kept == p.heads[h - 1].n_kept) {
      hp.r = p.heads[h - 1].r;
      hp.layout = p.heads[h - 1].layout;
    } else {
      hp.r = RecentCount(hp.n_kept, p.tk, p.tv, d, spec);
      hp.layout = ComputeHeadLayout(hp.n_kept, hp.r, p.tk, p.tv, d, p.elem, p.kbits, p.vbits,
                                    p.g);
    }
    hp.m = hp.n_kept - hp.r;
    hp.section = total;
    hp.first_position = first_position;
    total += hp.layout.size;
    first_position += static_cast<size_t>(hp.n_kept);
  }

  // Identity channel lists are materialized once (the blob always stores the indices).
  std::vector<int32_t> identity(d);
  for (int c = 0; c < d; ++c) identity[c] = c;
  p.identity = identity.data();

  // Every section offset is known up front (from the counts), so the buffer is
  // sized once and each task writes its own byte range in place. ByteVector's resize does not
  // zero-fill (the header, the descriptors and every block with its padding are written below),
  // and a large blob is a huge-page block from the buffer pool (kvc/bytes.h), reused memory when
  // the pool holds one of this size.
  CompactLayer out;
  try {
    out.bytes.resize(total);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate ", total, " bytes for layer ", in.layer_index));
  }
  uint8_t* blob = out.bytes.data();
  p.blob = blob;

  WriteLayerMeta(
      s, in.dtype, in.layer_index, spec, [&p](int h) { return p.heads[h].n_kept; },
      [&p](int h) { return p.heads[h].r; }, p.tk, p.tv,
      [&p](int h) { return p.heads[h].layout.size; }, blob);

  // Task i writes half i % 2 (keys, values) of head i / 2. Each task records its own times in its
  // own slot, so no synchronization is needed beyond ParallelFor's join.
  const int tasks = 2 * heads;
  std::vector<double> task_seconds(tasks), quantize_seconds(tasks);
  auto run = [&](int i) {
    const auto start = std::chrono::steady_clock::now();
    quantize_seconds[i] = WriteHalf(p, i / 2, (i % 2) != 0);
    task_seconds[i] = SecondsSince(start);
  };
  if (pool != nullptr && pool->num_threads() > 1) {
    pool->ParallelFor(tasks, run);
  } else {
    for (int i = 0; i < tasks; ++i) run(i);
  }
  if (work != nullptr) {
    *work = PackWork{};
    for (int i = 0; i < tasks; ++i) {
      work->task_seconds += task_seconds[i];
      work->quantize_seconds += quantize_seconds[i];
    }
  }
  return out;
}

}  // namespace cpu
}  // namespace kvc

// The reader side of the compact format: validation (CompactLayerView::Parse), head pointers,
// DENSE export and float unpacking.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/compact_layout.h"
#include "core/quantize.h"
#include "kvc/compact.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/status_macros.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KVC_COMPACT_X86 1
#endif

namespace kvc {
namespace {

using internal::ComputeHeadLayout;
using internal::HeadLayout;

absl::Status Corrupt(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("compact layer: ", what));
}

absl::Status CheckRange(int value, int lo, int hi, absl::string_view field) {
  if (value < lo || value > hi) {
    return Corrupt(absl::StrCat(field, " ", value, " is outside [", lo, ", ", hi, "]"));
  }
  return absl::OkStatus();
}

// Strictly ascending and inside [0, limit). Reads through memcpy: the caller has checked that
// the n values lie inside the blob.
absl::Status CheckIndexList(const uint8_t* p, int n, int limit, int h, absl::string_view field,
                            absl::string_view limit_name) {
  int32_t prev = -1;
  for (int i = 0; i < n; ++i) {
    int32_t v;
    std::memcpy(&v, p + sizeof(int32_t) * i, sizeof(v));
    if (v < 0 || v >= limit) {
      return Corrupt(absl::StrCat("head ", h, " ", field, "[", i, "] = ", v, " is outside [0, ",
                                  limit_name, " ", limit, ")"));
    }
    if (v <= prev) {
      return Corrupt(absl::StrCat("head ", h, " ", field, "[", i, "] = ", v,
                                  " is not strictly ascending (previous ", prev, ")"));
    }
    prev = v;
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<CompactLayerView> CompactLayerView::Parse(absl::Span<const uint8_t> blob) {
  if (blob.size() < sizeof(LayerHeader)) {
    return Corrupt(absl::StrCat("blob of ", blob.size(), " bytes is shorter than the ",
                                sizeof(LayerHeader), "-byte header (truncated)"));
  }
  // Head pointers hand out int32/float/uint64 views, so the blob start must be 8-byte aligned
  // (blocks are aligned relative to it). Vectors and gRPC slices of this size always are.
  if (reinterpret_cast<uintptr_t>(blob.data()) % alignof(HeadDesc) != 0) {
    return Corrupt("blob data is not 8-byte aligned; copy it into an aligned buffer");
  }
  CompactLayerView view;
  view.blob_ = blob;
  std::memcpy(&view.header_, blob.data(), sizeof(LayerHeader));
  const LayerHeader& hd = view.header_;
  if (hd.magic != kCompactMagic) {
    return Corrupt(absl::StrCat("magic 0x", absl::Hex(hd.magic), " is not 0x",
                                absl::Hex(kCompactMagic), " (not a kvc compact layer)"));
  }
  if (hd.version != kCompactVersion && hd.version != kCompactVersionValueBits) {
    return Corrupt(absl::StrCat("version ", hd.version, " is not supported (expected ",
                                kCompactVersion, " or ", kCompactVersionValueBits, ")"));
  }
  if (hd.dtype > static_cast<uint8_t>(DType::kBF16)) {
    return Corrupt(absl::StrCat("dtype ", static_cast<int>(hd.dtype), " is unknown"));
  }
  const int bits = hd.quant_bits;
  if (bits != 0 && bits != 2 && bits != 4 && bits != 8) {
    return Corrupt(absl::StrCat("quant_bits ", bits, " is not 0, 2, 4 or 8"));
  }
  if (hd.version == kCompactVersion && hd.value_quant_bits != 0) {
    return Corrupt(absl::StrCat("value_quant_bits ", static_cast<int>(hd.value_quant_bits),
                                " in a version ", kCompactVersion, " blob (must be 0)"));
  }
  if (hd.version == kCompactVersionValueBits) {
    const int vbits = hd.value_quant_bits;
    if (bits == 0 || (vbits != 2 && vbits != 4 && vbits != 8) || vbits == bits) {
      return Corrupt(absl::StrCat("value_quant_bits ", vbits, " with quant_bits ", bits,
                                  " (version ", kCompactVersionValueBits,
                                  " needs both quantized, with different bits)"));
    }
  }
  if (bits > 0 && hd.quant_group < 1) {
    return Corrupt(absl::StrCat("quant_group ", hd.quant_group, " must be >= 1 when quantized"));
  }
  RETURN_IF_ERROR(CheckRange(hd.head_dim, kMinHeadDim, kMaxHeadDim, "head_dim"));
  if (hd.seq_len < 1) return Corrupt(absl::StrCat("seq_len ", hd.seq_len, " must be >= 1"));
  const size_t max_heads = (blob.size() - sizeof(LayerHeader)) / sizeof(HeadDesc);
  if (hd.num_kv_heads < 1 || static_cast<size_t>(hd.num_kv_heads) > max_heads) {
    return Corrupt(absl::StrCat("num_kv_heads ", hd.num_kv_heads, " is < 1 or its descriptors ",
                                "do not fit in the ", blob.size(), "-byte blob (truncated)"));
  }
  const int d = hd.head_dim;
  const size_t elem = DTypeSize(static_cast<DType>(hd.dtype));
  view.descs_ = reinterpret_cast<const HeadDesc*>(blob.data() + sizeof(LayerHeader));
  size_t expected_offset = internal::SectionsBegin(hd.num_kv_heads);
  for (int h = 0; h < hd.num_kv_heads; ++h) {
    const HeadDesc& desc = view.descs_[h];
    const std::string where = absl::StrCat("head ", h, " ");
    RETURN_IF_ERROR(CheckRange(desc.n_kept, 0, hd.seq_len, where + "n_kept"));
    RETURN_IF_ERROR(CheckRange(desc.n_recent, 0, desc.n_kept, where + "n_recent"));
    RETURN_IF_ERROR(CheckRange(desc.key_channels, 1, d, where + "key_channels"));
    RETURN_IF_ERROR(CheckRange(desc.value_channels, 1, d, where + "value_channels"));
    // Sections follow the descriptor table in head order, back to back: this rules out overlap
    // and gaps, and keeps every section 16-byte aligned.
    if (desc.offset != expected_offset) {
      return Corrupt(absl::StrCat(where, "offset ", desc.offset, " != expected ", expected_offset,
                                  " (sections must be contiguous in order)"));
    }
    const HeadLayout l =
        ComputeHeadLayout(desc.n_kept, desc.n_recent, desc.key_channels, desc.value_channels, d,
                          elem, bits, view.value_bits(), hd.quant_group);
    if (desc.size != l.size) {
      return Corrupt(
          absl::StrCat(where, "size ", desc.size, " != ", l.size, " implied by its counts"));
    }
    if (desc.offset > blob.size() || desc.size > blob.size() - desc.offset) {
      return Corrupt(absl::StrCat(where, "section [", desc.offset, ", +", desc.size,
                                  ") runs past the ", blob.size(), "-byte blob (truncated)"));
    }
    const uint8_t* sec = blob.data() + desc.offset;
    RETURN_IF_ERROR(
        CheckIndexList(sec + l.positions, desc.n_kept, hd.seq_len, h, "positions", "seq_len"));
    RETURN_IF_ERROR(
        CheckIndexList(sec + l.key_idx, desc.key_channels, d, h, "key_idx", "head_dim"));
    RETURN_IF_ERROR(
        CheckIndexList(sec + l.value_idx, desc.value_channels, d, h, "value_idx", "head_dim"));
    expected_offset += desc.size;
  }
  if (expected_offset != blob.size()) {
    return Corrupt(absl::StrCat("blob is ", blob.size(), " bytes but its head sections end at ",
                                expected_offset));
  }
  return view;
}

CompactHead CompactLayerView::head(int h) const {
  const HeadDesc& desc = descs_[h];
  const HeadLayout l = ComputeHeadLayout(desc.n_kept, desc.n_recent, desc.key_channels,
                                         desc.value_channels, header_.head_dim, DTypeSize(dtype()),
                                         key_bits(), value_bits(), header_.quant_group);
  const uint8_t* sec = blob_.data() + desc.offset;
  CompactHead out;
  out.n_kept = desc.n_kept;
  out.n_recent = desc.n_recent;
  out.key_channels = desc.key_channels;
  out.value_channels = desc.value_channels;
  out.positions = reinterpret_cast<const int32_t*>(sec + l.positions);
  out.key_idx = reinterpret_cast<const int32_t*>(sec + l.key_idx);
  out.value_idx = reinterpret_cast<const int32_t*>(sec + l.value_idx);
  if (key_bits() == 0) {
    out.key_old = sec + l.key_old;
  } else {
    out.key_scale = reinterpret_cast<const float*>(sec + l.key_scale);
    out.key_zero = reinterpret_cast<const float*>(sec + l.key_zero);
    out.key_codes = sec + l.key_codes;
  }
  if (value_bits() == 0) {
    out.value_old = sec + l.value_old;
  } else {
    out.value_scale = reinterpret_cast<const float*>(sec + l.value_scale);
    out.value_zero = reinterpret_cast<const float*>(sec + l.value_zero);
    out.value_codes = sec + l.value_codes;
  }
  out.key_recent = sec + l.key_recent;
  out.value_recent = sec + l.value_recent;
  return out;
}

namespace {

// Rows [0, m) of t kept channels (elements of kElem bytes, channel c of a row going to channel
// idx[c], idx ascending below d) from src into full rows of d at dst, the other channels +0.
template <size_t kElem>
void ScatterRowsScalar(const uint8_t* src, int j0, int m, int t, int d, const int32_t* idx,
                       uint8_t* dst) {
  for (int j = j0; j < m; ++j) {
    const uint8_t* row = src + static_cast<size_t>(j) * t * kElem;
    uint8_t* out = dst + static_cast<size_t>(j) * d * kElem;
    std::memset(out, 0, static_cast<size_t>(d) * kElem);
    for (int c = 0; c < t; ++c) std::memcpy(out + idx[c] * kElem, row + c * kElem, kElem);
  }
}

#ifdef KVC_COMPACT_X86
// The same, 16 bytes of output at a time (8 fp16/bf16 or 4 fp32 channels): each 16-byte chunk
// of an output row takes the next kept elements of the source row through one byte shuffle whose
// control the chunk's kept-channel mask picks from a table (zero bytes where a channel was
// pruned). A chunk reads 16 source bytes from its first kept element, which may run past the row:
// rows whose reads could pass the end of the block take the scalar loop.
template <size_t kElem>
struct ExpandControls {
  static constexpr int kLanes = 16 / kElem;
  uint8_t ctl[1 << kLanes][16];
  ExpandControls() {
    for (int mask = 0; mask < (1 << kLanes); ++mask) {
      for (int lane = 0, next = 0; lane < kLanes; ++lane) {
        const bool kept = (mask >> lane) & 1;
        for (size_t b = 0; b < kElem; ++b) {
          ctl[mask][lane * kElem + b] = kept ? static_cast<uint8_t>(next * kElem + b) : 0x80;
        }
        next += kept;
      }
    }
  }
};

template <size_t kElem>
__attribute__((target("ssse3"))) void ScatterRowsShuffle(const uint8_t* src, int m, int t, int d,
                                                         const int32_t* idx, uint8_t* dst) {
  static const ExpandControls<kElem> table;
  constexpr int kLanes = ExpandControls<kElem>::kLanes;
  const int chunks = d / kLanes;
  std::vector<uint8_t> mask(chunks, 0);
  // The source element a chunk reads from: its first kept element; a chunk that keeps nothing
  // reads the row's start (its control is all zeroing bytes) and never past the last kept one.
  std::vector<int> first(chunks, 0);
  for (int c = 0; c < t; ++c) mask[idx[c] / kLanes] |= 1u << (idx[c] % kLanes);
  size_t read_end = 16;  // bytes past a row's start that its chunks read
  for (int k = 0, kept = 0; k < chunks; ++k) {
    if (mask[k] == 0) continue;
    first[k] = kept;
    kept += __builtin_popcount(mask[k]);
    read_end = std::max(read_end, first[k] * kElem + 16);
  }
  const size_t row_bytes = static_cast<size_t>(t) * kElem, block = m * row_bytes;
  int safe = 0;  // rows [0, safe) read only inside the block
  if (block >= read_end) safe = std::min<size_t>(m, (block - read_end) / row_bytes + 1);
  for (int j = 0; j < safe; ++j) {
    const uint8_t* row = src + j * row_bytes;
    uint8_t* out = dst + static_cast<size_t>(j) * d * kElem;
    for (int k = 0; k < chunks; ++k) {
      const __m128i ctl = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table.ctl[mask[k]]));
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + first[k] * kElem));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k * 16), _mm_shuffle_epi8(x, ctl));
    }
  }
  ScatterRowsScalar<kElem>(src, safe, m, t, d, idx, dst);
}
#endif

template <size_t kElem>
void ScatterRows(const uint8_t* src, int m, int t, int d, const int32_t* idx, uint8_t* dst) {
#ifdef KVC_COMPACT_X86
  if (CpuIsaAtLeast(CpuIsa::kAvx2) && d % (16 / kElem) == 0) {
    return ScatterRowsShuffle<kElem>(src, m, t, d, idx, dst);
  }
#endif
  ScatterRowsScalar<kElem>(src, 0, m, t, d, idx, dst);
}

// Writes the old block of one tensor (keys or values) as full-D rows in the blob dtype, pruned
// channels +0 (every byte of the m rows written). Without quantization the elements are copied
// bit for bit.
void ScatterOld(const CompactLayerView& view, const CompactHead& hd, bool keys, uint8_t* dst) {
  const int d = view.head_dim();
  const int m = hd.n_kept - hd.n_recent;
  const int t = keys ? hd.key_channels : hd.value_channels;
  const int32_t* idx = keys ? hd.key_idx : hd.value_idx;
  const DType dt = view.dtype();
  const size_t elem = DTypeSize(dt);
  const int bits = keys ? view.key_bits() : view.value_bits();
  bool all_in_order = t == d;
  for (int c = 0; all_in_order && c < t; ++c) all_in_order = idx[c] == c;
  if (bits == 0) {
    const uint8_t* src = static_cast<const uint8_t*>(keys ? hd.key_old : hd.value_old);
    if (all_in_order) {  // nothing pruned: the rows are already full-D
      std::memcpy(dst, src, static_cast<size_t>(m) * d * elem);
      return;
    }
    // The element size a constant (DTypeSize is 2 or 4): a load and a store per element, no call.
    if (elem == 2) return ScatterRows<2>(src, m, t, d, idx, dst);
    return ScatterRows<4>(src, m, t, d, idx, dst);
  }
  // Each row dequantized into floats, then written whole by the bulk conversion (kvc/convert.h,
  // bit-identical to StoreFromFloat element by element, which cost several times the rest):
  // with pruned channels through a full-D row whose other channels are +0. Nothing pruned: the
  // head's rows in one call, which takes the fused kernels where they fit
  // (quant::DequantizeKeysTo).
  const int g = view.header().quant_group;
  if (all_in_order) {
    if (keys) {
      quant::DequantizeKeysTo(hd.key_scale, hd.key_zero, hd.key_codes, m, t, bits, g, dt, dst);
    } else {
      quant::DequantizeValuesTo(hd.value_scale, hd.value_zero, hd.value_codes, m, t, bits, g, dt,
                                dst);
    }
    return;
  }
  std::vector<float> row(t), full(d, 0.0f);
  for (int j = 0; j < m; ++j) {
    if (keys) {
      quant::DequantizeKeyRow(hd.key_scale, hd.key_zero, hd.key_codes, j, t, bits, g, row.data());
    } else {
      quant::DequantizeValueRow(hd.value_scale, hd.value_zero, hd.value_codes, j, t, bits, g,
                                row.data());
    }
    for (int c = 0; c < t; ++c) full[idx[c]] = row[c];
    FromFloat(full.data(), dt, static_cast<size_t>(d), dst + static_cast<size_t>(j) * d * elem);
  }
}

// AllocateDenseExport without the allocation failure's status.
DenseLayer AllocateDense(const CompactLayerView& view, bool values) {
  DenseLayer out;
  out.num_kv_heads = view.num_kv_heads();
  out.head_dim = view.head_dim();
  out.seq_len = view.seq_len();
  out.dtype = view.dtype();
  out.counts.resize(out.num_kv_heads);
  for (int h = 0; h < out.num_kv_heads; ++h) {
    out.counts[h] = view.desc(h).n_kept;
    out.n_kept = std::max(out.n_kept, out.counts[h]);
  }
  const size_t head_bytes =
      static_cast<size_t>(out.n_kept) * out.head_dim * DTypeSize(out.dtype);
  out.k.resize(head_bytes * out.num_kv_heads);
  if (values) {
    out.v.resize(head_bytes * out.num_kv_heads);
    out.positions.resize(static_cast<size_t>(out.n_kept) * out.num_kv_heads);
  }
  return out;
}

// One head's keys, or its values and positions, as ExportDense writes them.
void WriteDenseHead(const CompactLayerView& view, int h, bool keys, DenseLayer* out) {
  const size_t row_bytes = static_cast<size_t>(out->head_dim) * DTypeSize(out->dtype);
  const size_t head_bytes = static_cast<size_t>(out->n_kept) * row_bytes;
  const CompactHead hd = view.head(h);
  const int m = hd.n_kept - hd.n_recent;
  const size_t pad = static_cast<size_t>(out->n_kept - hd.n_kept) * row_bytes;
  uint8_t* rows = (keys ? out->k.data() : out->v.data()) + h * head_bytes;
  ScatterOld(view, hd, keys, rows);
  std::memcpy(rows + m * row_bytes, keys ? hd.key_recent : hd.value_recent,
              hd.n_recent * row_bytes);
  std::memset(rows + hd.n_kept * row_bytes, 0, pad);
  if (keys) return;
  int32_t* pos = out->positions.data() + static_cast<size_t>(h) * out->n_kept;
  std::memcpy(pos, hd.positions, sizeof(int32_t) * hd.n_kept);
  std::fill(pos + hd.n_kept, pos + out->n_kept, -1);
}

// The constant bytes a ragged head's padding is sent from: zeros for K and V rows, 0xff for
// positions (-1 in int32). A padding longer than one buffer takes several spans of it.
constexpr size_t kPaddingBytes = size_t{1} << 20;
const uint8_t* PaddingBuffer(bool ones) {
  static const auto* buffers = [] {
    auto* b = new uint8_t[2 * kPaddingBytes];
    std::memset(b, 0, kPaddingBytes);
    std::memset(b + kPaddingBytes, 0xff, kPaddingBytes);
    return b;
  }();
  return buffers + (ones ? kPaddingBytes : 0);
}

// Appends `bytes` of the blob at `at` to `to`, merged with the run before when adjacent in the
// blob.
void AddRun(std::vector<absl::Span<const uint8_t>>* to, const void* at, size_t bytes) {
  if (bytes == 0) return;
  const auto* p = static_cast<const uint8_t*>(at);
  if (!to->empty() && !IsDensePadding(to->back()) &&
      to->back().data() + to->back().size() == p) {
    to->back() = absl::MakeConstSpan(to->back().data(), to->back().size() + bytes);
  } else {
    to->push_back(absl::MakeConstSpan(p, bytes));
  }
}

// Appends `bytes` of padding (zeros, or 0xff bytes when `ones`) to `to`.
void AddPadding(std::vector<absl::Span<const uint8_t>>* to, size_t bytes, bool ones) {
  for (size_t n; bytes > 0; bytes -= n) {
    n = std::min(bytes, kPaddingBytes);
    to->push_back(absl::MakeConstSpan(PaddingBuffer(ones), n));
  }
}

// DenseRunsOf's runs, of the keys too or of the values and positions alone; false where the
// tensors asked for are pruned or anything is quantized.
bool RunsOf(const CompactLayerView& view, bool keys, DenseRuns* runs) {
  *runs = DenseRuns{};
  // Values are never quantized without the keys; a quantized layer is not a run either way.
  if (view.value_bits() != 0 || view.key_bits() != 0) return false;
  const int d = view.head_dim();
  const int n = view.max_kept();
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(view.dtype());
  for (int h = 0; h < view.num_kv_heads(); ++h) {
    const CompactHead hd = view.head(h);
    // Channel indices are strictly ascending below D (Parse), so D of them are all of them.
    if (hd.value_channels != d || (keys && hd.key_channels != d)) {
      *runs = DenseRuns{};
      return false;
    }
    const size_t old_bytes = static_cast<size_t>(hd.n_kept - hd.n_recent) * row_bytes;
    const size_t recent_bytes = static_cast<size_t>(hd.n_recent) * row_bytes;
    const size_t pad_rows = static_cast<size_t>(n - hd.n_kept);
    if (keys) {
      AddRun(&runs->k, hd.key_old, old_bytes);
      AddRun(&runs->k, hd.key_recent, recent_bytes);
      AddPadding(&runs->k, pad_rows * row_bytes, /*ones=*/false);
    }
    AddRun(&runs->v, hd.value_old, old_bytes);
    AddRun(&runs->v, hd.value_recent, recent_bytes);
    AddPadding(&runs->v, pad_rows * row_bytes, /*ones=*/false);
    AddRun(&runs->positions, hd.positions, sizeof(int32_t) * static_cast<size_t>(hd.n_kept));
    AddPadding(&runs->positions, sizeof(int32_t) * pad_rows, /*ones=*/true);
  }
  return true;
}

}  // namespace

DenseExporter::DenseExporter(std::shared_ptr<DenseLayer> layer, bool values, WriteFn write)
    : layer_(std::move(layer)), values_(values), write_(std::move(write)) {}

void DenseExporter::AddStep(WriteFn after) {
  write_ = [write = std::move(write_), after = std::move(after)](int piece, DenseLayer* out) {
    write(piece, out);
    after(piece, out);
  };
}

bool DenseExporter::WriteNext() {
  if (written_ >= pieces()) return false;
  write_(written_, layer_.get());
  ++written_;
  return true;
}

uint64_t DenseExporter::KeyBytesAfter(int n) const {
  const int heads = layer_->num_kv_heads;
  return static_cast<uint64_t>(std::clamp(n, 0, heads)) * (layer_->k.size() / std::max(heads, 1));
}

uint64_t DenseExporter::ValueBytesAfter(int n) const {
  const int heads = layer_->num_kv_heads;
  if (!values_) return 0;
  return static_cast<uint64_t>(std::clamp(n - heads, 0, heads)) *
         (layer_->v.size() / std::max(heads, 1));
}

DenseLayer DenseExporter::Finish() && {
  while (WriteNext()) {
  }
  return std::move(*layer_);
}

absl::StatusOr<std::shared_ptr<DenseLayer>> AllocateDenseExport(const CompactLayerView& view,
                                                                bool values) {
  try {
    return std::make_shared<DenseLayer>(AllocateDense(view, values));
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "layer ", view.header().layer_index, ": cannot allocate its dense export"));
  }
}

absl::StatusOr<DenseExporter> MakeDenseExporter(const CompactLayerView& view, bool values) {
  ASSIGN_OR_RETURN(std::shared_ptr<DenseLayer> layer, AllocateDenseExport(view, values));
  const int heads = layer->num_kv_heads;
  return DenseExporter(std::move(layer), values, [view, heads](int piece, DenseLayer* out) {
    WriteDenseHead(view, piece % heads, /*keys=*/piece < heads, out);
  });
}

absl::StatusOr<DenseLayer> ExportDense(const CompactLayerView& view) {
  ASSIGN_OR_RETURN(DenseExporter exporter, MakeDenseExporter(view, /*values=*/true));
  return std::move(exporter).Finish();
}

absl::StatusOr<DenseLayer> ExportDenseKeys(const CompactLayerView& view) {
  ASSIGN_OR_RETURN(DenseExporter exporter, MakeDenseExporter(view, /*values=*/false));
  return std::move(exporter).Finish();
}

bool DenseRunsOf(const CompactLayerView& view, DenseRuns* runs) {
  return RunsOf(view, /*keys=*/true, runs);
}

bool DenseValueRunsOf(const CompactLayerView& view, DenseRuns* runs) {
  return RunsOf(view, /*keys=*/false, runs);
}

bool IsDensePadding(absl::Span<const uint8_t> run) {
  const auto b = reinterpret_cast<uintptr_t>(PaddingBuffer(false));
  const auto p = reinterpret_cast<uintptr_t>(run.data());
  return p >= b && p < b + 2 * kPaddingBytes;
}

void UnpackHeadToFloat(const CompactLayerView& view, int h, float* keys, float* values) {
  const CompactHead hd = view.head(h);
  const int d = view.head_dim();
  const int m = hd.n_kept - hd.n_recent;
  const DType dt = view.dtype();
  const int kbits = view.key_bits(), vbits = view.value_bits();
  const int g = view.header().quant_group;
  std::fill(keys, keys + static_cast<size_t>(hd.n_kept) * d, 0.0f);
  std::fill(values, values + static_cast<size_t>(hd.n_kept) * d, 0.0f);
  std::vector<float> row(d);
  for (int j = 0; j < m; ++j) {
    float* ko = keys + static_cast<size_t>(j) * d;
    float* vo = values + static_cast<size_t>(j) * d;
    if (kbits == 0) {
      const size_t koff = static_cast<size_t>(j) * hd.key_channels;
      for (int c = 0; c < hd.key_channels; ++c) {
        ko[hd.key_idx[c]] = LoadAsFloat(hd.key_old, dt, koff + c);
      }
    } else {
      quant::DequantizeKeyRow(hd.key_scale, hd.key_zero, hd.key_codes, j, hd.key_channels, kbits,
                              g, row.data());
      for (int c = 0; c < hd.key_channels; ++c) ko[hd.key_idx[c]] = row[c];
    }
    if (vbits == 0) {
      const size_t voff = static_cast<size_t>(j) * hd.value_channels;
      for (int c = 0; c < hd.value_channels; ++c) {
        vo[hd.value_idx[c]] = LoadAsFloat(hd.value_old, dt, voff + c);
      }
    } else {
      quant::DequantizeValueRow(hd.value_scale, hd.value_zero, hd.value_codes, j, hd.value_channels,
                                vbits, g, row.data());
      for (int c = 0; c < hd.value_channels; ++c) vo[hd.value_idx[c]] = row[c];
    }
  }
  for (int j = m; j < hd.n_kept; ++j) {
    const size_t src = static_cast<size_t>(j - m) * d;
    for (int c = 0; c < d; ++c) {
      keys[static_cast<size_t>(j) * d + c] = LoadAsFloat(hd.key_recent, dt, src + c);
      values[static_cast<size_t>(j) * d + c] = LoadAsFloat(hd.value_recent, dt, src + c);
    }
  }
}

}  // namespace kvc

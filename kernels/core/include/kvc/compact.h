// The compact cache: one self-describing byte blob per layer. This is what the store keeps, what
// GetCache(PACKED) sends, and what packed attention reads. Little-endian, every block 16-byte
// aligned relative to the blob start.
//
//   LayerHeader                                   (64 bytes)
//   HeadDesc[num_kv_heads]                        (32 bytes each)
//   per head h, at HeadDesc.offset, in this order (m = n_kept - n_recent, r = n_recent):
//     positions     int32[n_kept]        original prompt positions, strictly ascending
//     key_idx       int32[T_k]           kept key channels, strictly ascending
//     value_idx     int32[T_v]           kept value channels, strictly ascending
//     keys (old)    bits == 0: dtype[m, T_k]
//                   bits  > 0: scale f32[ceil(m/G), T_k], zero f32[ceil(m/G), T_k],
//                              codes u8[m, ceil(T_k*bits/8)]  (per-channel groups of G tokens)
//     keys (recent) dtype[r, D]          all channels, full precision
//     values (old)  vbits == 0: dtype[m, T_v]
//                   vbits  > 0: scale f32[m, ceil(T_v/G)], zero f32[m, ceil(T_v/G)],
//                               codes u8[m, ceil(T_v*vbits/8)]  (per-token groups of G channels)
//     values(recent) dtype[r, D]
// bits is the header's quant_bits; vbits is the same in version 1 blobs and the header's
// value_quant_bits in version 2 ones (written only when the values' bits differ from the keys',
// so a blob quantized alike is byte for byte what version 1 readers know). Both are 0 or neither.
// Dequantized value = code * scale + zero. Codes are packed little-endian within a byte (element 0
// in the lowest bits); each row starts on a byte boundary. Quantization per group of G values:
// scale = (max - min) / (2^bits - 1) (0 for a constant group, whose codes are then 0), zero = min,
// code = round((x - zero) / scale) clamped to [0, 2^bits - 1]; so |x - dequantized| <= scale / 2.
// Head sections follow the descriptor table back to back in head order; each section is padded to
// a multiple of 16 bytes and its size is determined by its counts. Padding bytes are zero.
// r (n_recent) = min(spec.recent_tokens, n_kept) when channel pruning or quantization is on (T_k <
// D, T_v < D or bits > 0), else 0. quant_group is 0 when bits == 0.
#ifndef KVC_COMPACT_H_
#define KVC_COMPACT_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "kvc/bytes.h"
#include "kvc/dtype.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

// Kept token positions per KV head. Uniform (counts empty): every head keeps `budget` tokens and
// positions is [num_kv_heads, budget]. Ragged (counts non-empty, head-adaptive budgets): head h
// keeps counts[h] tokens (1 <= counts[h] <= S), positions holds the heads' lists back to back in
// head order (sum of counts entries) and `budget` is the largest count, so a buffer of `budget`
// entries holds any head's list. Positions are original prompt positions, strictly ascending per
// head. With Granularity::kPerLayer every head holds the same set.
struct TokenSelection {
  int num_kv_heads = 0;
  int budget = 0;  // uniform: kept tokens per head; ragged: max over counts
  std::vector<int32_t> positions;
  std::vector<int> counts;  // [num_kv_heads] when ragged, else empty

  bool ragged() const { return !counts.empty(); }
  int count(int h) const { return counts.empty() ? budget : counts[h]; }
  // Index in `positions` of head h's first entry.
  size_t offset(int h) const {
    if (counts.empty()) return static_cast<size_t>(h) * budget;
    size_t o = 0;
    for (int i = 0; i < h; ++i) o += static_cast<size_t>(counts[i]);
    return o;
  }
  const int32_t* head(int h) const { return positions.data() + offset(h); }
  size_t total() const { return offset(num_kv_heads); }
};

struct ChannelSelection {
  int key_channels = 0;            // T_k (== D when keys are not pruned)
  int value_channels = 0;          // T_v (== D when values are not pruned)
  std::vector<int32_t> key_idx;    // [num_kv_heads, T_k], strictly ascending per head
  std::vector<int32_t> value_idx;  // [num_kv_heads, T_v], strictly ascending per head
};

inline constexpr uint32_t kCompactMagic = 0x4c43564bu;  // "KVCL"
inline constexpr uint16_t kCompactVersion = 1;
// Version 2: version 1 plus value_quant_bits (values quantized with their own bits).
inline constexpr uint16_t kCompactVersionValueBits = 2;

struct LayerHeader {
  uint32_t magic = kCompactMagic;
  uint16_t version = kCompactVersion;
  uint8_t dtype = 0;       // DType of full-precision blocks (the input's dtype)
  uint8_t quant_bits = 0;  // 0, 2, 4, 8
  int32_t layer_index = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;         // D
  int32_t seq_len = 0;          // original prompt length; new tokens continue at this position
  int32_t quant_group = 0;      // G
  uint8_t eviction_policy = 0;  // EvictionPolicy, informational
  uint8_t channel_policy = 0;   // ChannelPolicy, informational
  uint8_t value_quant_bits = 0;  // version 2: the values' bits (2, 4, 8); version 1: 0
  uint8_t reserved[33] = {};
};
static_assert(sizeof(LayerHeader) == 64);

struct HeadDesc {
  int32_t n_kept = 0;
  int32_t n_recent = 0;
  int32_t key_channels = 0;    // T_k
  int32_t value_channels = 0;  // T_v
  uint64_t offset = 0;         // of the head section, from the blob start
  uint64_t size = 0;           // bytes of the head section
};
static_assert(sizeof(HeadDesc) == 32);

// Pointers into a blob for one head. Unused pointers (e.g. scales when bits == 0) are null.
struct CompactHead {
  int n_kept = 0, n_recent = 0, key_channels = 0, value_channels = 0;
  const int32_t* positions = nullptr;
  const int32_t* key_idx = nullptr;
  const int32_t* value_idx = nullptr;
  const void* key_old = nullptr;  // bits == 0
  const float* key_scale = nullptr;
  const float* key_zero = nullptr;
  const uint8_t* key_codes = nullptr;
  const void* key_recent = nullptr;
  const void* value_old = nullptr;  // bits == 0
  const float* value_scale = nullptr;
  const float* value_zero = nullptr;
  const uint8_t* value_codes = nullptr;
  const void* value_recent = nullptr;
};

// Owns one layer's blob. ByteVector (kvc/bytes.h) does not zero-fill on resize; to wrap bytes
// held in a std::vector<uint8_t>, use CompactLayer{ToByteVector(v)}.
struct CompactLayer {
  ByteVector bytes;
};

// A validated, non-owning view of a blob. Parse checks everything a reader relies on (magic,
// version, dtype, bits, head_dim, counts, section offsets and sizes, positions strictly ascending
// and < seq_len, channel indices strictly ascending and < D), so a corrupt or hostile blob yields
// INVALID_ARGUMENT ("compact layer: ..."), never an out-of-range read. The blob must be 8-byte
// aligned (any std::vector or malloc'd buffer is) and must outlive the view. Quantization
// parameters are not checked: NaN scales give NaN values, never a bad read.
// Thread-safe for concurrent readers. head(h) and desc(h) require 0 <= h < num_kv_heads().
class CompactLayerView {
 public:
  static absl::StatusOr<CompactLayerView> Parse(absl::Span<const uint8_t> blob);

  const LayerHeader& header() const { return header_; }
  DType dtype() const { return static_cast<DType>(header_.dtype); }
  int num_kv_heads() const { return header_.num_kv_heads; }
  int head_dim() const { return header_.head_dim; }
  int seq_len() const { return header_.seq_len; }
  const HeadDesc& desc(int h) const { return descs_[h]; }
  // Bits of the old keys and of the old values (both 0 when not quantized).
  int key_bits() const { return header_.quant_bits; }
  int value_bits() const {
    return header_.version == kCompactVersionValueBits ? header_.value_quant_bits
                                                       : header_.quant_bits;
  }
  // The largest n_kept over heads (heads differ with head-adaptive budgets).
  int max_kept() const {
    int n = 0;
    for (int h = 0; h < num_kv_heads(); ++h) n = n > descs_[h].n_kept ? n : descs_[h].n_kept;
    return n;
  }
  CompactHead head(int h) const;
  absl::Span<const uint8_t> blob() const { return blob_; }

 private:
  absl::Span<const uint8_t> blob_;
  LayerHeader header_;
  const HeadDesc* descs_ = nullptr;
};

// Byte size PackLayer (kvc/selection.h) will produce for inputs it accepts (for budgets and
// benchmarks).
size_t PackedSize(const LayerShape& shape, DType dtype, const TokenSelection& tokens,
                  const ChannelSelection& channels, const CompressionSpec& spec);

// Lower bound on the compact size of a whole cache of `num_layers` layers compressed with `spec`
// (blob headers, kept tokens, kept channels, quantized sizes; scales ignored), before any layer
// has arrived: kvcd refuses an upload that can never fit its store with it. Checked integer
// arithmetic: INVALID_ARGUMENT naming the product ("shape: ...") when it does not fit in 64 bits
// (never for a shape ValidateShape accepts with num_layers <= 4096). The spec must be valid.
absl::StatusOr<uint64_t> EstimateStoredBytes(const LayerShape& shape, DType dtype,
                                             const CompressionSpec& spec, int num_layers);

// A layer stored whole, built in place. When a spec keeps every token and channel unquantized
// (KeepsEverything: eviction, key and value pruning all off, bits 0), PackLayer's blob is the
// input's K and V rows verbatim plus metadata. Create writes the metadata (header, descriptors,
// positions, channel lists, padding) into a blob of the final size; Write copies bytes of the K or
// V tensor, addressed as in the input (shape and layout), straight to their place in it, so a
// receiver can place chunks as they arrive with no staging copy and no pack pass. Once every K and
// V byte has been written, Release returns exactly the blob PackLayer would (Q_obs is not part of
// it). Thread-compatible; Writes to disjoint byte ranges may run concurrently.
class InPlaceLayer {
 public:
  static bool KeepsEverything(const CompressionSpec& spec);

  // INVALID_ARGUMENT for a bad shape, dtype or layout, a spec that fails ValidateSpec or does not
  // keep everything (naming the field); RESOURCE_EXHAUSTED when the blob cannot be allocated.
  static absl::StatusOr<InPlaceLayer> Create(const LayerShape& shape, DType dtype, Layout layout,
                                             int layer_index, const CompressionSpec& spec);

  // Bytes of one K or V tensor in the input layout (Hkv * S * D * dtype size).
  uint64_t tensor_bytes() const { return tensor_bytes_; }

  // Copies `size` bytes of tensor K (values == false) or V starting at byte `offset` of that
  // tensor. Requires offset + size <= tensor_bytes() (callers validate chunk ranges first).
  // `placed(blob_offset, src, n)` runs after each contiguous piece lands in the blob, with `src`
  // the piece's bytes in `data`: pieces of 4 KiB or more are written with non-temporal stores
  // (kvc/stream_copy.h; a stored layer is not read again soon), so a caller that hashes them
  // (ingest) reads `src`, which is still in cache. Pieces never cross a multiple of kPieceBytes
  // in the blob, so fixed blocks that divide kPieceBytes are cut only where a run of the input
  // ends.
  static constexpr size_t kPieceBytes = size_t{256} << 10;
  void Write(bool values, uint64_t offset, const uint8_t* data, size_t size,
             absl::FunctionRef<void(size_t blob_offset, const uint8_t* src, size_t n)> placed);
  void Write(bool values, uint64_t offset, const uint8_t* data, size_t size) {
    Write(values, offset, data, size, [](size_t, const uint8_t*, size_t) {});
  }
  const uint8_t* blob() const { return layer_.bytes.data(); }
  size_t blob_bytes() const { return layer_.bytes.size(); }

  CompactLayer Release() && { return std::move(layer_); }

 private:
  InPlaceLayer() = default;

  CompactLayer layer_;
  Layout layout_ = Layout::kHND;
  int heads_ = 0;
  size_t row_bytes_ = 0;     // D * dtype size
  uint64_t head_bytes_ = 0;  // S * row_bytes_: one head's rows, contiguous in HND and the blob
  uint64_t tensor_bytes_ = 0;
  size_t sections_ = 0;  // offset of head 0's section
  size_t section_size_ = 0;
  size_t keys_at_ = 0, values_at_ = 0;  // of the rows within a section
};

// DENSE export: kept tokens with pruned channels zero-filled and quantized blocks dequantized, in
// the blob's dtype, HND [Hkv, n_kept, D]; positions [Hkv, n_kept]. n_kept is the largest count
// over heads: a head that keeps fewer (head-adaptive budgets) has its rows first, then padding
// rows of zeros whose positions are -1. counts[h] is head h's real count (all equal to n_kept for
// a uniform layer).
struct DenseLayer {
  int num_kv_heads = 0, n_kept = 0, head_dim = 0, seq_len = 0;
  DType dtype = DType::kF16;
  ByteVector k, v;  // dtype elements (large ones come from the process's buffer pool)
  std::vector<int32_t> positions;
  std::vector<int> counts;  // [num_kv_heads]
};
absl::StatusOr<DenseLayer> ExportDense(const CompactLayerView& view);

// DENSE export without a copy. When nothing is quantized or pruned (an upload stored whole, or
// evicted only), ExportDense's K, V and positions are runs of the blob's own bytes: head by head,
// the old rows then the recent ones, then, for a head that keeps fewer tokens than the largest
// count (head-adaptive budgets), its padding as spans of constant bytes outside the blob (zeros
// for K and V, 0xff bytes, i.e. -1, for positions; IsDensePadding tells them apart). The runs of
// each, in order, adjacent blob runs merged (empty when the layer keeps no token); false when the
// layer needs ExportDense.
struct DenseRuns {
  std::vector<absl::Span<const uint8_t>> k, v, positions;
};
bool DenseRunsOf(const CompactLayerView& view, DenseRuns* runs);

// True when `run` is a span of DenseRunsOf's constant padding, not of a blob.
bool IsDensePadding(absl::Span<const uint8_t> run);

// DENSE with the values in place. When nothing but key channels is pruned (ThinK on the keys
// alone, its default), ExportDense's V and positions are still runs as DenseRunsOf gives them:
// `runs->v` and `runs->positions`, `runs->k` empty, and ExportDenseKeys exports the rest. false
// (runs empty) when anything is quantized or value channels are pruned.
bool DenseValueRunsOf(const CompactLayerView& view, DenseRuns* runs);

// ExportDense(view)'s keys alone: the shape, counts and `k` as ExportDense fills them; `v` and
// `positions` stay empty.
absl::StatusOr<DenseLayer> ExportDenseKeys(const CompactLayerView& view);

// A DENSE export written piece by piece, so that its first bytes can go out while the rest are
// being written (kvcd sends a layer's first heads while it dequantizes the others). Making one
// allocates the layer (every size set, no byte written); pieces [0, heads) then write head h's
// keys, pieces [heads, 2 * heads) (absent for a keys-only export) head h's values and positions.
// Written in order, from one thread: after n pieces the first KeyBytesAfter(n) bytes of `k` and
// ValueBytesAfter(n) of `v` are final and never written again, so another thread may read them
// (with a happens-before edge from the writer); `positions` is final once every piece is
// written. The view (and the blob it reads) must outlive the exporter. Its results are those of
// the one-shot exports, which are made of it.
class DenseExporter {
 public:
  // Writes piece `piece` of `out`.
  using WriteFn = std::function<void(int piece, DenseLayer* out)>;
  DenseExporter(std::shared_ptr<DenseLayer> layer, bool values, WriteFn write);

  const std::shared_ptr<DenseLayer>& layer() const { return layer_; }
  int pieces() const { return (values_ ? 2 : 1) * layer_->num_kv_heads; }
  // Runs `after` on each piece right after it is written, before it counts as written: a later
  // step over the same bytes (the contiguous export's turn of each head's keys).
  void AddStep(WriteFn after);
  // Writes the next piece; false (doing nothing) once every piece is written.
  bool WriteNext();
  int written() const { return written_; }
  uint64_t KeyBytesAfter(int n) const;
  uint64_t ValueBytesAfter(int n) const;
  // Writes every remaining piece and gives the layer up.
  DenseLayer Finish() &&;

 private:
  std::shared_ptr<DenseLayer> layer_;
  bool values_;
  WriteFn write_;
  int written_ = 0;
};

// The layer a DENSE export of `view` fills (its values and positions too when `values`): every
// size and count set, no byte written. RESOURCE_EXHAUSTED naming the layer when its memory cannot
// be allocated.
absl::StatusOr<std::shared_ptr<DenseLayer>> AllocateDenseExport(const CompactLayerView& view,
                                                                bool values);

// The exporter of ExportDense(view) (values) or of ExportDenseKeys(view). RESOURCE_EXHAUSTED when
// the layer's memory cannot be allocated.
absl::StatusOr<DenseExporter> MakeDenseExporter(const CompactLayerView& view, bool values);

// Dequantized float copy of head h: keys and values [n_kept, D] with pruned channels zero. The
// buffers must hold desc(h).n_kept * head_dim floats each.
void UnpackHeadToFloat(const CompactLayerView& view, int h, float* keys, float* values);

}  // namespace kvc

#endif  // KVC_COMPACT_H_

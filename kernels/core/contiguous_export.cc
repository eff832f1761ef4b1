#include "kvc/contiguous_export.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"
#include "kvc/spec.h"

namespace kvc {

namespace {

// The turn of every key of a layer by -shift positions: one angle per channel pair.
struct Turn {
  std::vector<double> cs, sn;
  int half = 0;
  bool half_split = false;
};

// The turn under a validated `rope` of keys of head_dim d; nothing (no channel moves) when shift
// is 0 or no channel is rotary.
absl::optional<Turn> MakeTurn(const RopeParams& rope, int d, int shift) {
  const int rd = rope.rotary_dims == 0 ? d : rope.rotary_dims;
  Turn t;
  t.half = rd / 2;
  t.half_split = rope.half_split;
  if (shift == 0 || t.half == 0) return absl::nullopt;
  t.cs.resize(t.half);
  t.sn.resize(t.half);
  for (int p = 0; p < t.half; ++p) {
    const double freq = std::pow(rope.theta, -2.0 * p / rd);
    const double angle = -static_cast<double>(shift) / rope.linear_factor * freq;
    t.cs[p] = std::cos(angle);
    t.sn[p] = std::sin(angle);
  }
  return t;
}

// Turns the pairs of one row (floats; only the first `half` pairs' channels move): in double,
// each result rounded to float once. The file is compiled with -ffp-contract=off
// (kernels/CMakeLists.txt): a fused multiply-add would round differently on FMA targets.
inline __attribute__((always_inline)) void RotateRowBody(const Turn& t, float* row) {
  const double* cs = t.cs.data();
  const double* sn = t.sn.data();
  if (t.half_split) {  // pairs (p, p + half): both halves contiguous
    float* lo = row;
    float* hi = row + t.half;
    for (int p = 0; p < t.half; ++p) {
      const double x0 = lo[p], x1 = hi[p];
      lo[p] = static_cast<float>(x0 * cs[p] - x1 * sn[p]);
      hi[p] = static_cast<float>(x0 * sn[p] + x1 * cs[p]);
    }
  } else {  // pairs (2p, 2p + 1)
    for (int p = 0; p < t.half; ++p) {
      const double x0 = row[2 * p], x1 = row[2 * p + 1];
      row[2 * p] = static_cast<float>(x0 * cs[p] - x1 * sn[p]);
      row[2 * p + 1] = static_cast<float>(x0 * sn[p] + x1 * cs[p]);
    }
  }
}

// The same loop vectorized for each instruction set (the compiler's own vectorization of the
// body; the same operations, so the same bits): 4 or 8 doubles at a time instead of 2.
void RotateRowPortable(const Turn& t, float* row) { RotateRowBody(t, row); }
#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2"))) void RotateRowAvx2(const Turn& t, float* row) {
  RotateRowBody(t, row);
}
__attribute__((target("avx512f"))) void RotateRowAvx512(const Turn& t, float* row) {
  RotateRowBody(t, row);
}
#endif

using RotateRowFn = void (*)(const Turn&, float*);
RotateRowFn PickRotateRow() {
#if defined(__x86_64__) || defined(_M_X64)
  if (CpuIsaAtLeast(CpuIsa::kAvx512)) return RotateRowAvx512;
  if (CpuIsaAtLeast(CpuIsa::kAvx2)) return RotateRowAvx2;
#endif
  return RotateRowPortable;
}

// `rows` rows of d elements of dt from src, turned, into dst (src == dst allowed). Blocks of rows
// go through a float buffer with the bulk conversions of kvc/convert.h (vectorized where the CPU
// allows): element-by-element loads and stores through a dtype switch made a contiguous download
// several times slower than a dense one. Channels past rotary_dims go through float and back
// unchanged.
void RotateRows(const Turn& t, DType dt, int d, const uint8_t* src, size_t rows, uint8_t* dst) {
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(dt);
  const size_t block_rows = std::max<size_t>(1, 16384 / static_cast<size_t>(d));
  std::vector<float> buf(std::min(block_rows, rows) * d);
  const RotateRowFn rotate = PickRotateRow();
  for (size_t r0 = 0; r0 < rows; r0 += block_rows) {
    const size_t nr = std::min(block_rows, rows - r0);
    ToFloat(src + r0 * row_bytes, dt, nr * d, buf.data());
    for (size_t r = 0; r < nr; ++r) rotate(t, buf.data() + r * d);
    FromFloat(buf.data(), dt, nr * d, dst + r0 * row_bytes);
  }
}

}  // namespace

absl::Status RotateKeys(const RopeParams& rope, int shift, DenseLayer* layer) {
  const int d = layer->head_dim;
  if (absl::Status s = ValidateRope(rope, d); !s.ok()) return s;
  const absl::optional<Turn> turn = MakeTurn(rope, d, shift);
  if (!turn) return absl::OkStatus();
  const size_t rows = static_cast<size_t>(layer->num_kv_heads) * layer->n_kept;
  if (layer->k.size() != rows * d * DTypeSize(layer->dtype)) {
    return absl::InvalidArgumentError("RotateKeys: key bytes do not match the layer's shape");
  }
  RotateRows(*turn, layer->dtype, d, layer->k.data(), rows, layer->k.data());
  return absl::OkStatus();
}

absl::StatusOr<DenseLayer> ExportKeysContiguous(const CompactLayerView& view,
                                                const DenseRuns& runs, const RopeParams& rope) {
  if (absl::Status s = ValidateRope(rope, view.head_dim()); !s.ok()) return s;
  DenseLayer out;
  out.num_kv_heads = view.num_kv_heads();
  out.head_dim = view.head_dim();
  out.seq_len = view.seq_len();
  out.dtype = view.dtype();
  out.n_kept = view.max_kept();
  out.counts.assign(out.num_kv_heads, out.n_kept);
  const size_t row_bytes = static_cast<size_t>(out.head_dim) * DTypeSize(out.dtype);
  size_t total = 0;
  for (const auto& run : runs.k) {
    if (run.size() % row_bytes != 0) {
      return absl::InternalError("ExportKeysContiguous: a key run is not whole rows");
    }
    total += run.size();
  }
  if (total != static_cast<size_t>(out.num_kv_heads) * out.n_kept * row_bytes) {
    return absl::InternalError("ExportKeysContiguous: the key runs do not cover the layer");
  }
  out.k.resize(total);
  const absl::optional<Turn> turn = MakeTurn(rope, out.head_dim, out.seq_len - out.n_kept);
  uint8_t* dst = out.k.data();
  for (const auto& run : runs.k) {
    if (turn) {
      RotateRows(*turn, out.dtype, out.head_dim, run.data(), run.size() / row_bytes, dst);
    } else {
      std::memcpy(dst, run.data(), run.size());
    }
    dst += run.size();
  }
  return out;
}

absl::StatusOr<DenseLayer> ExportDenseContiguous(const CompactLayerView& view,
                                                 const RopeParams& rope) {
  if (absl::Status s = ValidateRope(rope, view.head_dim()); !s.ok()) return s;
  for (int h = 1; h < view.num_kv_heads(); ++h) {
    if (view.desc(h).n_kept != view.desc(0).n_kept) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", view.header().layer_index, ": head ", h, " keeps ", view.desc(h).n_kept,
          " tokens but head 0 keeps ", view.desc(0).n_kept,
          " (head-adaptive budgets); a contiguous export needs the same count for every head, "
          "fetch FORMAT_DENSE (padded) or FORMAT_PACKED"));
    }
  }
  absl::StatusOr<DenseLayer> dense = ExportDense(view);
  if (!dense.ok()) {
    if (dense.status().code() == absl::StatusCode::kInvalidArgument) {
      return absl::FailedPreconditionError(dense.status().message());
    }
    return dense.status();
  }
  if (absl::Status s = RotateKeys(rope, dense->seq_len - dense->n_kept, &*dense); !s.ok()) {
    return s;
  }
  return dense;
}

}  // namespace kvc

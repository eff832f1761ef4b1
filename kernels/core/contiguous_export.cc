#include "kvc/contiguous_export.h"

#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvc/dtype.h"
#include "kvc/spec.h"

namespace kvc {

absl::Status RotateKeys(const RopeParams& rope, int shift, DenseLayer* layer) {
  const int d = layer->head_dim;
  if (absl::Status s = ValidateRope(rope, d); !s.ok()) return s;
  const int rd = rope.rotary_dims == 0 ? d : rope.rotary_dims;
  const int half = rd / 2;
  if (shift == 0 || half == 0) return absl::OkStatus();
  // One angle per pair: the same turn for every token, since every key moves by `shift`.
  std::vector<double> cs(half), sn(half);
  for (int p = 0; p < half; ++p) {
    const double freq = std::pow(rope.theta, -2.0 * p / rd);
    const double angle = -static_cast<double>(shift) / rope.linear_factor * freq;
    cs[p] = std::cos(angle);
    sn[p] = std::sin(angle);
  }
  const size_t rows = static_cast<size_t>(layer->num_kv_heads) * layer->n_kept;
  if (layer->k.size() != rows * d * DTypeSize(layer->dtype)) {
    return absl::InvalidArgumentError("RotateKeys: key bytes do not match the layer's shape");
  }
  uint8_t* base = layer->k.data();
  const DType dt = layer->dtype;
  for (size_t r = 0; r < rows; ++r) {
    const size_t row = r * d;
    for (int p = 0; p < half; ++p) {
      const size_t i0 = row + (rope.half_split ? p : 2 * p);
      const size_t i1 = row + (rope.half_split ? p + half : 2 * p + 1);
      const double x0 = LoadAsFloat(base, dt, i0);
      const double x1 = LoadAsFloat(base, dt, i1);
      StoreFromFloat(base, dt, i0, static_cast<float>(x0 * cs[p] - x1 * sn[p]));
      StoreFromFloat(base, dt, i1, static_cast<float>(x0 * sn[p] + x1 * cs[p]));
    }
  }
  return absl::OkStatus();
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

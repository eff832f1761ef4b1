#include "kvc/contiguous_export.h"

#include <cmath>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kvc/dtype.h"
#include "kvc/spec.h"

namespace kvc {

absl::Status ValidateRope(const RopeParams& rope, int head_dim) {
  if (!(rope.theta > 0) || !std::isfinite(rope.theta)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope.theta: ", FormatDouble(rope.theta), " must be > 0"));
  }
  if (rope.rotary_dims < 0 || rope.rotary_dims % 2 != 0 || rope.rotary_dims > head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("rope.rotary_dims: ", rope.rotary_dims,
                                                   " must be even and at most head_dim ", head_dim,
                                                   " (0 = head_dim)"));
  }
  if (!(rope.linear_factor >= 1) || !std::isfinite(rope.linear_factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope.scaling_factor: ", FormatDouble(rope.linear_factor), " must be >= 1"));
  }
  return absl::OkStatus();
}

void RotateVector(const RopeParams& rope, int head_dim, double position, float* x) {
  const int rd = rope.rotary_dims == 0 ? head_dim : rope.rotary_dims;
  for (int p = 0; p < rd / 2; ++p) {
    const double angle = position / rope.linear_factor * std::pow(rope.theta, -2.0 * p / rd);
    const double c = std::cos(angle), s = std::sin(angle);
    float& a = x[RopePairFirst(rope, rd, p)];
    float& b = x[RopePairSecond(rope, rd, p)];
    const double x0 = a, x1 = b;
    a = static_cast<float>(x0 * c - x1 * s);
    b = static_cast<float>(x0 * s + x1 * c);
  }
}

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

// The model's rotary embedding (kvc/rope.h): validation and rotation of one vector.
#include "kvc/rope.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "kvc/spec.h"  // FormatDouble

namespace kvc {

absl::Status ValidateRope(const RopeParams& rope, int head_dim) {
  if (!(rope.theta > 0) || !std::isfinite(rope.theta)) {
    return absl::InvalidArgumentError(absl::StrCat("rope.theta: ", FormatDouble(rope.theta), " must be > 0"));
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

}  // namespace kvc

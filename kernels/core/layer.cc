#include "kvc/layer.h"

#include <cstdint>
#include <optional>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kvc/checked_math.h"
#include "kvc/status_macros.h"

namespace kvc {
namespace {

absl::Status Invalid(const char* field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

}  // namespace

absl::Status ValidateShape(const LayerShape& shape, bool rows_after_context) {
  if (shape.num_kv_heads < 1) {
    return Invalid("shape.num_kv_heads", absl::StrCat(shape.num_kv_heads, " must be >= 1"));
  }
  if (shape.num_q_heads < 1) {
    return Invalid("shape.num_q_heads", absl::StrCat(shape.num_q_heads, " must be >= 1"));
  }
  if (shape.num_q_heads % shape.num_kv_heads != 0) {
    return Invalid(
        "shape.num_q_heads",
        absl::StrCat(shape.num_q_heads, " is not a multiple of num_kv_heads ", shape.num_kv_heads));
  }
  if (shape.seq_len < 1) {
    return Invalid("shape.seq_len", absl::StrCat(shape.seq_len, " must be >= 1"));
  }
  if (shape.head_dim < kMinHeadDim || shape.head_dim > kMaxHeadDim) {
    return Invalid("shape.head_dim", absl::StrCat(shape.head_dim, " is outside [", kMinHeadDim,
                                                  ", ", kMaxHeadDim, "]"));
  }
  if (shape.obs_window < 0) {
    return Invalid("shape.obs_window", absl::StrCat(shape.obs_window, " must be >= 0"));
  }
  if (shape.obs_window > shape.seq_len && !rows_after_context) {
    return Invalid("shape.obs_window",
                   absl::StrCat(shape.obs_window, " is outside [0, seq_len ", shape.seq_len,
                                "] (only kvzip's reconstruction rows may outnumber the tokens)"));
  }
  // The element counts are checked products: each field may be up to INT32_MAX, so the exact
  // product can exceed 64 bits, and a wrapped count would pass the limit below. Within the limit,
  // every byte offset the engine computes from the shape fits comfortably in 64 bits.
  absl::StatusOr<uint64_t> kv_elems =
      CheckedProduct("shape", {{"num_kv_heads", static_cast<uint64_t>(shape.num_kv_heads)},
                               {"seq_len", static_cast<uint64_t>(shape.seq_len)},
                               {"head_dim", static_cast<uint64_t>(shape.head_dim)}});
  if (!kv_elems.ok()) return kv_elems.status();
  if (*kv_elems > kMaxLayerElements) {
    return Invalid("shape", absl::StrCat("K has ", *kv_elems, " elements, above the limit ",
                                         kMaxLayerElements));
  }
  absl::StatusOr<uint64_t> q_elems =
      CheckedProduct("shape", {{"num_q_heads", static_cast<uint64_t>(shape.num_q_heads)},
                               {"obs_window", static_cast<uint64_t>(shape.obs_window)},
                               {"head_dim", static_cast<uint64_t>(shape.head_dim)}});
  if (!q_elems.ok()) return q_elems.status();
  if (*q_elems > kMaxLayerElements) {
    return Invalid("shape", absl::StrCat("Q_obs has ", *q_elems, " elements, above the limit ",
                                         kMaxLayerElements));
  }
  return absl::OkStatus();
}

absl::Status ValidateInput(const LayerInput& in, bool allow_device) {
  // The spec decides whether W may exceed S (ValidateSpec); every engine entry checks both.
  if (absl::Status s = ValidateShape(in.shape, /*rows_after_context=*/true); !s.ok()) return s;
  const auto dtype = static_cast<uint8_t>(in.dtype);
  if (dtype > static_cast<uint8_t>(DType::kBF16)) {
    return Invalid("dtype", absl::StrCat("unknown value ", dtype));
  }
  const auto layout = static_cast<uint8_t>(in.layout);
  if (layout > static_cast<uint8_t>(Layout::kNHD)) {
    return Invalid("layout", absl::StrCat("unknown value ", layout));
  }
  const auto memory = static_cast<uint8_t>(in.memory);
  if (memory > static_cast<uint8_t>(MemorySpace::kDevice)) {
    return Invalid("memory", absl::StrCat("unknown value ", memory));
  }
  if (in.memory == MemorySpace::kDevice && !allow_device) {
    return Invalid("memory",
                   "k, v and q_obs are in device memory, but this backend reads host memory only "
                   "(the cuda backend accepts device memory)");
  }
  if (in.layer_index < 0) {
    return Invalid("layer_index", absl::StrCat(in.layer_index, " must be >= 0"));
  }
  if (in.k == nullptr) return Invalid("k", "null pointer");
  if (in.v == nullptr) return Invalid("v", "null pointer");
  if (in.shape.obs_window > 0 && in.q_obs == nullptr) {
    return Invalid("q_obs", absl::StrCat("null pointer with obs_window ", in.shape.obs_window));
  }
  if (in.rope != nullptr) {
    if (absl::Status s = ValidateRope(*in.rope, in.shape.head_dim); !s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::StatusOr<LayerBytes> LayerTensorBytes(const LayerShape& s, DType dtype, bool query_stats,
                                            bool row_log_mass) {
  const uint64_t es = DTypeSize(dtype);
  LayerBytes b;
  ASSIGN_OR_RETURN(b.k,
                   CheckedProduct("shape", {{"num_kv_heads", static_cast<uint64_t>(s.num_kv_heads)},
                                            {"seq_len", static_cast<uint64_t>(s.seq_len)},
                                            {"head_dim", static_cast<uint64_t>(s.head_dim)},
                                            {"dtype_bytes", es}}));
  b.v = b.k;
  ASSIGN_OR_RETURN(b.q_obs,
                   CheckedProduct("shape", {{"num_q_heads", static_cast<uint64_t>(s.num_q_heads)},
                                            {"obs_window", static_cast<uint64_t>(s.obs_window)},
                                            {"head_dim", static_cast<uint64_t>(s.head_dim)},
                                            {"dtype_bytes", es}}));
  if (query_stats && row_log_mass) {
    ASSIGN_OR_RETURN(b.q_stats,
                     CheckedProduct("shape", {{"num_q_heads", static_cast<uint64_t>(s.num_q_heads)},
                                              {"obs_window", static_cast<uint64_t>(s.obs_window)},
                                              {"float_bytes", 4}}));
  } else if (query_stats) {
    const uint64_t d = static_cast<uint64_t>(s.head_dim);
    ASSIGN_OR_RETURN(b.q_stats,
                     CheckedProduct("shape", {{"num_q_heads", static_cast<uint64_t>(s.num_q_heads)},
                                              {"head_dim+head_dim^2", d + d * d},
                                              {"float_bytes", 4}}));
  }
  return b;
}

absl::StatusOr<uint64_t> UploadBytes(const LayerShape& s, DType dtype, int num_layers,
                                     bool query_stats, bool row_log_mass) {
  ASSIGN_OR_RETURN(const LayerBytes lb, LayerTensorBytes(s, dtype, query_stats, row_log_mass));
  const std::optional<uint64_t> kv = CheckedAdd(lb.k, lb.v);
  const std::optional<uint64_t> kvq = kv ? CheckedAdd(*kv, lb.q_obs) : std::nullopt;
  const std::optional<uint64_t> layer = kvq ? CheckedAdd(*kvq, lb.q_stats) : std::nullopt;
  if (!layer) {
    return absl::InvalidArgumentError(absl::StrCat("shape: K + V + Q_obs + Q_stats = ", lb.k, " + ",
                                                   lb.v, " + ", lb.q_obs, " + ", lb.q_stats,
                                                   " bytes overflows 64 bits"));
  }
  return CheckedProduct(
      "shape", {{"layer_bytes", *layer}, {"num_layers", static_cast<uint64_t>(num_layers)}});
}

}  // namespace kvc

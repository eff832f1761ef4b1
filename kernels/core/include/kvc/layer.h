// One transformer layer's KV cache and observation queries, as non-owning views.
#ifndef KVC_LAYER_H_
#define KVC_LAYER_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvc/cancel.h"
#include "kvc/dtype.h"
#include "kvc/rope.h"

namespace kvc {

// Limits every backend accepts.
inline constexpr int kMinHeadDim = 8;
inline constexpr int kMaxHeadDim = 256;
// Elements of K (Hkv * S * D) or Q_obs (Hq * W * D) one layer may hold (2^36, 128 GiB of fp16).
inline constexpr uint64_t kMaxLayerElements = uint64_t{1} << 36;

struct LayerShape {
  int num_kv_heads = 0;  // Hkv >= 1
  int num_q_heads = 0;   // Hq = g * Hkv (GQA group size g >= 1)
  int seq_len = 0;       // S >= 1 prompt tokens
  int head_dim = 0;      // D in [kMinHeadDim, kMaxHeadDim]
  int obs_window = 0;    // W in [0, S]: observation queries for the last W prompt positions

  int group_size() const { return num_kv_heads > 0 ? num_q_heads / num_kv_heads : 0; }
};

// Where a layer's K, V and Q_obs live. kDevice: CUDA device memory of the device the CUDA backend
// runs on (BackendOptions::device), e.g. tensors an NCCL receive or the inference engine left
// there; only the CUDA backend accepts it, and then copies nothing through the host for them.
enum class MemorySpace : uint8_t { kHost = 0, kDevice = 1 };

// How the CPU engine computes attention scoring's logits (h2o, snapkv, keyformer, kvzip). kExact:
// fp32 sums of exact products (near-fp32 on AMX; ScoringLogitsDescription names the path per
// dtype); kInteger: both operands rounded to integers (keys 8 bits, queries 8 with AVX-512 VNNI or
// 7 with AVX2) and multiplied in integer dot products (cpu/int8_logits.h: logits about twice as
// fast, kept sets equal up to near-ties), kExact's path below AVX2 and on AMX, whose tiles are
// faster still. A backend option (BackendOptions::scoring_math, kvcd --scoring_math) that the CPU
// backend copies into each LayerInput.
enum class ScoringMath { kExact, kInteger };

// Views of one layer's tensors, all post-RoPE, in host memory by default (the CUDA backend copies
// them to the device itself) or, with `memory` = kDevice, in device memory (k, v and q_obs; rope
// and q_stats are always host memory). Element type `dtype`, layout `layout` for all three tensors:
//   HND: K, V [Hkv, S, D], Q_obs [Hq, W, D]      NHD: K, V [S, Hkv, D], Q_obs [W, Hq, D]
// Q_obs row t is the query of prompt position S - W + t (kvzip: of the reconstruction pass after
// the prompt, whose W rows may outnumber the S tokens). q_obs may be null only when W == 0.
// Expected attention also reads `rope` (the model's RoPE, to un-rotate Q_obs and to rotate the
// statistics to future positions) and, with EvictionSpec::query_stats, `q_stats`: float32
// [Hq, D + D * D] per layer, for each query head the mean of its un-rotated (pre-RoPE) queries
// followed by their covariance, row-major (an engine sends a diagonal covariance when that is
// all it tracks).
struct LayerInput {
  LayerShape shape;
  DType dtype = DType::kF16;
  Layout layout = Layout::kHND;
  int layer_index = 0;  // selects a per-layer budget override, and seeds per-layer noise
  const void* k = nullptr;
  const void* v = nullptr;
  const void* q_obs = nullptr;
  const RopeParams* rope = nullptr;         // null: not known
  const float* q_stats = nullptr;           // null: none sent (kvzip: [Hq, W] row log-masses)
  MemorySpace memory = MemorySpace::kHost;  // where k, v and q_obs are
  // Checked by the engine between row blocks and chunks: once it reads as cancelled, Compress
  // (and the scoring and selection stages) stop within one block and return its status. null:
  // never cancelled.
  const CancelToken* cancel = nullptr;
  ScoringMath scoring_math = ScoringMath::kExact;  // set by the CPU backend from its options
};

// Floats of q_stats per layer: Hq * (D + D * D) (the queries' moments, expected attention), or
// with `row_log_mass` Hq * W (kvzip: each observation row's log-mass over keys not uploaded).
inline size_t QueryStatsFloats(const LayerShape& s, bool row_log_mass = false) {
  if (row_log_mass) return static_cast<size_t>(s.num_q_heads) * s.obs_window;
  return static_cast<size_t>(s.num_q_heads) *
         (s.head_dim + static_cast<size_t>(s.head_dim) * s.head_dim);
}

// Byte sizes of one layer's tensors as uploaded: K, V and Q_obs in `dtype`, and Q_stats (float32,
// QueryStatsFloats(shape, row_log_mass)) when `query_stats`, else 0. Overflow-checked
// (kvc/checked_math.h): INVALID_ARGUMENT naming the product, e.g. "shape: num_kv_heads*seq_len*
// head_dim*dtype_bytes = ... overflows 64 bits" (never for a shape ValidateShape accepts).
struct LayerBytes {
  uint64_t k = 0, v = 0, q_obs = 0, q_stats = 0;
};
absl::StatusOr<LayerBytes> LayerTensorBytes(const LayerShape& shape, DType dtype,
                                            bool query_stats = false, bool row_log_mass = false);
// K + V + Q_obs (+ Q_stats) bytes of all `num_layers` layers, overflow-checked likewise.
absl::StatusOr<uint64_t> UploadBytes(const LayerShape& shape, DType dtype, int num_layers,
                                     bool query_stats = false, bool row_log_mass = false);

// Checks shape limits and pointers; the message names the offending field, e.g.
// "shape.head_dim: 300 is outside [8, 256]". ValidateShape: Hkv >= 1, Hq a multiple of Hkv, S >= 1,
// D in [kMinHeadDim, kMaxHeadDim], W in [0, S] (any W >= 0 with `rows_after_context`: kvzip's
// reconstruction pass, whose rows are not prompt positions), element counts within
// kMaxLayerElements. The counts are overflow-checked: a product past 64 bits is reported naming
// its factors, e.g. "shape: num_kv_heads*seq_len*head_dim = 901467965*213156309*96 overflows 64
// bits". A shape that passes keeps every byte size and offset derived from it far below 2^64.
// ValidateInput leaves W > S to ValidateSpec (which knows the policy) and also checks
// dtype/layout/memory values, layer_index >= 0 and that k, v (and q_obs when W > 0) are non-null,
// and rope (when set) with ValidateRope; it cannot check that the buffers are large enough.
// Device memory is INVALID_ARGUMENT ("memory: ...") unless `allow_device` (the CUDA backend,
// which checks the pointers itself): every host-side consumer reads host memory.
absl::Status ValidateShape(const LayerShape& shape, bool rows_after_context = false);
absl::Status ValidateInput(const LayerInput& in, bool allow_device = false);

// Element offset of (head, token, channel) in a tensor of `heads` heads and `tokens` tokens.
inline size_t ElementOffset(Layout layout, int heads, int tokens, int head_dim, int h, int t,
                            int c) {
  return layout == Layout::kHND ? (static_cast<size_t>(h) * tokens + t) * head_dim + c
                                : (static_cast<size_t>(t) * heads + h) * head_dim + c;
}

}  // namespace kvc

#endif  // KVC_LAYER_H_

// The engine's interface: one implementation per device (kernels/cpu, kernels/cuda), chosen by the
// backend registry (kvc/backend.h). CPU is the reference and the oracle for CUDA tests. A Backend
// is thread-safe: concurrent Compress/Attend calls are allowed (the CUDA backend runs each call on
// its own stream).
#ifndef KVC_BACKEND_INTERFACE_H_
#define KVC_BACKEND_INTERFACE_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

enum class BackendKind { kAuto, kCpu, kCuda };
absl::StatusOr<BackendKind> ParseBackendKind(std::string_view name);  // "auto", "cpu", "cuda"

// How CPU decode attention multiplies quantized (2/4/8-bit) blocks; the modes are specified at
// PackedAttentionOptions (kvc/attention.h). kAuto: integer dot products for 2- and 4-bit blocks
// of heads keeping >= 32 channels, fp32 otherwise; kExact: fp32 on the dequantized codes;
// kInteger: integer dot products everywhere.
enum class AttentionMath { kAuto, kExact, kInteger };
// "auto", "exact", "integer"; INVALID_ARGUMENT naming the accepted values otherwise.
absl::StatusOr<AttentionMath> ParseAttentionMath(std::string_view name);
// "exact", "integer" (ScoringMath, kvc/layer.h); INVALID_ARGUMENT naming the accepted values
// otherwise.
absl::StatusOr<ScoringMath> ParseScoringMath(std::string_view name);

// Wall time of each stage of one Compress call, in seconds.
struct CompressTimings {
  double score = 0;     // token scores (QK^T, softmax, pooling, noise)
  double select = 0;    // top-k selection and channel selection
  double pack = 0;      // gather of kept tokens/channels into the blob
  double quantize = 0;  // quantization of the old blocks
  double total = 0;
};

// A layer's token scores computed before its values arrived (Backend::ScoreKeys): the policy's
// scores [num_kv_heads, seq_len] before value weighting, or none when the spec's protected tokens
// fill the budget (no scores needed).
struct KeyScores {
  std::vector<float> scores;
  bool computed = false;
  double seconds = 0;  // wall time of the scoring
  // Layer-adaptive budgets (EvictionSpec::layer_adaptive): the tokens each KV head keeps, as
  // AllocateAcrossLayers (kvc/layer_budget.h) decided over the request's layers. Empty: the
  // spec's own selection for this layer.
  std::vector<int32_t> head_counts;
};

struct BackendOptions {
  int num_threads = 0;  // CPU: worker threads (0 = hardware concurrency)
  // CPU: the workers' nice value (Linux; 0 = the process's own): a positive value lets other
  // threads of the process (e.g. a server's RPC threads) win the CPU over compression.
  int thread_nice = 0;
  int device = 0;  // CUDA: device ordinal
  // CPU: the arithmetic of Attend over quantized blocks (the CUDA backend has one path and
  // ignores it).
  AttentionMath attention_math = AttentionMath::kAuto;
  // CPU: the arithmetic of attention scoring's logits (kvc/layer.h; CUDA ignores it).
  ScoringMath scoring_math = ScoringMath::kExact;
};

// New queries for decode attention over a packed layer (Backend::Attend, PackedAttentionCpu in
// kvc/attention.h).
struct DecodeQuery {
  int num_q_heads = 0;           // Hq, a multiple of the cache's num_kv_heads
  int n_q = 0;                   // queries per head
  const float* q = nullptr;      // [Hq, n_q, D] post-RoPE
  int n_new = 0;                 // uncompressed tokens appended after the cache (n_new >= n_q)
  const float* k_new = nullptr;  // [Hkv, n_new, D] post-RoPE; may be null when n_new == 0
  const float* v_new = nullptr;  // [Hkv, n_new, D]
};

class Backend {
 public:
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual std::string_view name() const = 0;  // "cpu" or "cuda"
  // Human-readable device description, e.g. "cpu: 16 threads" or "cuda: NVIDIA H200 (sm_90)".
  virtual std::string description() const = 0;

  // Compresses one layer held in host memory. Validates input and spec first (INVALID_ARGUMENT
  // naming the field); never aborts. `timings` may be null. When in.cancel reads as cancelled the
  // call returns its status soon after (the CPU backend within one row block or key chunk of each
  // stage; the CUDA backend before each stage it launches).
  virtual absl::StatusOr<CompactLayer> Compress(const LayerInput& in, const CompressionSpec& spec,
                                                CompressTimings* timings) = 0;

  // Compression in two steps, for a caller that has a layer's keys and queries before its values
  // (kvcd scores a layer while its V is still arriving). ScoreKeys reads in.k, in.q_obs,
  // in.q_stats and in.rope, never in.v (which may be null); CompressScored then finishes the
  // layer with V from those scores (value weighting, selection, channels, packing) and returns
  // what Compress(in, spec) would. Only when CanScoreKeys() (default: false; ScoreKeys then
  // returns UNIMPLEMENTED and CompressScored ignores the scores).
  virtual bool CanScoreKeys() const { return false; }
  virtual absl::StatusOr<KeyScores> ScoreKeys(const LayerInput& in, const CompressionSpec& spec) {
    return absl::UnimplementedError("this backend scores a layer only inside Compress");
  }
  virtual absl::StatusOr<CompactLayer> CompressScored(const LayerInput& in,
                                                      const CompressionSpec& spec,
                                                      KeyScores scores, CompressTimings* timings) {
    return Compress(in, spec, timings);
  }

  // Decode attention over a packed layer (see kvc/attention.h); host pointers.
  virtual absl::Status Attend(const CompactLayerView& cache, const DecodeQuery& query,
                              float* out) = 0;

 protected:
  Backend() = default;
};

}  // namespace kvc

#endif  // KVC_BACKEND_INTERFACE_H_

// The work a compression spec will cost, from the declared shapes alone, before any byte of the
// layer exists: arithmetic (flops) and the engine's peak working memory (scratch). A server
// compares it with a budget proportional to the upload's bytes and refuses a spec that asks for
// far more work than its bytes justify (kvcd: --work_flops_per_byte and friends).
//
// Every policy states its cost in one place, the row tables in cost.cc (eviction policy, key
// channel policy, value pruning, quantization and packing): a new policy adds one row there.
// The formulas follow the CPU engine's loops and blocking (the block sizes below are the ones
// the engine uses), counting a multiply-add as 2 flops, a conversion or copy of an element as 1
// and a transcendental (exp, log, sqrt, sin, cos) as kTranscendentalFlops. They are upper
// bounds of the engine's own work up to these weights, not timings. Scratch is host memory the
// engine allocates beyond the layer's inputs and its output blob: per task (one KV head on one
// thread) times the tasks that may run at once, plus per call (one layer), for the backend that
// runs it (CostConcurrency).
//
// Arithmetic is overflow-checked and saturates at UINT64_MAX (any budget refuses that).
// Thread-safety: pure functions.
#ifndef KVC_COST_H_
#define KVC_COST_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "kvc/dtype.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

// ---- Blocking of the engine's long loops (shared with the CPU engine) -------------------------
// Keys converted to fp32 per chunk (512 KiB at D = 128).
inline constexpr int kScoreTokenChunk = 1024;
// Logits kept per block of query rows (16 MiB of floats): all 128 rows of a Llama-3 group at 32K.
inline constexpr size_t kScoreLogitFloats = size_t{4} << 20;
// fp32 query rows converted per block (4 MiB).
inline constexpr size_t kScoreQueryFloats = size_t{1} << 20;
// Query rows one block scores: as many as keep rows * seq_len logits and rows * head_dim query
// floats within the limits above, at least 1 and at most `rows`.
int ScoreRowBlock(int seq_len, int rows, int head_dim);

// Flops charged for one transcendental function.
inline constexpr uint64_t kTranscendentalFlops = 10;

// The cost of compressing one or more layers.
struct WorkCost {
  uint64_t flops = 0;          // saturated at UINT64_MAX
  uint64_t scratch_bytes = 0;  // peak; saturated at UINT64_MAX
  // The largest contributions, for messages: e.g. "expected scores
  // (num_q_heads*seq_len*head_dim^2*2)" and its value (for all layers). "causal_keys" in a term
  // is W * S - W * (W - 1) / 2, the keys the W observation rows of one query head see.
  std::string flops_term;
  uint64_t flops_term_value = 0;
  std::string scratch_term;
  uint64_t scratch_term_value = 0;
};

// How the engine runs one upload: `parallel_tasks` tasks (KV heads) of it may run at once (>= 1),
// over `concurrent_layers` layers (>= 1) compressed at the same time. `whole_layer_statistics`:
// the backend computes expected attention's statistics of every query head of a layer at once
// on the host (the CUDA backend, which copies them to the device in one piece); the CPU engine
// computes one query head's at a time.
struct CostConcurrency {
  int parallel_tasks = 1;
  int concurrent_layers = 1;
  bool whole_layer_statistics = false;
};

// The cost of compressing layer `layer_index` (its budget may differ per layer). Preconditions:
// shape valid (ValidateShape) and spec valid for it (ValidateSpec).
WorkCost LayerCost(const LayerShape& shape, DType dtype, const CompressionSpec& spec,
                   int layer_index, const CostConcurrency& concurrency);

// The cost of compressing layers [0, num_layers): flops summed over the layers, scratch the
// largest layer's times concurrency.concurrent_layers (parallel_tasks counts tasks of all of
// them). Same preconditions.
WorkCost CompressCost(const LayerShape& shape, DType dtype, const CompressionSpec& spec,
                      int num_layers, const CostConcurrency& concurrency);

}  // namespace kvc

#endif  // KVC_COST_H_

// Decode attention computed directly on the compact (packed) form: new queries against the kept
// tokens (pruned key channels simply absent from the dot product, quantized blocks dequantized on
// the fly) plus optional uncompressed new tokens. Scale is 1/sqrt(D) with the full head_dim D.
#ifndef KVC_ATTENTION_H_
#define KVC_ATTENTION_H_

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kvc/backend_interface.h"  // DecodeQuery
#include "kvc/compact.h"
#include "kvc/thread_pool.h"

namespace kvc {

struct PackedAttentionOptions {
  // How quantized (2/4/8-bit) old blocks are multiplied; unquantized caches take the same fp32
  // path in every mode.
  //   kInteger: integer dot products. Key scores use the query quantized to int8 per query, token
  //     group and block of 32 / bits channels (the group's per-channel key scales folded in
  //     first), so that each element costs a byte multiply-add (AVX-512 VNNI vpdpbusd, AVX2
  //     vpmaddubsw); 2- and 4-bit values are summed with softmax weights quantized to uint8 per
  //     block of 64 rows and channel group (8-bit values stay fp32). Scales, zero points and a
  //     centring term are applied after the integer sums, in fp32. Every instruction set gives
  //     the same result up to fp32 rounding.
  //   kExact: fp32 arithmetic on the dequantized codes (the float reference up to fp32 rounding).
  //   kAuto (the default): kInteger for the 2- and 4-bit blocks of heads that keep at least 32
  //     key (for the scores) or value (for the sums) channels, kExact otherwise. At 2 and 4 bits
  //     the integer path's error is a small fraction of the error the codes themselves carry
  //     (measured in docs/performance.md, held by tests/kernels/attention_int_test.cc) and
  //     decoding runs ~2x faster on Llama-shaped heads; at 8 bits the int8 query has the codes'
  //     own resolution, so it would double their error (those caches are chosen for accuracy);
  //     and on heads with fewer channels the per-group preparation costs more than it saves.
  using Math = AttentionMath;  // kvc/backend_interface.h (BackendOptions carries it too)
  Math math = Math::kAuto;
};

// out: [Hq, n_q, D], fully overwritten. Query head qh reads KV head qh / (Hq / Hkv). Query i
// attends to every cached token and to new tokens [0, n_new - n_q + i] (causal within the new
// tokens). Softmax is computed stably in fp32. INVALID_ARGUMENT naming the field when Hq is not a
// positive multiple of Hkv, n_q < 0, n_new < n_q, a needed pointer is null, or the view was not
// produced by Parse; n_q == 0 does nothing. Thread-safe (no shared mutable state).
//
// The kernel reads every cached byte once: keys and values are converted (fp16 via F16C, bf16) or
// unpacked in registers as they stream by, never into a dense copy. Each head's old rows are
// split into chunks whose partial softmax results are merged exactly (flash-decoding), so heads
// with different counts (ragged per-head budgets) balance across threads. `pool` (may be null:
// the calling thread does everything) runs the chunks; small problems run on the caller. The
// instruction set follows kvc/cpu_isa.h.
absl::Status PackedAttentionCpu(const CompactLayerView& cache, const DecodeQuery& query, float* out,
                                ThreadPool* pool, const PackedAttentionOptions& options = {});
inline absl::Status PackedAttentionCpu(const CompactLayerView& cache, const DecodeQuery& query,
                                       float* out) {
  return PackedAttentionCpu(cache, query, out, nullptr);
}

// A batch of independent sequences (e.g. one decode step of a batch), each with its own cache,
// query and output, scheduled together on `pool`. The same checks as above, per item (the error
// names the item); nothing is written unless every item is valid.
struct PackedAttentionItem {
  const CompactLayerView* cache = nullptr;
  DecodeQuery query;
  float* out = nullptr;
};
absl::Status PackedAttentionBatchCpu(absl::Span<const PackedAttentionItem> items, ThreadPool* pool,
                                     const PackedAttentionOptions& options = {});

}  // namespace kvc

#endif  // KVC_ATTENTION_H_

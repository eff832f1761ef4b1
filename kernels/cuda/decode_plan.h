// Host-side plan of a decode-attention launch over packed layers (attention_kernels.cu), and the
// byte accounting the GPU benchmark reports. Plain C++: no device is needed to plan.
//
// The split kernel reads each head's packed bytes once: one block per (sequence, KV head, chunk of
// kept tokens) computes the scores of all g * n_q query rows of that KV head against its chunk
// (keys), a partial softmax, and the probability-weighted values, dequantizing on the fly; a
// second kernel merges the chunks with the uncompressed new tokens. Chunks never straddle the
// old (pruned/quantized) and recent (full) blocks, so heads may keep different token counts.
#ifndef KVC_KERNELS_CUDA_DECODE_PLAN_H_
#define KVC_KERNELS_CUDA_DECODE_PLAN_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/types/span.h"
#include "cuda/kernels.h"

namespace kvc::cuda {

// Limits of the split kernel; anything outside them runs the generic kernel.
inline constexpr int kDecodeMaxHeadDim = 128;  // 16 lanes x 8 channels per token
inline constexpr int kDecodeMaxRows = 8;       // g * n_q query rows per KV head
inline constexpr int kDecodeMaxNew = 64;       // uncompressed new tokens
inline constexpr int kDecodeTeams = 8;         // token teams per block; chunk is a multiple
inline constexpr int kDecodeMinChunk = 32;
inline constexpr int kDecodeMaxChunk = 256;

struct DecodeShape {
  ElemType dtype = ElemType::kF16;
  int num_kv_heads = 0, num_q_heads = 0, head_dim = 0;
  int bits = 0, group = 0;
  int n_q = 0, n_new = 0;
  int batch = 1;
  int value_bits = -1;  // the values' bits; -1: as bits
};

struct DecodePlan {
  bool split = false;  // the split kernel runs; else the generic one (reason in why_not)
  std::string why_not;
  int rows = 0;               // g * n_q
  int row_tile = 0;           // compile-time rows of the split kernel: 4 or 8
  int chunk = 0;              // kept tokens per block, a multiple of kDecodeTeams
  int max_chunks = 0;         // blocks per (sequence, KV head) at most
  size_t partial_floats = 0;  // DecodeArgs::partial
};

// `heads` holds batch * num_kv_heads entries (sequence-major; offsets are not read). num_sms is the
// device's multiprocessor count (the chunk is sized so that the launch fills it several times);
// `chunk` > 0 forces the chunk (rounded to a multiple of kDecodeTeams within
// [kDecodeMinChunk, kDecodeMaxChunk]).
DecodePlan PlanDecode(const DecodeShape& shape, absl::Span<const AttnHead> heads, int num_sms,
                      int chunk = 0);

// Bytes of one head's packed blocks that decode attention reads: channel lists, old keys (codes
// and their scales and zeros, or the full-precision rows), recent keys, and the same for values.
// Positions and padding are not read.
uint64_t PackedHeadReadBytes(const AttnHead& head, int head_dim, size_t elem_size, int bits,
                             int group);

// Bytes a dense decode kernel reads for one head holding `tokens` tokens: K and V rows.
inline uint64_t DenseHeadReadBytes(int tokens, int head_dim, size_t elem_size) {
  return 2 * static_cast<uint64_t>(tokens) * head_dim * elem_size;
}

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_DECODE_PLAN_H_

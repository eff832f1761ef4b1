// Host launchers of the CUDA backend's kernels (internal to kernels/cuda). Each launcher enqueues
// work on `stream` and returns the launch error; it never synchronizes. Pointers are device
// pointers unless a parameter says otherwise. Shapes follow kvc/layer.h: Hkv KV heads, Hq query
// heads (Hq = g * Hkv), S prompt tokens, D head_dim in [8, 256], W observation queries.
#ifndef KVC_KERNELS_CUDA_KERNELS_H_
#define KVC_KERNELS_CUDA_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

// Returns from the enclosing cudaError_t function when `expr` fails.
#define KVC_CUDA_CALL(expr)                                 \
  do {                                                      \
    const cudaError_t kvc_cuda_err_ = (expr);               \
    if (kvc_cuda_err_ != cudaSuccess) return kvc_cuda_err_; \
  } while (0)

namespace kvc::cuda {

// Mirrors kvc::DType's values.
enum class ElemType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// Element strides of a [heads, tokens, D] (HND) or [tokens, heads, D] (NHD) tensor.
struct Strides {
  int64_t head = 0;
  int64_t token = 0;
};

// ---- token scoring (score_kernels.cu) ----

// A block of observation rows [row0, row0 + rows) of the W, processed together so that the logits
// buffer stays bounded when W is large (keyformer's W = S).
struct QueryRows {
  int row0 = 0;
  int rows = 0;
};

// logits[hq, i, j] = q[hq, row0 + i] . k[hq / g, j] * scale for j <= S - W + row0 + i, else -inf;
// with causal = false for every j (kvzip's reconstruction rows). logits is [Hq, qr.rows, S].
cudaError_t LaunchQKLogits(ElemType dtype, const void* q, Strides qs, const void* k, Strides ks,
                           int num_q_heads, int num_kv_heads, int obs_window, QueryRows qr,
                           int seq_len, int head_dim, float scale, float* logits,
                           cudaStream_t stream, bool causal = true);

// Turns each row of logits [Hq, qr.rows, S] into softmax probabilities in place. With `gumbel`,
// the row of query head hq and window row i (= row0 + local row) uses
// softmax((a + CounterGumbel(seed, layer, hq, i, j)) * inv_tau); masked -inf entries stay at
// probability 0.
cudaError_t LaunchSoftmaxRows(float* logits, int num_q_heads, int obs_window, QueryRows qr,
                              int seq_len, bool gumbel, uint64_t seed, uint32_t layer,
                              float inv_tau, cudaStream_t stream);

// scores[hkv, j] (+)= (1/g) * sum over the g query heads of hkv and the `rows` rows of
// probs[hq, i, j] (probs is [Hq, rows, S]); `accumulate` adds to the existing scores.
cudaError_t LaunchGroupColumnSum(const float* probs, int num_q_heads, int num_kv_heads, int rows,
                                 int seq_len, bool accumulate, float* scores, cudaStream_t stream);

// LaunchQKLogits + LaunchSoftmaxRows + LaunchGroupColumnSum in one, for fp16/bf16 inputs, on
// tensor cores (fp32 accumulation) and without a logits buffer: scores[hkv, j] (+)= (1/g) * sum
// over the g query heads of hkv and the window rows [row0, row0 + rows) of the (optionally
// Gumbel-perturbed, as LaunchSoftmaxRows) causal softmax probability of key j. `scratch` holds
// ColumnScoreScratchFloats(num_q_heads, qr.rows, seq_len) floats. cudaErrorInvalidValue for fp32
// (use the three launchers) or bad shapes. Sets the kernels' dynamic shared memory limit
// (cudaFuncSetAttribute) on every call.
size_t ColumnScoreScratchFloats(int num_q_heads, int rows, int seq_len);
cudaError_t LaunchTensorCoreColumnScores(ElemType dtype, const void* q, Strides qs, const void* k,
                                         Strides ks, int num_q_heads, int num_kv_heads,
                                         int obs_window, QueryRows qr, int seq_len, int head_dim,
                                         float scale, bool gumbel, uint64_t seed, uint32_t layer,
                                         float inv_tau, bool accumulate, float* scratch,
                                         float* scores, cudaStream_t stream);

// Rows of `seq_len` floats; the first `len` entries of each are pooled: out[h, j] = max or mean
// of in[h, j - k/2 .. j + k/2] clipped to [0, len) (the mean divides by the number of in-range
// entries); entries j >= len are copied unchanged.
cudaError_t LaunchPool1d(const float* in, int rows, int seq_len, int len, int kernel, bool avg,
                         float* out, cudaStream_t stream);

// scores[h, j] = -||k[h, j, :]||_2.
cudaError_t LaunchKeyNormScores(ElemType dtype, const void* k, Strides ks, int num_kv_heads,
                                int seq_len, int head_dim, float* scores, cudaStream_t stream);

// scores[h, j] = CounterUniform(seed, layer, h, 0, j).
cudaError_t LaunchRandomScores(int num_kv_heads, int seq_len, uint64_t seed, uint32_t layer,
                               float* scores, cudaStream_t stream);

// out[j] = sum over h of scores[h, j] (per-layer granularity).
cudaError_t LaunchSumHeads(const float* scores, int num_kv_heads, int seq_len, float* out,
                           cudaStream_t stream);

// ---- selection (select_kernels.cu) ----

// For each row r of scores [rows, S], writes the k kept positions to out[r, 0..k) in ascending
// order: positions in [0, sink_end) and [recent_begin, S) are protected and come first; then the
// highest scores, ties broken by the lower position; NaN never beats a number. 1 <= k <= S.
// Each row is split into blocks of `segment` keys (0: the default, 4096; else a multiple of 256);
// `scratch` holds TopKScratchBytes(rows, seq_len, segment) bytes, 8-byte aligned. The result does
// not depend on the segment size.
size_t TopKScratchBytes(int rows, int seq_len, int segment = 0);
cudaError_t LaunchTopKPositions(const float* scores, int rows, int seq_len, int k, int sink_end,
                                int recent_begin, void* scratch, int32_t* out, cudaStream_t stream,
                                int segment = 0);

// Channel selection over the m oldest kept tokens (the ones whose channels are pruned) of each KV
// head, with the CPU engine's scores (kernels/cpu/channels.cc; the key sums are split over slices
// of 512 tokens, one block each, and added in a fixed order): keys by `key_policy` (1 think:
// sum_s K^2 * sum_t Q^2 / (g W m), 2 l1: sum_s |K|, 3 l2: sqrt(sum_s K^2); 0 keeps all); values
// when `prune_values` by sum over the group's query rows of (P[:, old] V_old[:, c])^2, P the causal
// softmax over all kept tokens. Keeps the top Tk / Tv (ties: lower index, NaN last), and writes
// key_idx [Hkv, Tk] and value_idx [Hkv, Tv] ascending.
struct ChannelArgs {
  ElemType dtype = ElemType::kF16;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* q = nullptr;
  Strides ks, vs, qs;
  int num_kv_heads = 0, num_q_heads = 0, seq_len = 0, head_dim = 0, obs_window = 0;
  const int32_t* positions = nullptr;  // [Hkv, n_kept]
  int n_kept = 0;
  int m = 0;  // old (pruned) tokens per head
  int key_policy = 0;
  int key_channels = 0;
  bool prune_values = false;
  int value_channels = 0;
  float* scratch = nullptr;  // ChannelScratchFloats() floats, 8-byte aligned
  int32_t* key_idx = nullptr;
  int32_t* value_idx = nullptr;
};
size_t ChannelScratchFloats(int num_kv_heads, int num_q_heads, int obs_window, int n_kept,
                            int head_dim);
cudaError_t LaunchSelectChannels(const ChannelArgs& a, cudaStream_t stream);

// ---- gather / pack / quantize (pack_kernels.cu) ----

// Byte offsets of one head's blocks inside the blob (absolute, from the blob start).
struct HeadOffsets {
  uint64_t positions, key_idx, value_idx;
  uint64_t key_old, key_scale, key_zero, key_codes, key_recent;
  uint64_t value_old, value_scale, value_zero, value_codes, value_recent;
};

struct PackArgs {
  ElemType dtype = ElemType::kF16;
  const void* k = nullptr;
  const void* v = nullptr;
  Strides ks, vs;
  int num_kv_heads = 0, head_dim = 0;
  int n_kept = 0, n_recent = 0, key_channels = 0, value_channels = 0;
  int bits = 0, value_bits = 0, group = 0;  // the keys' and the values' bits (both 0 or neither)
  const int32_t* positions = nullptr;    // [Hkv, n_kept]
  const int32_t* key_idx = nullptr;      // [Hkv, Tk]
  const int32_t* value_idx = nullptr;    // [Hkv, Tv]
  const HeadOffsets* offsets = nullptr;  // [Hkv], device memory
  float* scratch = nullptr;              // PackScratchFloats() floats (bits > 0)
  uint8_t* blob = nullptr;
};
size_t PackScratchFloats(int num_kv_heads, int m, int key_channels, int value_channels);
// Gathers positions, channel indices, full-precision blocks, and (bits > 0) the old blocks as fp32
// into `scratch`. LaunchQuantize then writes scales, zeros and codes from the scratch.
cudaError_t LaunchPack(const PackArgs& a, cudaStream_t stream);
cudaError_t LaunchQuantize(const PackArgs& a, cudaStream_t stream);

// ---- decode attention over the packed form (attention_kernels.cu) ----

// Device view of one head of a parsed blob: byte offsets from the blob start (0 = absent).
struct AttnHead {
  int n_kept, n_recent, key_channels, value_channels;
  uint64_t positions, key_idx, value_idx, key_old, key_scale, key_zero, key_codes, key_recent;
  uint64_t value_old, value_scale, value_zero, value_codes, value_recent;
};

struct AttnArgs {
  ElemType dtype = ElemType::kF16;
  const uint8_t* blob = nullptr;
  const AttnHead* heads = nullptr;  // [Hkv]
  int num_kv_heads = 0, num_q_heads = 0, head_dim = 0, bits = 0, group = 0;
  int value_bits = 0;  // the values' bits (bits is the keys')
  int max_kept = 0;    // max n_kept over heads
  int n_q = 0, n_new = 0;
  const float* q = nullptr;      // [Hq, n_q, D]
  const float* k_new = nullptr;  // [Hkv, n_new, D]
  const float* v_new = nullptr;
  float* scratch = nullptr;  // AttnScratchFloats() floats
  float* out = nullptr;      // [Hq, n_q, D]
};
size_t AttnScratchFloats(int num_q_heads, int n_q, int max_kept, int n_new);
cudaError_t LaunchPackedAttention(const AttnArgs& a, cudaStream_t stream);

// Split decode attention (see cuda/decode_plan.h) over a batch of sequences whose packed layers
// share dtype, shape and quantization; each sequence has its own blob, heads and new tokens. Only
// for shapes PlanDecode accepts (plan.split); same semantics as LaunchPackedAttention.
struct DecodeSeq {
  const uint8_t* blob = nullptr;
  const AttnHead* heads = nullptr;  // [Hkv], offsets into blob
  const float* q = nullptr;         // [Hq, n_q, D]
  const float* k_new = nullptr;     // [Hkv, n_new, D]
  const float* v_new = nullptr;
  float* out = nullptr;  // [Hq, n_q, D]
};

struct DecodeArgs {
  ElemType dtype = ElemType::kF16;
  int num_kv_heads = 0, num_q_heads = 0, head_dim = 0, bits = 0, group = 0;
  int n_q = 0, n_new = 0, batch = 0;
  const DecodeSeq* seqs = nullptr;              // [batch], device memory
  int row_tile = 0, chunk = 0, max_chunks = 0;  // from the plan
  float* partial = nullptr;                     // plan.partial_floats floats
};
cudaError_t LaunchDecodeAttention(const DecodeArgs& a, cudaStream_t stream);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_KERNELS_H_

#include "cuda/decode_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace kvc::cuda {
namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

std::string CheckSplit(const DecodeShape& s, absl::Span<const AttnHead> heads) {
  if (s.dtype != ElemType::kF16 && s.dtype != ElemType::kBF16) return "dtype is not fp16/bf16";
  if (s.head_dim % 8 != 0 || s.head_dim < 8 || s.head_dim > kDecodeMaxHeadDim) {
    return absl::StrCat("head_dim ", s.head_dim, " is not a multiple of 8 in [8, ",
                        kDecodeMaxHeadDim, "]");
  }
  if (s.num_kv_heads < 1 || s.num_q_heads < 1 || s.num_q_heads % s.num_kv_heads != 0) {
    return "num_q_heads is not a positive multiple of num_kv_heads";
  }
  const int rows = s.num_q_heads / s.num_kv_heads * s.n_q;
  if (s.n_q < 1 || rows > kDecodeMaxRows) {
    return absl::StrCat("g * n_q = ", rows, " is not in [1, ", kDecodeMaxRows, "]");
  }
  if (s.n_new < s.n_q || s.n_new > kDecodeMaxNew) {
    return absl::StrCat("n_new ", s.n_new, " is not in [n_q, ", kDecodeMaxNew, "]");
  }
  if (s.bits != 0 && s.bits != 2 && s.bits != 4 && s.bits != 8) return "bits not in {0, 2, 4, 8}";
  // The split kernel is compiled for one bit width per cache (keys and values alike).
  if (s.value_bits >= 0 && s.value_bits != s.bits) {
    return absl::StrCat("keys at ", s.bits, " bits and values at ", s.value_bits,
                        " (the split kernel takes one width)");
  }
  // Value quantization groups must not split a lane's 8 channels.
  if (s.bits > 0 && (s.group < 8 || s.group % 8 != 0)) {
    return absl::StrCat("quantization group ", s.group, " is not a multiple of 8");
  }
  if (s.batch < 1 || heads.size() != static_cast<size_t>(s.batch) * s.num_kv_heads) {
    return "heads.size() != batch * num_kv_heads";
  }
  for (const AttnHead& h : heads) {
    if (h.key_channels % 8 != 0 || h.value_channels % 8 != 0 || h.key_channels < 8 ||
        h.value_channels < 8 || h.key_channels > s.head_dim || h.value_channels > s.head_dim) {
      return absl::StrCat("kept channels (", h.key_channels, " keys, ", h.value_channels,
                          " values) are not multiples of 8 in [8, head_dim]");
    }
    if (h.n_kept < 0 || h.n_recent < 0 || h.n_recent > h.n_kept) return "bad token counts";
  }
  return "";
}

}  // namespace

DecodePlan PlanDecode(const DecodeShape& shape, absl::Span<const AttnHead> heads, int num_sms,
                      int chunk) {
  DecodePlan p;
  p.why_not = CheckSplit(shape, heads);
  if (!p.why_not.empty()) return p;
  p.split = true;
  p.rows = shape.num_q_heads / shape.num_kv_heads * shape.n_q;
  p.row_tile = p.rows <= 4 ? 4 : 8;
  uint64_t total = 0;
  for (const AttnHead& h : heads) total += static_cast<uint64_t>(h.n_kept);
  if (chunk <= 0) {
    // About 16 blocks per multiprocessor: several resident at once, and a short tail.
    const uint64_t target_blocks = 16 * static_cast<uint64_t>(std::max(num_sms, 1));
    chunk = static_cast<int>(std::min<uint64_t>(CeilDiv(total, target_blocks), kDecodeMaxChunk));
  }
  chunk = std::clamp(chunk / kDecodeTeams * kDecodeTeams, kDecodeMinChunk, kDecodeMaxChunk);
  p.chunk = chunk;
  for (const AttnHead& h : heads) {
    const int m = h.n_kept - h.n_recent;
    const int n = static_cast<int>(CeilDiv(m, chunk) + CeilDiv(h.n_recent, chunk));
    p.max_chunks = std::max(p.max_chunks, n);
  }
  p.partial_floats = static_cast<size_t>(shape.batch) * shape.num_kv_heads * p.max_chunks * p.rows *
                     (static_cast<size_t>(shape.head_dim) + 2);
  return p;
}

uint64_t PackedHeadReadBytes(const AttnHead& h, int head_dim, size_t elem_size, int bits,
                             int group) {
  const uint64_t m = static_cast<uint64_t>(h.n_kept - h.n_recent);
  const uint64_t r = static_cast<uint64_t>(h.n_recent);
  const uint64_t tk = static_cast<uint64_t>(h.key_channels);
  const uint64_t tv = static_cast<uint64_t>(h.value_channels);
  uint64_t bytes = sizeof(int32_t) * (tk + tv) + 2 * r * head_dim * elem_size;
  if (bits == 0) return bytes + m * (tk + tv) * elem_size;
  const uint64_t g = static_cast<uint64_t>(group);
  bytes += 2 * sizeof(float) * CeilDiv(m, g) * tk + m * CeilDiv(tk * bits, 8);
  bytes += 2 * sizeof(float) * m * CeilDiv(tv, g) + m * CeilDiv(tv * bits, 8);
  return bytes;
}

}  // namespace kvc::cuda

// Channel gathers for the compact writer (internal to kernels/): out[c] = row[idx[c]] for the
// kept channels of one head. For 2-byte elements (fp16/bf16) the kept set is turned into one
// 8-bit mask per 8-channel chunk once per head, and each row is compacted chunk by chunk with a
// byte shuffle ("left-pack") where SSSE3 is available: about one instruction group per 8 channels
// instead of one load/store pair per kept channel. Thread-compatible; a plan is immutable.
#ifndef KVC_CPU_GATHER_H_
#define KVC_CPU_GATHER_H_

#include <cstdint>
#include <vector>

namespace kvc::gather {

struct Plan16 {
  int head_dim = 0;
  int kept = 0;
  std::vector<int32_t> idx;    // the kept channels, strictly ascending, < head_dim
  std::vector<uint8_t> masks;  // head_dim / 8 chunk masks (bit i = channel 8k + i kept)
};

// idx: t strictly ascending channel indices < head_dim (the caller has validated them).
Plan16 MakePlan16(const int32_t* idx, int t, int head_dim);

// out[c] = row[plan.idx[c]] for c < plan.kept; writes exactly plan.kept elements.
void GatherRow16(const uint16_t* row, const Plan16& plan, uint16_t* out);

// Elements past out + plan.kept that GatherRow16Slack may overwrite.
inline constexpr int kGather16Slack = 8;

// Like GatherRow16, but may also write up to kGather16Slack elements past out + plan.kept, with
// unspecified values: out must have room for plan.kept + kGather16Slack elements. For callers
// that write rows back to back and overwrite the spill with the next row (no stack bounce).
void GatherRow16Slack(const uint16_t* row, const Plan16& plan, uint16_t* out);

// The portable path, always available (tests compare the two).
void GatherRow16Scalar(const uint16_t* row, const Plan16& plan, uint16_t* out);

// Whether GatherRow16 uses the shuffle path on this CPU.
bool Gather16UsesSimd();

}  // namespace kvc::gather

#endif  // KVC_CPU_GATHER_H_

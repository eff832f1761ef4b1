#include "cpu/gather.h"

#include <array>
#include <cstring>

#include "kvc/cpu_isa.h"
#include "kvc/layer.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define KVC_GATHER_HAVE_SSSE3 1
#endif

namespace kvc::gather {
namespace {

// For each 8-bit mask, the pshufb control that moves the kept 16-bit lanes to the front in order
// (unused bytes 0x80, which pshufb turns into zero).
struct ShuffleTable {
  std::array<std::array<uint8_t, 16>, 256> ctl;
  ShuffleTable() {
    for (int m = 0; m < 256; ++m) {
      ctl[m].fill(0x80);
      int o = 0;
      for (int lane = 0; lane < 8; ++lane) {
        if (m & (1 << lane)) {
          ctl[m][2 * o] = static_cast<uint8_t>(2 * lane);
          ctl[m][2 * o + 1] = static_cast<uint8_t>(2 * lane + 1);
          ++o;
        }
      }
    }
  }
};

const ShuffleTable& Table() {
  static const ShuffleTable* t = new ShuffleTable();
  return *t;
}

#ifdef KVC_GATHER_HAVE_SSSE3
// Compacts chunk by chunk into dst: each store writes a full 16 bytes, of which popcount(mask)
// lanes are kept, so dst needs kGather16Slack elements of room past plan.kept. Channels past the
// last full chunk are picked one by one.
__attribute__((target("ssse3,popcnt"))) inline void CompactChunks(const uint16_t* row,
                                                                  const Plan16& plan,
                                                                  uint16_t* dst) {
  const ShuffleTable& table = Table();
  const int chunks = plan.head_dim / 8;
  int o = 0;
  for (int k = 0; k < chunks; ++k) {
    const uint8_t m = plan.masks[k];
    if (m == 0) continue;
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * k));
    const __m128i ctl = _mm_loadu_si128(reinterpret_cast<const __m128i*>(table.ctl[m].data()));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + o), _mm_shuffle_epi8(v, ctl));
    o += __builtin_popcount(m);
  }
  for (int c = o; c < plan.kept; ++c) dst[c] = row[plan.idx[c]];
}

// Goes through a stack buffer with slack and copies the exact result out, so `out` is never
// written past its end.
__attribute__((target("ssse3,popcnt"))) void GatherRow16Ssse3(const uint16_t* row,
                                                              const Plan16& plan, uint16_t* out) {
  alignas(16) uint16_t tmp[kMaxHeadDim + kGather16Slack];
  CompactChunks(row, plan, tmp);
  std::memcpy(out, tmp, sizeof(uint16_t) * plan.kept);
}

__attribute__((target("ssse3,popcnt"))) void GatherRow16SlackSsse3(const uint16_t* row,
                                                                   const Plan16& plan,
                                                                   uint16_t* out) {
  CompactChunks(row, plan, out);
}

bool DetectSsse3() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("ssse3") && __builtin_cpu_supports("popcnt");
}
#endif

}  // namespace

Plan16 MakePlan16(const int32_t* idx, int t, int head_dim) {
  Plan16 p;
  p.head_dim = head_dim;
  p.kept = t;
  p.idx.assign(idx, idx + t);
  p.masks.assign(head_dim / 8, 0);
  for (int c = 0; c < t; ++c) {
    if (idx[c] / 8 < head_dim / 8) p.masks[idx[c] / 8] |= static_cast<uint8_t>(1u << (idx[c] % 8));
  }
  return p;
}

void GatherRow16Scalar(const uint16_t* row, const Plan16& plan, uint16_t* out) {
  for (int c = 0; c < plan.kept; ++c) out[c] = row[plan.idx[c]];
}

// SSSE3 is below AVX2 (every AVX2 CPU has it); the cap's portable level turns it off too.
bool Gather16UsesSimd() {
#ifdef KVC_GATHER_HAVE_SSSE3
  static const bool has = DetectSsse3();
  return has && CpuIsaAtLeast(CpuIsa::kAvx2);
#else
  return false;
#endif
}

void GatherRow16(const uint16_t* row, const Plan16& plan, uint16_t* out) {
#ifdef KVC_GATHER_HAVE_SSSE3
  if (Gather16UsesSimd()) return GatherRow16Ssse3(row, plan, out);
#endif
  GatherRow16Scalar(row, plan, out);
}

void GatherRow16Slack(const uint16_t* row, const Plan16& plan, uint16_t* out) {
#ifdef KVC_GATHER_HAVE_SSSE3
  if (Gather16UsesSimd()) return GatherRow16SlackSsse3(row, plan, out);
#endif
  GatherRow16Scalar(row, plan, out);
}

}  // namespace kvc::gather

// The loop the register-blocked scoring kernels share (cpu/f32_logits.h, cpu/amx_logits.h's
// DotLogits, cpu/int8_logits.h): key groups in order and, within each, the query rows in blocks
// of a compile-time size, the last block as one of the rows left, so that every block's row
// count is a template argument (accumulators in registers). No intrinsics: each kernel's file
// includes it under its own instruction-set flags.
#ifndef KVC_KERNELS_CPU_ROW_BLOCKS_H_
#define KVC_KERNELS_CPU_ROW_BLOCKS_H_

#include <type_traits>

namespace kvc::cpu {

// fn(std::integral_constant<int, count>{}) for 1 <= count <= MR (nothing for count < 1).
template <int MR, typename Fn>
inline void WithRowCount(int count, Fn&& fn) {
  if constexpr (MR > 0) {
    if (count >= MR) {
      fn(std::integral_constant<int, MR>{});
    } else {
      WithRowCount<MR - 1>(count, fn);
    }
  }
}

// fn(rows_in_block, r, j0) for each group of `group` keys from j0 = 0 below n, and in it each
// block of kRows query rows from r (the last one of rows % kRows rows when that is not 0), with
// rows_in_block a std::integral_constant. A group's keys stay in L1 across its row blocks.
template <int kRows, typename Fn>
inline void ForRowBlocks(int rows, int n, int group, Fn&& fn) {
  for (int j0 = 0; j0 < n; j0 += group) {
    int r = 0;
    for (; r + kRows <= rows; r += kRows) fn(std::integral_constant<int, kRows>{}, r, j0);
    if (r < rows) WithRowCount<kRows - 1>(rows - r, [&](auto mr) { fn(mr, r, j0); });
  }
}

}  // namespace kvc::cpu

#endif  // KVC_KERNELS_CPU_ROW_BLOCKS_H_

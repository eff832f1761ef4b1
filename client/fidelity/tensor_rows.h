// Small helpers on the reference model's tensors, shared by the fidelity and pass-key evaluators.
#ifndef KVC_CLIENT_FIDELITY_TENSOR_ROWS_H_
#define KVC_CLIENT_FIDELITY_TENSOR_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvc::fidelity {

// Index of the largest of x[0, n); the first maximum on ties.
inline int32_t ArgMax(const float* x, int n) {
  return static_cast<int32_t>(std::max_element(x, x + n) - x);
}

// Positions [first, first + count) of an HND tensor [heads, S, D], as [heads, count, D].
inline std::vector<float> Rows(const std::vector<float>& x, int heads, int S, int D, int first,
                               int count) {
  std::vector<float> out(static_cast<size_t>(heads) * count * D);
  for (int h = 0; h < heads; ++h) {
    std::memcpy(&out[static_cast<size_t>(h) * count * D],
                &x[(static_cast<size_t>(h) * S + first) * D],
                static_cast<size_t>(count) * D * sizeof(float));
  }
  return out;
}

}  // namespace kvc::fidelity

#endif  // KVC_CLIENT_FIDELITY_TENSOR_ROWS_H_

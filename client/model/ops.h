// Numerical building blocks of the reference transformer (private to kvc_model): RMSNorm, matrix
// products through OpenBLAS, RoPE tables, softmax rows and blocked causal attention. All functions
// are thread-safe (no shared state).
#ifndef KVC_CLIENT_MODEL_OPS_H_
#define KVC_CLIENT_MODEL_OPS_H_

#include <cstddef>
#include <vector>

#include "kvc/model/checkpoint.h"

namespace kvc::model::internal {

// out[r] = x[r] / rms(x[r]) * weight for `rows` rows of n floats.
void RmsNormRows(const float* x, const float* weight, int rows, int n, float eps, float* out);

// Y [rows, out] = X [rows, in] W^T for W [out, in] row-major (sgemm; sgemv when rows == 1).
void MatMulT(const float* x, const float* w, int rows, int out, int in, float* y);

// x[i] = silu(x[i]) * y[i], i < n.
void SwiGlu(float* x, const float* y, size_t n);

// e^x for x <= 0 (larger x is not needed here), within a few ulp of std::exp; -inf and very
// negative x give 0 or a tiny positive value.
float ExpNonPositive(float x);

// Softmax over x[0, n) in place; returns nothing, the row sums to 1. n >= 1.
void SoftmaxInPlace(float* x, int n);

// cos/sin of every rotary pair for positions [first, first + count): rows of head_dim/2 floats.
class RopeTable {
 public:
  RopeTable(const RopeConfig& rope, int head_dim, int first, int count);
  // Rotates `heads` heads of x (each head_dim floats, `stride` floats apart) at position `pos`
  // (in [first, first + count)).
  void Apply(float* x, int heads, int stride, int pos) const;

 private:
  RopePairs pairs_;
  int head_dim_, first_;
  std::vector<float> cos_, sin_;
};

// Causal softmax attention for a whole sequence: for each query head h (KV head h / group) and
// position i, out[i, h] = sum_{j <= i} softmax_j(q[i,h] . k[j,kvh] * scale) v[j,kvh].
// q and out are [s, n_heads * head_dim], k and v [s, n_kv_heads * head_dim] (token-major rows).
// Blocks of query rows go through sgemm (scores, then weights times values).
void CausalAttention(const float* q, const float* k, const float* v, int s, int n_heads,
                     int n_kv_heads, int head_dim, float* out);

}  // namespace kvc::model::internal

#endif  // KVC_CLIENT_MODEL_OPS_H_

// Bulk conversions between fp16/bf16/fp32 buffers. Each picks an AVX2/F16C path at run time when
// the CPU has it and falls back to the scalar conversions of kvc/dtype.h otherwise; both paths
// give bit-identical results for every non-NaN input (NaN stays NaN, payload may differ).
// Thread-safe; buffers must not overlap.
#ifndef KVC_CONVERT_H_
#define KVC_CONVERT_H_

#include <cstddef>

#include "kvc/dtype.h"

namespace kvc {

// dst[i] = element i of src (type t) as float, for i in [0, n). Exact (every fp16/bf16 value is
// representable in fp32).
void ToFloat(const void* src, DType t, size_t n, float* dst);

// Element i of dst (type t) = src[i], rounded to nearest even; overflow becomes Inf.
void FromFloat(const float* src, DType t, size_t n, void* dst);

// Strided form of ToFloat: `rows` rows of `cols` elements, row r starting at element
// r * src_row_stride of src, written densely to dst[r * cols ...]. Used to read one head of an
// NHD tensor.
void RowsToFloat(const void* src, DType t, size_t src_row_stride, size_t rows, size_t cols,
                 float* dst);

// Whether the vector paths are in use on this CPU (for tests and benchmark labels).
bool ConvertUsesSimd();

namespace internal {
// The scalar paths, always available (tests compare the vector paths against them).
void ToFloatScalar(const void* src, DType t, size_t n, float* dst);
void FromFloatScalar(const float* src, DType t, size_t n, void* dst);
}  // namespace internal

}  // namespace kvc

#endif  // KVC_CONVERT_H_

// KIVI-style asymmetric integer quantization used by the compact cache (internal to kernels/).
// Keys are quantized per channel over groups of G tokens, values per token over groups of G
// channels. For a group with minimum lo and maximum hi:
//   scale = (hi - lo) / (2^bits - 1), zero = lo, code = clamp(round((x - zero) / scale))
// and the dequantized value is code * scale + zero (scale 0 gives code 0, i.e. the exact value).
// Codes are packed little-endian within a byte (element 0 in the lowest bits); each row of codes
// starts on a byte boundary. bits is 2, 4 or 8. All functions are thread-compatible.
#ifndef KVC_CORE_QUANTIZE_H_
#define KVC_CORE_QUANTIZE_H_

#include <cstddef>
#include <cstdint>

#include "kvc/dtype.h"

namespace kvc::quant {

// Bytes of one packed row of n codes.
inline size_t CodeRowBytes(int n, int bits) {
  return (static_cast<size_t>(n) * static_cast<size_t>(bits) + 7) / 8;
}

// Number of groups of size g covering n elements.
// Written without n + g - 1 so that any g >= 1 from an untrusted header cannot overflow.
inline int NumGroups(int n, int g) { return n <= 0 ? 0 : 1 + (n - 1) / g; }

// Code of element i in a packed row.
inline uint32_t CodeAt(const uint8_t* row, int i, int bits) {
  const size_t bit = static_cast<size_t>(i) * static_cast<size_t>(bits);
  return (row[bit >> 3] >> (bit & 7)) & ((1u << bits) - 1u);
}

// Keys, per channel: x is [m, t] row-major fp32. Writes scale and zero [ceil(m/g), t] and codes
// [m, CodeRowBytes(t, bits)] (every byte written, padding bits zero).
void QuantizeKeys(const float* x, int m, int t, int bits, int g, float* scale, float* zero,
                  uint8_t* codes);

// Values, per token: x is [m, t] row-major fp32. Writes scale and zero [m, ceil(t/g)] and codes
// [m, CodeRowBytes(t, bits)].
void QuantizeValues(const float* x, int m, int t, int bits, int g, float* scale, float* zero,
                    uint8_t* codes);

// Unpacks one row of n codes to floats (0 .. 2^bits - 1).
void UnpackCodes(const uint8_t* row, int n, int bits, float* out);

// Dequantizes key row j (0-based within the old block) into out[t].
void DequantizeKeyRow(const float* scale, const float* zero, const uint8_t* codes, int j, int t,
                      int bits, int g, float* out);

// Dequantizes value row j into out[t].
void DequantizeValueRow(const float* scale, const float* zero, const uint8_t* codes, int j, int t,
                        int bits, int g, float* out);

// Rows [0, m) of a head's quantized keys (values), dequantized and rounded to dt: row j at element
// j * t of dst. The bits of DequantizeKeyRow (DequantizeValueRow) followed by kvc/convert.h's
// FromFloat, row by row; AVX2 kernels do both in registers where t % 32 == 0 (and, for values,
// g % 8 == 0), AVX-512 ones where also, for values, g % 16 == 0.
void DequantizeKeysTo(const float* scale, const float* zero, const uint8_t* codes, int m, int t,
                      int bits, int g, DType dt, void* dst);
void DequantizeValuesTo(const float* scale, const float* zero, const uint8_t* codes, int m, int t,
                        int bits, int g, DType dt, void* dst);

}  // namespace kvc::quant

#endif  // KVC_CORE_QUANTIZE_H_

// Element types and tensor layouts, and scalar conversions between fp32, fp16 and bf16.
// Bulk (vectorized) conversions live in kvc/convert.h.
#ifndef KVC_DTYPE_H_
#define KVC_DTYPE_H_

#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvc {

// Values are part of the wire format (proto enum and compact layer header): never renumber.
enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

// HND: [heads, tokens, head_dim] (canonical). NHD: [tokens, heads, head_dim] (vLLM/FlashInfer).
enum class Layout : uint8_t { kHND = 0, kNHD = 1 };

inline constexpr size_t DTypeSize(DType t) { return t == DType::kF32 ? 4 : 2; }
std::string_view DTypeName(DType t);                          // "f32", "f16", "bf16"
absl::StatusOr<DType> ParseDType(std::string_view name);      // accepts the names above
std::string_view LayoutName(Layout l);                        // "HND", "NHD"
absl::StatusOr<Layout> ParseLayout(std::string_view name);

// IEEE 754 binary16 <-> binary32, round to nearest even; NaN and Inf preserved.
inline float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    exp = 113;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t absx = x & 0x7fffffffu;
  if (absx >= 0x7f800000u) {  // Inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (absx > 0x7f800000u ? 0x200u : 0u));
  }
  if (absx >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> Inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    if (absx < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t e = absx >> 23;
    const uint32_t m = (absx & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t half_m = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half_m & 1u))) ++half_m;
    return static_cast<uint16_t>(sign | half_m);
  }
  uint32_t h = ((absx >> 13) - (112u << 10));
  const uint32_t rem = absx & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

inline float BFloat16ToFloat(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);  // quiet NaN
  const uint32_t rounding = 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>((x + rounding) >> 16);
}

// Reads element i of a buffer of type t as float.
inline float LoadAsFloat(const void* base, DType t, size_t i) {
  switch (t) {
    case DType::kF32:
      return static_cast<const float*>(base)[i];
    case DType::kF16:
      return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case DType::kBF16:
      return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
  }
  return 0.0f;
}

// Writes float v as element i of a buffer of type t (rounding to nearest even).
inline void StoreFromFloat(void* base, DType t, size_t i, float v) {
  switch (t) {
    case DType::kF32:
      static_cast<float*>(base)[i] = v;
      return;
    case DType::kF16:
      static_cast<uint16_t*>(base)[i] = FloatToHalf(v);
      return;
    case DType::kBF16:
      static_cast<uint16_t*>(base)[i] = FloatToBFloat16(v);
      return;
  }
}

}  // namespace kvc

#endif  // KVC_DTYPE_H_

// Overflow-checked unsigned 64-bit arithmetic for sizes computed from untrusted fields (request
// headers, file headers, responses of a peer). Every byte or element count the engine, the service
// or the client derives from such fields goes through these helpers, so a product that does not
// fit in 64 bits is an error instead of a silently wrapped (small) size.
//
//   ASSIGN_OR_RETURN(uint64_t elems,
//                    CheckedProduct("shape", {{"num_kv_heads", h}, {"seq_len", s},
//                                             {"head_dim", d}}));
//   // on overflow: INVALID_ARGUMENT "shape: num_kv_heads*seq_len*head_dim = 901467965*213156309*96
//   // overflows 64 bits"
//
// Header-only, no state: thread-safe.
#ifndef KVC_CHECKED_MATH_H_
#define KVC_CHECKED_MATH_H_

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace kvc {

// a * b, or nullopt when the exact product does not fit in uint64_t.
inline std::optional<uint64_t> CheckedMul(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_mul_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// a + b, or nullopt when the exact sum does not fit in uint64_t.
inline std::optional<uint64_t> CheckedAdd(uint64_t a, uint64_t b) {
  uint64_t out;
  if (__builtin_add_overflow(a, b, &out)) return std::nullopt;
  return out;
}

// *acc + a * b into *acc; false (and *acc unchanged) when either step overflows.
inline bool CheckedMulAdd(uint64_t a, uint64_t b, uint64_t* acc) {
  const std::optional<uint64_t> product = CheckedMul(a, b);
  if (!product) return false;
  const std::optional<uint64_t> sum = CheckedAdd(*acc, *product);
  if (!sum) return false;
  *acc = *sum;
  return true;
}

// The product of `factors` (1 for none), or nullopt on overflow. A zero factor makes the product
// 0 even when the others alone would overflow.
inline std::optional<uint64_t> CheckedProduct(std::initializer_list<uint64_t> factors) {
  uint64_t out = 1;
  bool overflow = false;
  for (uint64_t f : factors) {
    if (f == 0) return 0;
    if (!overflow) {
      const std::optional<uint64_t> next = CheckedMul(out, f);
      if (next) {
        out = *next;
      } else {
        overflow = true;
      }
    }
  }
  if (overflow) return std::nullopt;
  return out;
}

// One named factor of a size product, e.g. {"seq_len", 4096}.
struct Factor {
  absl::string_view name;
  uint64_t value;
};

// INVALID_ARGUMENT "FIELD: a*b*c = 1*2*3 overflows 64 bits" for the named factors.
inline absl::Status ProductOverflowError(absl::string_view field,
                                         std::initializer_list<Factor> factors) {
  std::string names, values;
  for (const Factor& f : factors) {
    if (!names.empty()) {
      names += '*';
      values += '*';
    }
    absl::StrAppend(&names, f.name);
    absl::StrAppend(&values, f.value);
  }
  return absl::InvalidArgumentError(
      absl::StrCat(field, ": ", names, " = ", values, " overflows 64 bits"));
}

// The product of the named factors, or ProductOverflowError(field, factors) when it does not fit
// in uint64_t.
inline absl::StatusOr<uint64_t> CheckedProduct(absl::string_view field,
                                               std::initializer_list<Factor> factors) {
  uint64_t out = 1;
  bool overflow = false;
  for (const Factor& f : factors) {
    if (f.value == 0) return uint64_t{0};
    if (!overflow) {
      const std::optional<uint64_t> next = CheckedMul(out, f.value);
      if (next) {
        out = *next;
      } else {
        overflow = true;
      }
    }
  }
  if (overflow) return ProductOverflowError(field, factors);
  return out;
}

}  // namespace kvc

#endif  // KVC_CHECKED_MATH_H_

// The instruction set the engine's CPU kernels use, chosen at run time, with one cap.
//
// Every CPU kernel that has vector paths asks CpuIsaAtLeast(level) before taking one, so one
// setting caps them all. The level in use is the best one this CPU (and this build) supports,
// lowered to the cap when one is set: by the environment variable KVC_CPU_ISA (read once, at the
// first query) or by SetCpuIsaCap (tests and benchmarks). A cap above what the CPU has changes
// nothing (it is a cap, not a request). Levels, each including the ones below it:
//
//   portable    no vector paths: plain C++ built for the compiler's baseline (SSE2 on x86-64)
//   avx2        AVX2 + FMA + F16C (Haswell, Zen 1 and later)
//   avx512      AVX-512 F, DQ, BW and VL (Skylake-SP, Zen 4 and later)
//   avx512vnni  the above + AVX-512 VNNI (Cascade Lake, Ice Lake, Zen 4 and later)
//   avx512bf16  the above + AVX-512 BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later); only
//               attention scoring's GEMM uses it, on bf16 layers (kernels/cpu/amx_logits.h: one
//               bf16 dot product per pair of elements, exact products of bf16 values)
//   amx         the above + AMX-TILE and AMX-BF16, with the kernel's permission to use the tile
//               registers (Sapphire Rapids and later); only attention scoring's GEMM uses it
//               (kernels/cpu/amx_logits.h: bf16 hi/lo splits, near-fp32 logits)
//
// The vector paths compute the same results as the portable ones up to float rounding (integer
// results, e.g. hashes and quantization codes, are identical); a kernel's contract says where it
// differs. Thread-safety: every function here may be called from any thread; a cap changed while
// kernels run takes effect for the kernels that start after it (a running one may finish on
// either path; both are correct).
#ifndef KVC_CPU_ISA_H_
#define KVC_CPU_ISA_H_

#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvc {

enum class CpuIsa : int {
  kPortable = 0,
  kAvx2 = 1,
  kAvx512 = 2,
  kAvx512Vnni = 3,
  kAvx512Bf16 = 4,
  kAmx = 5,
};
// The highest level (a cap at it caps nothing).
inline constexpr CpuIsa kBestCpuIsa = CpuIsa::kAmx;

// "portable", "avx2", "avx512", "avx512vnni", "avx512bf16", "amx".
std::string_view CpuIsaName(CpuIsa isa);
// The inverse of CpuIsaName (case-insensitive); "native" (or "best") means the highest level, i.e.
// no cap. INVALID_ARGUMENT listing the accepted names otherwise.
absl::StatusOr<CpuIsa> ParseCpuIsa(std::string_view name);

// The best level this CPU and build support (detected once).
CpuIsa DetectedCpuIsa();
// The level the kernels use now: min(DetectedCpuIsa(), cap).
CpuIsa ActiveCpuIsa();
inline bool CpuIsaAtLeast(CpuIsa level) {
  return static_cast<int>(ActiveCpuIsa()) >= static_cast<int>(level);
}

// Sets the cap (kBestCpuIsa = no cap) and returns the previous one. Overrides KVC_CPU_ISA.
CpuIsa SetCpuIsaCap(CpuIsa cap);
CpuIsa CpuIsaCap();

// The outcome of reading KVC_CPU_ISA: OK when unset or valid; INVALID_ARGUMENT naming the variable
// and its value otherwise (the value is then ignored: no cap). Programs that take their settings
// from the environment (kvcd) refuse to start on an error.
absl::Status CpuIsaEnvStatus();

// One line for logs and benchmark labels, e.g. "avx2 (capped from amx by KVC_CPU_ISA)" or
// "amx"; CpuFeatureList() names the features detected ("avx2 fma f16c avx512f ...").
std::string CpuIsaDescription();
std::string CpuFeatureList();

}  // namespace kvc

#endif  // KVC_CPU_ISA_H_

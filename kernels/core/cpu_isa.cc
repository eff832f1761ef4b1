// CPU feature detection from CPUID and XCR0 (the OS must save the wider registers, or the
// instructions fault), and the cap.
#include "kvc/cpu_isa.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define KVC_CPU_ISA_X86 1
#endif

namespace kvc {
namespace {

struct Features {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512dq = false, avx512bw = false, avx512vl = false;
  bool avx512vnni = false, avx512bf16 = false, avx512fp16 = false, amx = false;
  bool amx_bf16 = false;
  bool amx_permitted = false;  // the kernel let this process use the tile data registers
  bool avx_vnni = false;
};

#ifdef KVC_CPU_ISA_X86
uint64_t ReadXcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

Features Detect() {
  Features f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c & bit_OSXSAVE) != 0;
  if (!osxsave) return f;
  const uint64_t xcr0 = ReadXcr0();
  const bool ymm = (xcr0 & 0x6) == 0x6;            // SSE and AVX state
  const bool zmm = (xcr0 & 0xe6) == 0xe6;          // + opmask, ZMM_Hi256, Hi16_ZMM
  const bool tiles = (xcr0 & 0x60000) == 0x60000;  // AMX TILECFG, TILEDATA
  const bool avx = ymm && (c & bit_AVX) != 0;
  f.fma = avx && (c & bit_FMA) != 0;
  f.f16c = avx && (c & bit_F16C) != 0;
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  f.avx2 = avx && (b & bit_AVX2) != 0;
  f.avx512f = zmm && (b & bit_AVX512F) != 0;
  f.avx512dq = f.avx512f && (b & bit_AVX512DQ) != 0;
  f.avx512bw = f.avx512f && (b & bit_AVX512BW) != 0;
  f.avx512vl = f.avx512f && (b & bit_AVX512VL) != 0;
  f.avx512vnni = f.avx512f && (c & (1u << 11)) != 0;
  f.avx512fp16 = f.avx512f && (d & (1u << 23)) != 0;
  f.amx = tiles && (d & (1u << 24)) != 0;
  f.amx_bf16 = f.amx && (d & (1u << 22)) != 0;
  const unsigned max_sub = a;
  if (max_sub >= 1) {
    __cpuid_count(7, 1, a, b, c, d);
    f.avx_vnni = avx && (a & (1u << 4)) != 0;
    f.avx512bf16 = f.avx512f && (a & (1u << 5)) != 0;
  }
  if (f.amx_bf16) {
    // Linux hands out the 8 KiB tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
    // XTILEDATA, once per process: every thread may then use it); without it the first tile
    // instruction kills the process with SIGILL.
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    f.amx_permitted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }
  return f;
}
#else
Features Detect() { return Features{}; }
#endif

CpuIsa LevelOf(const Features& f) {
  if (!(f.avx2 && f.fma && f.f16c)) return CpuIsa::kPortable;
  if (!(f.avx512f && f.avx512dq && f.avx512bw && f.avx512vl)) return CpuIsa::kAvx2;
  if (!f.avx512vnni) return CpuIsa::kAvx512;
  if (!f.avx512bf16) return CpuIsa::kAvx512Vnni;
  if (!(f.amx_bf16 && f.amx_permitted)) return CpuIsa::kAvx512Bf16;
  return CpuIsa::kAmx;
}

enum class CapSource { kNone, kEnv, kCall };

struct State {
  Features features;
  CpuIsa detected = CpuIsa::kPortable;
  absl::Status env_status;
  std::atomic<int> cap{static_cast<int>(kBestCpuIsa)};
  std::atomic<int> active{static_cast<int>(CpuIsa::kPortable)};
  std::atomic<int> source{static_cast<int>(CapSource::kNone)};
};

State* Init() {
  auto* s = new State;
  s->features = Detect();
  s->detected = LevelOf(s->features);
  CpuIsa cap = kBestCpuIsa;
  if (const char* env = std::getenv("KVC_CPU_ISA"); env != nullptr && env[0] != '\0') {
    absl::StatusOr<CpuIsa> parsed = ParseCpuIsa(env);
    if (parsed.ok()) {
      cap = *parsed;
      s->source.store(static_cast<int>(CapSource::kEnv));
    } else {
      s->env_status =
          absl::InvalidArgumentError(absl::StrCat("KVC_CPU_ISA: ", parsed.status().message()));
      std::fprintf(stderr, "kvc: %s; ignored (no cap)\n", s->env_status.message().data());
    }
  }
  s->cap.store(static_cast<int>(cap));
  s->active.store(std::min(static_cast<int>(cap), static_cast<int>(s->detected)));
  return s;
}

State& GetState() {
  static State* const state = Init();
  return *state;
}

}  // namespace

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kPortable:
      return "portable";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
    case CpuIsa::kAvx512Vnni:
      return "avx512vnni";
    case CpuIsa::kAvx512Bf16:
      return "avx512bf16";
    case CpuIsa::kAmx:
      return "amx";
  }
  return "unknown";
}

absl::StatusOr<CpuIsa> ParseCpuIsa(std::string_view name) {
  const std::string lower = absl::AsciiStrToLower(std::string(name));
  for (CpuIsa isa : {CpuIsa::kPortable, CpuIsa::kAvx2, CpuIsa::kAvx512, CpuIsa::kAvx512Vnni,
                     CpuIsa::kAvx512Bf16, CpuIsa::kAmx}) {
    if (lower == CpuIsaName(isa)) return isa;
  }
  if (lower == "native" || lower == "best") return kBestCpuIsa;
  return absl::InvalidArgumentError(absl::StrCat(
      "\"", std::string(name),
      "\" is not one of portable, avx2, avx512, avx512vnni, avx512bf16, amx, native"));
}

CpuIsa DetectedCpuIsa() { return GetState().detected; }

CpuIsa ActiveCpuIsa() {
  return static_cast<CpuIsa>(GetState().active.load(std::memory_order_relaxed));
}

CpuIsa SetCpuIsaCap(CpuIsa cap) {
  State& s = GetState();
  const int c = std::clamp(static_cast<int>(cap), 0, static_cast<int>(kBestCpuIsa));
  const int previous = s.cap.exchange(c);
  s.active.store(std::min(c, static_cast<int>(s.detected)));
  s.source.store(static_cast<int>(CapSource::kCall));
  return static_cast<CpuIsa>(previous);
}

CpuIsa CpuIsaCap() { return static_cast<CpuIsa>(GetState().cap.load()); }

absl::Status CpuIsaEnvStatus() { return GetState().env_status; }

std::string CpuIsaDescription() {
  State& s = GetState();
  const CpuIsa active = ActiveCpuIsa();
  std::string out(CpuIsaName(active));
  if (active != s.detected) {
    const auto source = static_cast<CapSource>(s.source.load());
    absl::StrAppend(&out, " (capped from ", std::string(CpuIsaName(s.detected)),
                    source == CapSource::kEnv ? " by KVC_CPU_ISA)" : ")");
  }
  return out;
}

std::string CpuFeatureList() {
  const Features& f = GetState().features;
  std::vector<std::string> names;
  const std::pair<bool, std::string_view> all[] = {
      {f.avx2, "avx2"},
      {f.fma, "fma"},
      {f.f16c, "f16c"},
      {f.avx_vnni, "avx_vnni"},
      {f.avx512f, "avx512f"},
      {f.avx512dq, "avx512dq"},
      {f.avx512bw, "avx512bw"},
      {f.avx512vl, "avx512vl"},
      {f.avx512vnni, "avx512vnni"},
      {f.avx512bf16, "avx512bf16"},
      {f.avx512fp16, "avx512fp16"},
      {f.amx, "amx-tile"},
      {f.amx_bf16, "amx-bf16"},
      {f.amx_bf16 && !f.amx_permitted, "(amx not permitted by the kernel)"},
  };
  for (const auto& [has, name] : all) {
    if (has) names.emplace_back(name);
  }
  return names.empty() ? "none" : absl::StrJoin(names, " ");
}

}  // namespace kvc

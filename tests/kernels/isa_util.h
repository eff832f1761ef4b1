// Test helpers for kvc/cpu_isa.h: every instruction-set level, the ones this machine runs, and a
// cap that holds for one scope (tests that run the kernels under each level).
#ifndef KVC_TESTS_KERNELS_ISA_UTIL_H_
#define KVC_TESTS_KERNELS_ISA_UTIL_H_

#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kvc/cpu_isa.h"

namespace kvc::testing_isa {

// portable, avx2, avx512, avx512vnni, avx512bf16, amx.
std::vector<CpuIsa> AllIsas();
// The levels up to DetectedCpuIsa().
std::vector<CpuIsa> SupportedIsas();
bool Supported(CpuIsa isa);

// Caps the kernels at `cap` until destroyed (then restores the previous cap).
class ScopedIsaCap {
 public:
  explicit ScopedIsaCap(CpuIsa cap) : previous_(SetCpuIsaCap(cap)) {}
  ~ScopedIsaCap() { SetCpuIsaCap(previous_); }
  ScopedIsaCap(const ScopedIsaCap&) = delete;
  ScopedIsaCap& operator=(const ScopedIsaCap&) = delete;

 private:
  CpuIsa previous_;
};

// For INSTANTIATE_TEST_SUITE_P(..., ::testing::ValuesIn(AllIsas()), IsaName).
std::string IsaName(const ::testing::TestParamInfo<CpuIsa>& info);

// A parameterized fixture over AllIsas(): SetUp skips (visibly) the levels this CPU lacks and
// caps the kernels at the others for the test's duration.
class IsaTest : public ::testing::TestWithParam<CpuIsa> {
 protected:
  void SetUp() override;
  void TearDown() override;

 private:
  CpuIsa previous_ = kBestCpuIsa;
};

}  // namespace kvc::testing_isa

#endif  // KVC_TESTS_KERNELS_ISA_UTIL_H_

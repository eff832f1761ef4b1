#include "kernels/isa_util.h"

namespace kvc::testing_isa {

std::vector<CpuIsa> AllIsas() {
  return {CpuIsa::kPortable, CpuIsa::kAvx2,       CpuIsa::kAvx512,
          CpuIsa::kAvx512Vnni, CpuIsa::kAvx512Bf16, CpuIsa::kAmx};
}

std::vector<CpuIsa> SupportedIsas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : AllIsas()) {
    if (Supported(isa)) out.push_back(isa);
  }
  return out;
}

bool Supported(CpuIsa isa) { return static_cast<int>(isa) <= static_cast<int>(DetectedCpuIsa()); }

std::string IsaName(const ::testing::TestParamInfo<CpuIsa>& info) {
  return std::string(CpuIsaName(info.param));
}

void IsaTest::SetUp() {
  if (!Supported(GetParam())) {
    GTEST_SKIP() << "this CPU lacks " << CpuIsaName(GetParam()) << " (it has "
                 << CpuIsaName(DetectedCpuIsa()) << ": " << CpuFeatureList() << ")";
  }
  previous_ = SetCpuIsaCap(GetParam());
}

void IsaTest::TearDown() { SetCpuIsaCap(previous_); }

}  // namespace kvc::testing_isa

// kvc/cpu_isa.h: names parse both ways, a cap lowers the level in use and never raises it, the
// description says when a cap holds, and KVC_CPU_ISA is honoured or refused with the variable named
// (the ctest entries kernels_cpu_isa_env_* run this binary with the variable set; see
// tests/kernels/CMakeLists.txt).
#include "kvc/cpu_isa.h"

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/isa_util.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing_isa::AllIsas;
using testing_isa::ScopedIsaCap;

TEST(CpuIsaTest, NamesParseBothWays) {
  for (CpuIsa isa : AllIsas()) {
    absl::StatusOr<CpuIsa> parsed = ParseCpuIsa(CpuIsaName(isa));
    ASSERT_TRUE(parsed.ok()) << parsed.status();
    EXPECT_EQ(*parsed, isa);
  }
  EXPECT_EQ(*ParseCpuIsa("AVX2"), CpuIsa::kAvx2);
  EXPECT_EQ(*ParseCpuIsa("native"), kBestCpuIsa);
  const absl::StatusOr<CpuIsa> bad = ParseCpuIsa("sse9");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("\"sse9\" is not one of portable"));
  EXPECT_FALSE(ParseCpuIsa("").ok());
}

TEST(CpuIsaTest, CapLowersTheLevelAndNeverRaisesIt) {
  const CpuIsa detected = DetectedCpuIsa();
  for (CpuIsa cap : AllIsas()) {
    const ScopedIsaCap scoped(cap);
    EXPECT_EQ(CpuIsaCap(), cap);
    const CpuIsa want = static_cast<int>(cap) < static_cast<int>(detected) ? cap : detected;
    EXPECT_EQ(ActiveCpuIsa(), want) << CpuIsaName(cap);
    EXPECT_EQ(CpuIsaAtLeast(CpuIsa::kAvx2), static_cast<int>(want) >= 1);
    const std::string description = CpuIsaDescription();
    EXPECT_THAT(description, HasSubstr(std::string(CpuIsaName(want))));
    if (want != detected) {
      EXPECT_THAT(description, HasSubstr("capped from " + std::string(CpuIsaName(detected))));
    } else {
      EXPECT_EQ(description, CpuIsaName(detected));
    }
  }
  {
    const ScopedIsaCap scoped(CpuIsa::kPortable);
    EXPECT_FALSE(CpuIsaAtLeast(CpuIsa::kAvx2));
  }
  EXPECT_FALSE(CpuFeatureList().empty());
}

// Whatever the environment holds, the state matches it: set and valid -> that cap; set and
// invalid -> an error naming the variable and no cap; unset -> no cap. The ctest variants set
// KVC_TEST_EXPECT_CAP (or KVC_TEST_EXPECT_ENV_ERROR) so that the check cannot pass vacuously.
TEST(CpuIsaTest, EnvironmentSetsTheCap) {
  const char* env = std::getenv("KVC_CPU_ISA");
  const char* expect_cap = std::getenv("KVC_TEST_EXPECT_CAP");
  const char* expect_error = std::getenv("KVC_TEST_EXPECT_ENV_ERROR");
  const absl::Status st = CpuIsaEnvStatus();
  if (expect_cap != nullptr) {
    ASSERT_NE(env, nullptr) << "KVC_TEST_EXPECT_CAP without KVC_CPU_ISA";
    ASSERT_TRUE(st.ok()) << st;
    EXPECT_EQ(CpuIsaCap(), *ParseCpuIsa(expect_cap));
    EXPECT_FALSE(static_cast<int>(ActiveCpuIsa()) > static_cast<int>(*ParseCpuIsa(expect_cap)));
    return;
  }
  if (expect_error != nullptr) {
    ASSERT_NE(env, nullptr) << "KVC_TEST_EXPECT_ENV_ERROR without KVC_CPU_ISA";
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(st.message()), HasSubstr("KVC_CPU_ISA"));
    EXPECT_THAT(std::string(st.message()), HasSubstr(env));
    EXPECT_EQ(CpuIsaCap(), kBestCpuIsa);
    EXPECT_EQ(ActiveCpuIsa(), DetectedCpuIsa());
    return;
  }
  if (env == nullptr || env[0] == '\0') {
    EXPECT_TRUE(st.ok());
    EXPECT_EQ(CpuIsaCap(), kBestCpuIsa);
    EXPECT_EQ(ActiveCpuIsa(), DetectedCpuIsa());
  } else {
    const absl::StatusOr<CpuIsa> parsed = ParseCpuIsa(env);
    EXPECT_EQ(st.ok(), parsed.ok());
    if (parsed.ok()) {
      EXPECT_EQ(CpuIsaCap(), *parsed);
    }
  }
}

}  // namespace
}  // namespace kvc

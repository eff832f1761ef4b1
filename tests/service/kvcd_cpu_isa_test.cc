// kvcd and KVC_CPU_ISA (kvc/cpu_isa.h): a valid cap is applied and printed at start-up, an invalid
// value makes kvcd refuse to start (exit code 2) naming the variable. The variable is set in the
// child's environment only (KvcdProcess::Options::env). --scoring_math likewise: the start-up
// line names the logits path it gives at the cap, and an unknown value refuses to start.
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/cpu_isa.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing::KvcdProcess;

TEST(KvcdCpuIsaTest, AValidCapIsPrintedAtStartUp) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.env = {"KVC_CPU_ISA=portable"};
  auto p = KvcdProcess::Start(opts);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT((*p)->output(), HasSubstr("kvcd: cpu kernels: portable"));
  // Below avx2 every dtype's scoring logits come from sgemm, and the line says so.
  EXPECT_THAT((*p)->output(), HasSubstr("(scoring logits: f32 f16 bf16: sgemm fp32)"));
}

// kvcd started with these flags and environment exits with 2 (bad flags), saying `message`.
void ExpectRefusesToStart(std::vector<std::string> flags, std::vector<std::string> env,
                          const std::string& message) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = std::move(flags);
  opts.env = std::move(env);
  opts.wait_for_ready = false;
  auto p = KvcdProcess::Start(opts);
  ASSERT_TRUE(p.ok()) << p.status();
  auto code = (*p)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 2);
  EXPECT_THAT((*p)->output(), HasSubstr(message));
}

TEST(KvcdCpuIsaTest, AnInvalidValueRefusesToStart) {
  ExpectRefusesToStart({}, {"KVC_CPU_ISA=avx9000"}, "KVC_CPU_ISA: \"avx9000\" is not one of");
}

TEST(KvcdCpuIsaTest, ScoringMathNamesItsPathAtStartUp) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = {"--scoring_math=integer"};
  opts.env = {"KVC_CPU_ISA=portable"};  // no int8 kernel below avx2: the exact path (sgemm)
  auto p = KvcdProcess::Start(opts);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT((*p)->output(), HasSubstr("(scoring logits: f32 f16 bf16: sgemm fp32)"));
  if (DetectedCpuIsa() < CpuIsa::kAvx2) {
    GTEST_SKIP() << "this CPU lacks avx2 (" << CpuFeatureList()
                 << "): the int8 paths' lines are not checked";
  }
  opts.env = {"KVC_CPU_ISA=avx2"};  // the AVX2 int8 kernel
  p = KvcdProcess::Start(opts);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT((*p)->output(),
              HasSubstr("(scoring logits: f32 f16 bf16: avx2 int8 dot products (7-bit queries))"));
  if (DetectedCpuIsa() < CpuIsa::kAvx512Vnni) {
    GTEST_SKIP() << "this CPU lacks avx512vnni (" << CpuFeatureList()
                 << "): the int8 path's line is not checked";
  }
  opts.env = {"KVC_CPU_ISA=avx512vnni"};
  p = KvcdProcess::Start(opts);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT((*p)->output(),
              HasSubstr("(scoring logits: f32 f16 bf16: avx512-vnni int8 dot products)"));
}

TEST(KvcdCpuIsaTest, AnUnknownScoringMathRefusesToStart) {
  ExpectRefusesToStart({"--scoring_math=fast"}, {},
                       "--scoring_math: unknown 'fast' (expected exact or integer)");
}

}  // namespace
}  // namespace kvc

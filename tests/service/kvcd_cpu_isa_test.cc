// kvcd and KVC_CPU_ISA (kvc/cpu_isa.h): a valid cap is applied and printed at start-up, an invalid
// value makes kvcd refuse to start (exit code 2) naming the variable. The variable is set in this
// process just for the spawn (the child inherits it).
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing::KvcdProcess;

// Sets KVC_CPU_ISA for the scope, restoring what was there.
class ScopedEnv {
 public:
  explicit ScopedEnv(const char* value) {
    if (const char* old = std::getenv("KVC_CPU_ISA"); old != nullptr) {
      old_ = old;
      had_ = true;
    }
    setenv("KVC_CPU_ISA", value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      setenv("KVC_CPU_ISA", old_.c_str(), 1);
    } else {
      unsetenv("KVC_CPU_ISA");
    }
  }

 private:
  std::string old_;
  bool had_ = false;
};

TEST(KvcdCpuIsaTest, AValidCapIsPrintedAtStartUp) {
  const ScopedEnv env("portable");
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  auto p = KvcdProcess::Start(opts);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_THAT((*p)->output(), HasSubstr("kvcd: cpu kernels: portable"));
  // Below avx512bf16 every dtype's scoring logits come from sgemm, and the line says so.
  EXPECT_THAT((*p)->output(), HasSubstr("(scoring logits: f32 f16 bf16: sgemm fp32)"));
}

TEST(KvcdCpuIsaTest, AnInvalidValueRefusesToStart) {
  const ScopedEnv env("avx9000");
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.wait_for_ready = false;
  auto p = KvcdProcess::Start(opts);
  ASSERT_TRUE(p.ok()) << p.status();
  auto code = (*p)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 2);
  EXPECT_THAT((*p)->output(), HasSubstr("KVC_CPU_ISA: \"avx9000\" is not one of"));
}

}  // namespace
}  // namespace kvc

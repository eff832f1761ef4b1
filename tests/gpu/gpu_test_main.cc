// main() of the GPU test binaries (gpu_util.h): the skip protocol and the fault check.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>

#include "gpu_util.h"
#include "gtest/gtest.h"

namespace kvc::gpu_testing {
namespace {

// After every test: a CUDA error that survives clearing (a sticky one: the context is broken)
// stops the binary, naming the test, instead of failing every later test for it.
class FaultCheck : public ::testing::EmptyTestEventListener {
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (cudaDeviceSynchronize() == cudaSuccess) return;
    cudaGetLastError();  // clears an ordinary error; a sticky one stays
    const cudaError_t again = cudaDeviceSynchronize();
    if (again == cudaSuccess) return;
    std::printf("KVC-GPU-FAULT: %s.%s: %s (%s)\n", info.test_suite_name(), info.name(),
                cudaGetErrorName(again), cudaGetErrorString(again));
    std::fflush(stdout);
    std::_Exit(kFaultExitCode);
  }
};

}  // namespace

int RunGpuTests(int argc, char** argv, const std::function<bool()>& also_needed) {
  ::testing::InitGoogleTest(&argc, argv);
  if (!GTEST_FLAG_GET(list_tests)) {
    if (!DeviceOrSkipMessage()) return kSkipExitCode;
    if (also_needed && !also_needed()) {
      std::fflush(stdout);
      return kSkipExitCode;
    }
  }
  ::testing::UnitTest::GetInstance()->listeners().Append(new FaultCheck());
  return RUN_ALL_TESTS();
}

}  // namespace kvc::gpu_testing

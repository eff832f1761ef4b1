// Test helper for the NCCL test: a producer kernel that takes a while before it writes its bytes,
// so that a send not ordered after it would read the old ones.
#ifndef KVC_TESTS_GPU_NCCL_TEST_KERNELS_H_
#define KVC_TESTS_GPU_NCCL_TEST_KERNELS_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace kvc::gpu_testing {

// On `stream`: one thread spins for about `spin_ms` milliseconds, then the grid writes
// dst[i] = uint8_t(i * 131 + 7) for i in [0, n). Returns the launch error.
cudaError_t LaunchSlowFill(uint8_t* dst, size_t n, int spin_ms, cudaStream_t stream);

}  // namespace kvc::gpu_testing

#endif  // KVC_TESTS_GPU_NCCL_TEST_KERNELS_H_

// Device code of kvc_gpu_bench that the engine does not need: the softmax step of the cuBLAS
// decode formulation.
#ifndef KVC_TESTS_GPU_BENCH_KERNELS_H_
#define KVC_TESTS_GPU_BENCH_KERNELS_H_

#include <cuda_runtime_api.h>

namespace kvc::gpu_testing {

// For each of `rows` rows of `cols` floats: p = softmax(row), written as fp16 to probs_half
// (same shape). cols >= 1.
cudaError_t LaunchSoftmaxToHalf(const float* scores, int rows, int cols, void* probs_half,
                                cudaStream_t stream);

}  // namespace kvc::gpu_testing

#endif  // KVC_TESTS_GPU_BENCH_KERNELS_H_

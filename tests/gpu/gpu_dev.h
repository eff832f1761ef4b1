// Dev<T>: a device buffer for the GPU tests (allocation and copies checked with EXPECT_EQ).
#ifndef KVC_TESTS_GPU_GPU_DEV_H_
#define KVC_TESTS_GPU_GPU_DEV_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <vector>

#include "gtest/gtest.h"

namespace kvc::gpu_testing {

template <typename T>
struct Dev {
  T* p = nullptr;
  explicit Dev(size_t n) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&p), sizeof(T) * std::max<size_t>(n, 1)),
              cudaSuccess);
  }
  Dev(const T* host, size_t n) : Dev(n) {
    EXPECT_EQ(cudaMemcpy(p, host, sizeof(T) * n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  std::vector<T> Get(size_t n) const {
    std::vector<T> h(n);
    EXPECT_EQ(cudaMemcpy(h.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost), cudaSuccess);
    return h;
  }
};

}  // namespace kvc::gpu_testing

#endif  // KVC_TESTS_GPU_GPU_DEV_H_

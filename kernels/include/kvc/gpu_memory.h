// Device memory held by the CUDA backend, for the kvc_gpu_memory_used_bytes gauge.
#ifndef KVC_GPU_MEMORY_H_
#define KVC_GPU_MEMORY_H_

#include <cstdint>

#ifdef KVC_HAVE_CUDA
namespace kvc::cuda {
uint64_t DeviceMemoryUsed();
}
#endif

namespace kvc {

// Bytes of device memory held by the memory pools of all live CUDA backends (0 without CUDA or
// without a live CUDA backend). Thread-safe and cheap enough to call on every metrics scrape.
inline uint64_t GpuMemoryUsedBytes() {
#ifdef KVC_HAVE_CUDA
  return cuda::DeviceMemoryUsed();
#else
  return 0;
#endif
}

}  // namespace kvc

#endif  // KVC_GPU_MEMORY_H_

// Internal entry points of the CUDA backend, called by the backend registry (kernels/registry.cc)
// and by the GPU tests. The public way to read the device memory in use is kvc/gpu_memory.h.
#ifndef KVC_KERNELS_CUDA_CUDA_BACKEND_H_
#define KVC_KERNELS_CUDA_CUDA_BACKEND_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "core/host_fallback.h"
#include "kvc/backend_interface.h"

namespace kvc::cuda {

// True when a CUDA device is visible; otherwise false and *why_not says why.
bool DeviceAvailable(std::string* why_not);

// UNAVAILABLE (with the reason) when no device is visible or options.device is not one of them.
// The backend owns a small pool of streams with pinned host staging buffers and a device memory
// pool; every Compress/Attend call takes one stream for its duration (blocking while all are in
// use), so concurrent calls are safe. `host` runs the steps that have no device path (head-adaptive
// budgets after scoring, expected attention's query statistics); it must outlive the backend.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackendImpl(const BackendOptions& options,
                                                               const HostFallback* host);

// Bytes of device memory held by the memory pools of all live CUDA backends (including memory
// cached by the pools for reuse). 0 when none exists. Thread-safe.
uint64_t DeviceMemoryUsed();

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_CUDA_BACKEND_H_

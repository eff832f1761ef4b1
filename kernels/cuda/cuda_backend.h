// Internal entry points of the CUDA backend, called by kernels/cpu/backend.cc's factory.
#ifndef KVC_KERNELS_CUDA_CUDA_BACKEND_H_
#define KVC_KERNELS_CUDA_CUDA_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvc/backend.h"

namespace kvc::cuda {

// True when a CUDA device is visible; otherwise false and *why_not says why.
bool DeviceAvailable(std::string* why_not);
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackendImpl(const BackendOptions& options);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_CUDA_BACKEND_H_

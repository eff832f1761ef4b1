// The backend registry: creates the engine for a device. The interface every backend implements
// (Backend, BackendOptions, CompressTimings) is in kvc/backend_interface.h (kernels/core); this is
// the one place that knows both implementations, kernels/cpu and kernels/cuda.
#ifndef KVC_BACKEND_H_
#define KVC_BACKEND_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "kvc/attention.h"
#include "kvc/backend_interface.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/spec.h"

namespace kvc {

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const BackendOptions& options);
// UNAVAILABLE (with the reason) when kvc was built without CUDA or no device is visible.
absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendOptions& options);
// kAuto: CUDA when a device is visible, else CPU.
absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind,
                                                       const BackendOptions& options);

// True when kvc was built with CUDA and a device is visible; otherwise false with the reason.
bool CudaDeviceAvailable(std::string* why_not);

}  // namespace kvc

#endif  // KVC_BACKEND_H_

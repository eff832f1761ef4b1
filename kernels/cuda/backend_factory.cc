// Factory for the CUDA backend: reports UNAVAILABLE (with the reason) when no device is visible.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda/cuda_backend.h"

namespace kvc::cuda {

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackendImpl(const BackendOptions& options) {
  std::string why;
  if (!DeviceAvailable(&why)) {
    return absl::UnavailableError(absl::StrCat("cuda backend unavailable: ", why));
  }
  return absl::UnimplementedError("cuda backend: device kernels are not built yet");
}

}  // namespace kvc::cuda

// Backend selection. The CUDA backend is linked in only when kvc was built with CUDA.
#include "kvc/backend.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

#ifdef KVC_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace kvc {

absl::StatusOr<BackendKind> ParseBackendKind(std::string_view name) {
  const std::string n = absl::AsciiStrToLower(std::string(name));
  if (n == "auto") return BackendKind::kAuto;
  if (n == "cpu") return BackendKind::kCpu;
  if (n == "cuda") return BackendKind::kCuda;
  return absl::InvalidArgumentError(
      absl::StrCat("backend: unknown '", std::string(name), "' (expected auto, cpu or cuda)"));
}

bool CudaDeviceAvailable(std::string* why_not) {
#ifdef KVC_HAVE_CUDA
  return cuda::DeviceAvailable(why_not);
#else
  if (why_not) *why_not = "kvc was built without CUDA (KVC_CUDA=OFF or no nvcc at build time)";
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendOptions& options) {
#ifdef KVC_HAVE_CUDA
  return cuda::CreateCudaBackendImpl(options);
#else
  std::string why;
  CudaDeviceAvailable(&why);
  return absl::UnavailableError(absl::StrCat("cuda backend unavailable: ", why));
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateBackend(BackendKind kind,
                                                       const BackendOptions& options) {
  switch (kind) {
    case BackendKind::kCpu:
      return CreateCpuBackend(options);
    case BackendKind::kCuda:
      return CreateCudaBackend(options);
    case BackendKind::kAuto:
      if (CudaDeviceAvailable(nullptr)) return CreateCudaBackend(options);
      return CreateCpuBackend(options);
  }
  return absl::InvalidArgumentError("backend: unknown kind");
}

}  // namespace kvc

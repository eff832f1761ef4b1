// The backend registry: the one place that knows both engines. kernels/cpu and kernels/cuda
// depend on kernels/core only; the CUDA backend gets the CPU engine's host stages from here
// (core/host_fallback.h). The CUDA backend is linked in only when kvc was built with CUDA.
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cpu/cpu_backend.h"
#include "kvc/backend.h"

#ifdef KVC_HAVE_CUDA
#include "cuda/cuda_backend.h"
#endif

namespace kvc {

bool CudaDeviceAvailable(std::string* why_not) {
#ifdef KVC_HAVE_CUDA
  return cuda::DeviceAvailable(why_not);
#else
  if (why_not) *why_not = "kvc was built without CUDA (KVC_CUDA=OFF or no nvcc at build time)";
  return false;
#endif
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCpuBackend(const BackendOptions& options) {
  if (options.num_threads < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_threads: ", options.num_threads, " must be >= 0 (0 = all cores)"));
  }
  return cpu::NewCpuBackend(options);
}

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackend(const BackendOptions& options) {
#ifdef KVC_HAVE_CUDA
  return cuda::CreateCudaBackendImpl(options, &cpu::HostEngine());
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

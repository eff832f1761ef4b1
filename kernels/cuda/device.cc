// Device discovery for the CUDA backend.
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_backend.h"

namespace kvc::cuda {
namespace {

// "13.0" from CUDA's 1000 * major + 10 * minor.
std::string CudaVersionString(int v) { return absl::StrCat(v / 1000, ".", (v % 1000) / 10); }

}  // namespace

bool DeviceAvailable(std::string* why_not) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why_not) {
      // The versions tell a missing driver (0) from one older than the runtime kvc links
      // statically (cudaErrorInsufficientDriver with a nonzero driver version).
      int driver = 0, runtime = 0;
      cudaDriverGetVersion(&driver);
      cudaRuntimeGetVersion(&runtime);
      *why_not = absl::StrCat(
          "no usable CUDA device: cudaGetDeviceCount: ", cudaGetErrorName(err), " (",
          cudaGetErrorString(err), "); the driver supports CUDA ",
          driver == 0 ? std::string("none (no driver loaded)") : CudaVersionString(driver),
          ", kvc's CUDA runtime is ", CudaVersionString(runtime));
    }
    cudaGetLastError();  // clear the error state
    return false;
  }
  if (count == 0) {
    if (why_not) *why_not = "no CUDA device is visible";
    return false;
  }
  return true;
}

}  // namespace kvc::cuda

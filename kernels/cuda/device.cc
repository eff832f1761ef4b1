// Device discovery for the CUDA backend.
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_backend.h"

namespace kvc::cuda {

bool DeviceAvailable(std::string* why_not) {
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    if (why_not) *why_not = absl::StrCat("no usable CUDA device: ", cudaGetErrorString(err));
    cudaGetLastError();  // clear the sticky error
    return false;
  }
  if (count == 0) {
    if (why_not) *why_not = "no CUDA device is visible";
    return false;
  }
  return true;
}

}  // namespace kvc::cuda

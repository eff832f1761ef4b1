// Layers whose K, V and Q_obs are already in device memory (LayerInput::memory == kDevice): the
// checks the CUDA backend makes on them, and the host copy the steps without a device path
// (expected attention's query statistics, head-adaptive packing) need.
#ifndef KVC_KERNELS_CUDA_DEVICE_INPUT_H_
#define KVC_KERNELS_CUDA_DEVICE_INPUT_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kvc/layer.h"

namespace kvc::cuda {

// INVALID_ARGUMENT naming the tensor unless k, v (and q_obs when W > 0) are device (or managed)
// memory of CUDA device `device`. The sizes cannot be checked.
absl::Status CheckDeviceInput(const LayerInput& in, int device);

// A host copy of a device-resident layer: `view` is `in` with host pointers (and memory kHost)
// for Q_obs and, with `with_kv`, K and V (else they stay null). Synchronous.
struct HostInput {
  std::vector<uint8_t> k, v, q;
  LayerInput view;
};
absl::StatusOr<HostInput> CopyInputToHost(const LayerInput& in, bool with_kv);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_DEVICE_INPUT_H_

#include "cuda/device_input.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "cuda/resources.h"
#include "kvc/dtype.h"

namespace kvc::cuda {
namespace {

absl::Status CheckPointer(const char* name, const void* p, int device) {
  cudaPointerAttributes attr = {};
  const cudaError_t err = cudaPointerGetAttributes(&attr, p);
  if (err != cudaSuccess) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": not a CUDA pointer (", cudaGetErrorString(err), ")"));
  }
  if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": memory is kDevice, but the pointer is ",
        attr.type == cudaMemoryTypeHost ? "pinned host" : "unregistered host", " memory"));
  }
  if (attr.type == cudaMemoryTypeDevice && attr.device != device) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": memory of CUDA device ", attr.device,
                                                   ", but this backend runs on device ", device));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckDeviceInput(const LayerInput& in, int device) {
  if (absl::Status s = CheckPointer("k", in.k, device); !s.ok()) return s;
  if (absl::Status s = CheckPointer("v", in.v, device); !s.ok()) return s;
  if (in.shape.obs_window > 0) return CheckPointer("q_obs", in.q_obs, device);
  return absl::OkStatus();
}

absl::StatusOr<HostInput> CopyInputToHost(const LayerInput& in, bool with_kv) {
  const LayerShape& sh = in.shape;
  const size_t es = DTypeSize(in.dtype);
  HostInput h;
  h.view = in;
  h.view.memory = MemorySpace::kHost;
  h.view.k = h.view.v = h.view.q_obs = nullptr;
  if (with_kv) {
    const size_t kv_bytes = static_cast<size_t>(sh.num_kv_heads) * sh.seq_len * sh.head_dim * es;
    h.k.resize(kv_bytes);
    h.v.resize(kv_bytes);
    KVC_CUDA_RETURN_IF_ERROR(cudaMemcpy(h.k.data(), in.k, kv_bytes, cudaMemcpyDeviceToHost),
                             "copy k to host");
    KVC_CUDA_RETURN_IF_ERROR(cudaMemcpy(h.v.data(), in.v, kv_bytes, cudaMemcpyDeviceToHost),
                             "copy v to host");
    h.view.k = h.k.data();
    h.view.v = h.v.data();
  }
  if (sh.obs_window > 0) {
    const size_t q_bytes = static_cast<size_t>(sh.num_q_heads) * sh.obs_window * sh.head_dim * es;
    h.q.resize(q_bytes);
    KVC_CUDA_RETURN_IF_ERROR(cudaMemcpy(h.q.data(), in.q_obs, q_bytes, cudaMemcpyDeviceToHost),
                             "copy q_obs to host");
    h.view.q_obs = h.q.data();
  }
  return absl::StatusOr<HostInput>(std::move(h));  // moving keeps the vectors' buffers
}

}  // namespace kvc::cuda

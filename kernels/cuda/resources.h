// Reusable per-call resources of the CUDA backend: a fixed pool of streams, each with a pinned
// host staging buffer and timing events, and a device memory pool from which every call takes one
// arena (cudaMallocAsync on the call's stream; the pool keeps freed memory cached, so steady-state
// calls do not reach the driver's allocator).
#ifndef KVC_KERNELS_CUDA_RESOURCES_H_
#define KVC_KERNELS_CUDA_RESOURCES_H_

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvc::cuda {

// absl::Status from a CUDA error; `what` names the operation.
absl::Status CudaStatus(cudaError_t err, const char* what);

// True for the errors after which the CUDA context is unusable for the rest of the process (a
// kernel fault such as cudaErrorIllegalAddress): every later call on the device fails.
bool IsStickyError(cudaError_t err);

#define KVC_CUDA_RETURN_IF_ERROR(expr, what)                                     \
  do {                                                                           \
    const cudaError_t kvc_err_ = (expr);                                         \
    if (kvc_err_ != cudaSuccess) return ::kvc::cuda::CudaStatus(kvc_err_, what); \
  } while (0)

inline constexpr int kNumTimingEvents = 6;

struct StreamSlot {
  cudaStream_t stream = nullptr;
  void* pinned = nullptr;  // cudaHostAlloc'ed staging, grown on demand, reused across calls
  size_t pinned_bytes = 0;
  cudaEvent_t events[kNumTimingEvents] = {};

  // Ensures the staging buffer holds at least `bytes` (allocates only when it must grow).
  absl::Status ReservePinned(size_t bytes);
};

class SlotPool {
 public:
  // Creates `n` streams on `device`, and the device memory pool.
  static absl::StatusOr<std::unique_ptr<SlotPool>> Create(int device, int n);
  ~SlotPool();
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  // Blocks until a slot is free. Release returns it.
  StreamSlot* Acquire();
  void Release(StreamSlot* slot);

  cudaMemPool_t mem_pool() const { return mem_pool_; }
  int device() const { return device_; }

  // OK until a sticky error was noted; then that error, explained, for every later call (one
  // fault must not masquerade as unrelated failures of the calls after it).
  absl::Status broken() const;
  // The status for `err` from operation `what`; a sticky error also marks the pool broken.
  absl::Status Note(cudaError_t err, const char* what);

 private:
  SlotPool() = default;
  int device_ = 0;
  cudaMemPool_t mem_pool_ = nullptr;
  std::vector<StreamSlot> slots_;
  mutable absl::Mutex mu_;
  std::vector<StreamSlot*> free_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

// Carves 256-byte-aligned sub-buffers out of one cudaMallocAsync allocation.
class Arena {
 public:
  // Adds a request of `bytes`; returns its offset. Call before Allocate.
  size_t Add(size_t bytes);
  // Allocates the total from `pool` on `stream`.
  absl::Status Allocate(cudaMemPool_t pool, cudaStream_t stream);
  // Frees on `stream` (stream-ordered: safe while kernels using it are still queued).
  void Free(cudaStream_t stream);
  template <typename T>
  T* At(size_t offset) const {
    return reinterpret_cast<T*>(base_ + offset);
  }
  size_t total() const { return total_; }

 private:
  size_t total_ = 0;
  uint8_t* base_ = nullptr;
};

// Registers / unregisters a pool for DeviceMemoryUsed().
void RegisterPool(cudaMemPool_t pool);
void UnregisterPool(cudaMemPool_t pool);

}  // namespace kvc::cuda

#endif  // KVC_KERNELS_CUDA_RESOURCES_H_

#include "cuda/resources.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_backend.h"

namespace kvc::cuda {
namespace {

absl::Mutex g_pools_mu(absl::kConstInit);
std::vector<cudaMemPool_t>& Pools() {
  static auto* pools = new std::vector<cudaMemPool_t>();
  return *pools;
}

}  // namespace

absl::Status CudaStatus(cudaError_t err, const char* what) {
  const std::string msg =
      absl::StrCat("cuda: ", what, ": ", cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  if (err == cudaErrorInvalidValue) return absl::InvalidArgumentError(msg);
  return absl::InternalError(msg);
}

bool IsStickyError(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

absl::Status StreamSlot::ReservePinned(size_t bytes) {
  if (bytes <= pinned_bytes) return absl::OkStatus();
  // Grow geometrically so that a slowly growing workload reallocates O(log n) times.
  const size_t want = std::max(bytes, pinned_bytes * 2);
  if (pinned != nullptr) {
    // The previous contents are not needed; the stream is idle between calls.
    cudaFreeHost(pinned);
    pinned = nullptr;
    pinned_bytes = 0;
  }
  KVC_CUDA_RETURN_IF_ERROR(cudaHostAlloc(&pinned, want, cudaHostAllocDefault),
                           "cudaHostAlloc staging buffer");
  pinned_bytes = want;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<SlotPool>> SlotPool::Create(int device, int n) {
  std::unique_ptr<SlotPool> pool(new SlotPool());
  pool->device_ = device;
  KVC_CUDA_RETURN_IF_ERROR(cudaSetDevice(device), "cudaSetDevice");
  cudaMemPoolProps props = {};
  props.allocType = cudaMemAllocationTypePinned;
  props.location.type = cudaMemLocationTypeDevice;
  props.location.id = device;
  KVC_CUDA_RETURN_IF_ERROR(cudaMemPoolCreate(&pool->mem_pool_, &props), "cudaMemPoolCreate");
  // Keep freed memory cached in the pool instead of returning it at every synchronization.
  uint64_t threshold = std::numeric_limits<uint64_t>::max();
  KVC_CUDA_RETURN_IF_ERROR(
      cudaMemPoolSetAttribute(pool->mem_pool_, cudaMemPoolAttrReleaseThreshold, &threshold),
      "cudaMemPoolSetAttribute");
  RegisterPool(pool->mem_pool_);
  pool->slots_.resize(n);
  for (StreamSlot& s : pool->slots_) {
    KVC_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&s.stream, cudaStreamNonBlocking),
                             "cudaStreamCreate");
    for (cudaEvent_t& e : s.events) {
      KVC_CUDA_RETURN_IF_ERROR(cudaEventCreate(&e), "cudaEventCreate");
    }
  }
  absl::MutexLock lock(&pool->mu_);
  for (StreamSlot& s : pool->slots_) pool->free_.push_back(&s);
  return pool;
}

SlotPool::~SlotPool() {
  cudaSetDevice(device_);
  for (StreamSlot& s : slots_) {
    if (s.stream != nullptr) {
      cudaStreamSynchronize(s.stream);
      cudaStreamDestroy(s.stream);
    }
    for (cudaEvent_t e : s.events) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    if (s.pinned != nullptr) cudaFreeHost(s.pinned);
  }
  if (mem_pool_ != nullptr) {
    UnregisterPool(mem_pool_);
    cudaMemPoolDestroy(mem_pool_);
  }
}

StreamSlot* SlotPool::Acquire() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](std::vector<StreamSlot*>* f) { return !f->empty(); }, &free_));
  StreamSlot* s = free_.back();
  free_.pop_back();
  return s;
}

void SlotPool::Release(StreamSlot* slot) {
  absl::MutexLock lock(&mu_);
  free_.push_back(slot);
}

absl::Status SlotPool::broken() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

absl::Status SlotPool::Note(cudaError_t err, const char* what) {
  const absl::Status s = CudaStatus(err, what);
  if (!IsStickyError(err)) return s;
  absl::MutexLock lock(&mu_);
  if (broken_.ok()) {
    broken_ = absl::InternalError(absl::StrCat(
        "cuda backend: the CUDA context of device ", device_, " is unusable after a fault (",
        s.message(), "); every later call fails until the process restarts"));
  }
  return broken_;
}

size_t Arena::Add(size_t bytes) {
  const size_t off = total_;
  total_ += (bytes + 255) / 256 * 256;
  return off;
}

absl::Status Arena::Allocate(cudaMemPool_t pool, cudaStream_t stream) {
  void* p = nullptr;
  KVC_CUDA_RETURN_IF_ERROR(cudaMallocFromPoolAsync(&p, std::max<size_t>(total_, 256), pool, stream),
                           "cudaMallocFromPoolAsync");
  base_ = static_cast<uint8_t*>(p);
  return absl::OkStatus();
}

void Arena::Free(cudaStream_t stream) {
  if (base_ != nullptr) cudaFreeAsync(base_, stream);
  base_ = nullptr;
}

void RegisterPool(cudaMemPool_t pool) {
  absl::MutexLock lock(&g_pools_mu);
  Pools().push_back(pool);
}

void UnregisterPool(cudaMemPool_t pool) {
  absl::MutexLock lock(&g_pools_mu);
  auto& p = Pools();
  p.erase(std::remove(p.begin(), p.end(), pool), p.end());
}

uint64_t DeviceMemoryUsed() {
  absl::MutexLock lock(&g_pools_mu);
  uint64_t total = 0;
  for (cudaMemPool_t pool : Pools()) {
    uint64_t reserved = 0;
    if (cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) ==
        cudaSuccess) {
      total += reserved;
    }
  }
  return total;
}

}  // namespace kvc::cuda

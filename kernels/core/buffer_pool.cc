#include "kvc/buffer_pool.h"

#include <sys/mman.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <climits>
#include <new>
#include <utility>

#include "kvc/bytes.h"

namespace kvc {
static_assert(BufferPool::kMinPooledBytes == internal::kLargeBlockBytes);
namespace {

uint8_t* MapBuffer(size_t capacity) {
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  // Large buffers are written front to back: 2 MiB pages cut the page faults (the dominant cost
  // of fresh memory) by a factor of 512. Advisory; failure only costs speed.
  (void)madvise(p, capacity, MADV_HUGEPAGE);
  return static_cast<uint8_t*>(p);
}

}  // namespace

BufferPool::Buffer& BufferPool::Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void BufferPool::Buffer::reset() {
  if (data_ == nullptr) return;
  if (pool_ != nullptr) {
    pool_->Release(data_, capacity_);
  } else {
    delete[] data_;
  }
  pool_ = nullptr;
  data_ = nullptr;
  capacity_ = 0;
}

BufferPool::BufferPool(uint64_t cap_bytes) : cap_(cap_bytes) {}

BufferPool::~BufferPool() {
  absl::MutexLock lock(&mu_);
  for (auto& [capacity, data] : idle_) munmap(data, capacity);
  idle_.clear();
  idle_bytes_ = 0;
}

uint8_t* BufferPool::TakeIdle(size_t min, size_t max, size_t* capacity) {
  absl::MutexLock lock(&mu_);
  auto it = idle_.lower_bound(min);
  if (it != idle_.end() && it->first <= max) {
    *capacity = it->first;
    uint8_t* data = it->second;
    idle_bytes_ -= it->first;
    idle_.erase(it);
    ++reused_;
    return data;
  }
  ++mapped_;
  return nullptr;
}

BufferPool::Buffer BufferPool::Acquire(size_t bytes) {
  Buffer b;
  if (bytes == 0) return b;
  if (bytes < kMinPooledBytes) {
    b.data_ = new (std::nothrow) uint8_t[bytes];  // default-initialized: no zero fill
    b.capacity_ = b.data_ ? bytes : 0;
    return b;
  }
  const size_t rounded = Rounded(bytes);
  // Best fit among buffers no more than twice the need, so one small upload cannot pin a huge
  // buffer while larger ones map fresh memory.
  size_t capacity = 0;
  uint8_t* data = TakeIdle(rounded, 2 * rounded, &capacity);
  if (data == nullptr) {
    data = MapBuffer(rounded);
    capacity = rounded;
  }
  if (data == nullptr) return b;
  b.pool_ = this;
  b.data_ = data;
  b.capacity_ = capacity;
  return b;
}

void* BufferPool::AllocateBlock(size_t bytes) {
  const size_t rounded = Rounded(bytes);
  size_t capacity = 0;
  uint8_t* data = TakeIdle(rounded, rounded, &capacity);  // exact: FreeBlock recomputes it
  return data != nullptr ? data : MapBuffer(rounded);
}

void BufferPool::FreeBlock(void* p, size_t bytes) {
  if (p != nullptr) Release(static_cast<uint8_t*>(p), Rounded(bytes));
}

void BufferPool::Release(uint8_t* data, size_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    // Make room by dropping smaller idle buffers first: the largest are the costliest to remap.
    // A buffer larger than the whole cap is never kept, so it displaces nothing.
    while (capacity <= cap_ && idle_bytes_ + capacity > cap_ && !idle_.empty() &&
           idle_.begin()->first < capacity) {
      UnmapSmallestIdle();
    }
    if (idle_bytes_ + capacity <= cap_) {
      idle_.emplace(capacity, data);
      idle_bytes_ += capacity;
      return;
    }
  }
  munmap(data, capacity);
}

void BufferPool::set_cap(uint64_t cap_bytes) {
  absl::MutexLock lock(&mu_);
  cap_ = cap_bytes;
  while (idle_bytes_ > cap_) UnmapSmallestIdle();  // smallest first, as in Release
}

void BufferPool::UnmapSmallestIdle() {
  auto smallest = idle_.begin();
  munmap(smallest->second, smallest->first);
  idle_bytes_ -= smallest->first;
  idle_.erase(smallest);
}

uint64_t BufferPool::cap_bytes() const {
  absl::MutexLock lock(&mu_);
  return cap_;
}

uint64_t BufferPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_bytes_;
}

uint64_t BufferPool::reused() const {
  absl::MutexLock lock(&mu_);
  return reused_;
}

uint64_t BufferPool::mapped() const {
  absl::MutexLock lock(&mu_);
  return mapped_;
}

bool ReuseLargeMallocs(size_t trim_bytes) {
#if defined(__GLIBC__)
  return mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1 &&
         mallopt(M_TRIM_THRESHOLD, static_cast<int>(std::min<size_t>(trim_bytes, INT_MAX))) == 1;
#else
  (void)trim_bytes;
  return false;
#endif
}

BufferPool& LargeBuffers() {
  static BufferPool* const pool = new BufferPool(0);
  return *pool;
}

namespace internal {

void* AllocateLargeBlock(size_t bytes) {
  void* p = LargeBuffers().AllocateBlock(bytes);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}

void FreeLargeBlock(void* p, size_t bytes) noexcept { LargeBuffers().FreeBlock(p, bytes); }

}  // namespace internal
}  // namespace kvc

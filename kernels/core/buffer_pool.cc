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
  for (auto& [data, capacity] : idle_by_address_) munmap(data, capacity);
  idle_.clear();
  idle_by_address_.clear();
  idle_bytes_ = 0;
}

void BufferPool::AddIdle(uint8_t* data, size_t capacity) {
  // Coalesce with the idle pieces just before and just after: pieces of one mapping split by
  // earlier requests become one buffer again. Adjacent pieces of two mappings merge too; munmap
  // takes any range, so the merged buffer is unmapped as one.
  auto next = idle_by_address_.lower_bound(data);
  if (next != idle_by_address_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == data) {
      data = prev->first;
      capacity += prev->second;
      EraseIdle(prev->first, prev->second);
    }
  }
  next = idle_by_address_.lower_bound(data + capacity);
  if (next != idle_by_address_.end() && next->first == data + capacity) {
    capacity += next->second;
    EraseIdle(next->first, next->second);
  }
  idle_.emplace(capacity, data);
  idle_by_address_.emplace(data, capacity);
}

void BufferPool::EraseIdle(uint8_t* data, size_t capacity) {
  auto [first, last] = idle_.equal_range(capacity);
  for (auto it = first; it != last; ++it) {
    if (it->second == data) {
      idle_.erase(it);
      break;
    }
  }
  idle_by_address_.erase(data);
}

uint8_t* BufferPool::TakeIdle(size_t rounded, size_t max, size_t* capacity) {
  absl::MutexLock lock(&mu_);
  auto it = idle_.lower_bound(rounded);
  if (it == idle_.end()) {
    ++mapped_;
    return nullptr;
  }
  uint8_t* data = it->second;
  const size_t whole = it->first;
  EraseIdle(data, whole);
  ++reused_;
  if (whole <= max) {  // best fit
    idle_bytes_ -= whole;
    *capacity = whole;
    return data;
  }
  // The front of a larger buffer; the rest stays idle. Both are multiples of the granule.
  AddIdle(data + rounded, whole - rounded);
  idle_bytes_ -= rounded;
  *capacity = rounded;
  return data;
}

uint8_t* BufferPool::Obtain(size_t rounded, size_t max, size_t* capacity) {
  uint8_t* data = TakeIdle(rounded, max, capacity);
  if (data != nullptr) return data;
  *capacity = rounded;
  return MapBuffer(rounded);
}

BufferPool::Buffer BufferPool::Acquire(size_t bytes) {
  Buffer b;
  if (bytes == 0) return b;
  if (bytes < kMinPooledBytes) {
    b.data_ = new (std::nothrow) uint8_t[bytes];  // default-initialized: no zero fill
    b.capacity_ = b.data_ ? bytes : 0;
    return b;
  }
  if (bytes > kMaxBytes) return b;
  const size_t rounded = Rounded(bytes);
  // A whole idle buffer only up to twice the need, so one small upload cannot pin a huge buffer;
  // a larger one gives its front.
  size_t capacity = 0;
  uint8_t* data = Obtain(rounded, 2 * rounded, &capacity);
  if (data == nullptr) return b;
  b.pool_ = this;
  b.data_ = data;
  b.capacity_ = capacity;
  return b;
}

void* BufferPool::AllocateBlock(size_t bytes) {
  if (bytes > kMaxBytes) return nullptr;
  const size_t rounded = Rounded(bytes);
  size_t capacity = 0;
  return Obtain(rounded, rounded, &capacity);  // exactly `rounded`: FreeBlock recomputes it
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
      TrimSmallestIdle(idle_bytes_ + capacity - cap_);
    }
    if (idle_bytes_ + capacity <= cap_) {
      AddIdle(data, capacity);
      idle_bytes_ += capacity;
      return;
    }
  }
  munmap(data, capacity);
}

void BufferPool::set_cap(uint64_t cap_bytes) {
  absl::MutexLock lock(&mu_);
  cap_ = cap_bytes;
  while (idle_bytes_ > cap_) TrimSmallestIdle(idle_bytes_ - cap_);  // smallest first, as Release
}

void BufferPool::TrimSmallestIdle(uint64_t excess) {
  auto [capacity, data] = *idle_.begin();
  EraseIdle(data, capacity);
  const size_t drop = excess >= capacity ? capacity : Rounded(static_cast<size_t>(excess));
  munmap(data + (capacity - drop), drop);  // the whole buffer, or its tail
  idle_bytes_ -= drop;
  if (drop < capacity) AddIdle(data, capacity - drop);
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

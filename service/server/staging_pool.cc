#include "server/staging_pool.h"

#include <sys/mman.h>

#include <new>
#include <utility>

namespace kvc::server {
namespace {

uint8_t* MapBuffer(size_t capacity) {
  void* p = mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  // Staging is written once front to back and read once: 2 MiB pages cut the page faults (the
  // dominant cost of fresh staging) by a factor of 512. Advisory; failure only costs speed.
  (void)madvise(p, capacity, MADV_HUGEPAGE);
  return static_cast<uint8_t*>(p);
}

}  // namespace

StagingPool::Buffer& StagingPool::Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    pool_ = std::exchange(other.pool_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

void StagingPool::Buffer::reset() {
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

StagingPool::StagingPool(uint64_t cap_bytes) : cap_(cap_bytes) {}

StagingPool::~StagingPool() {
  absl::MutexLock lock(&mu_);
  for (auto& [capacity, data] : idle_) munmap(data, capacity);
  idle_.clear();
  idle_bytes_ = 0;
}

StagingPool::Buffer StagingPool::Acquire(size_t bytes) {
  Buffer b;
  if (bytes == 0) return b;
  if (bytes < kMinPooledBytes) {
    b.data_ = new (std::nothrow) uint8_t[bytes];  // default-initialized: no zero fill
    b.capacity_ = b.data_ ? bytes : 0;
    return b;
  }
  const size_t rounded = (bytes + kGranule - 1) / kGranule * kGranule;
  {
    absl::MutexLock lock(&mu_);
    // Best fit among buffers no more than twice the need, so one small upload cannot pin a huge
    // buffer while larger ones map fresh memory.
    auto it = idle_.lower_bound(rounded);
    if (it != idle_.end() && it->first <= 2 * rounded) {
      b.pool_ = this;
      b.capacity_ = it->first;
      b.data_ = it->second;
      idle_bytes_ -= it->first;
      idle_.erase(it);
      ++reused_;
      return b;
    }
    ++mapped_;
  }
  uint8_t* data = MapBuffer(rounded);
  if (data == nullptr) return b;
  b.pool_ = this;
  b.data_ = data;
  b.capacity_ = rounded;
  return b;
}

void StagingPool::Release(uint8_t* data, size_t capacity) {
  {
    absl::MutexLock lock(&mu_);
    // Make room by dropping smaller idle buffers first: the largest are the costliest to remap.
    // A buffer larger than the whole cap is never kept, so it displaces nothing.
    while (capacity <= cap_ && idle_bytes_ + capacity > cap_ && !idle_.empty() &&
           idle_.begin()->first < capacity) {
      auto smallest = idle_.begin();
      munmap(smallest->second, smallest->first);
      idle_bytes_ -= smallest->first;
      idle_.erase(smallest);
    }
    if (idle_bytes_ + capacity <= cap_) {
      idle_.emplace(capacity, data);
      idle_bytes_ += capacity;
      return;
    }
  }
  munmap(data, capacity);
}

uint64_t StagingPool::idle_bytes() const {
  absl::MutexLock lock(&mu_);
  return idle_bytes_;
}

uint64_t StagingPool::reused() const {
  absl::MutexLock lock(&mu_);
  return reused_;
}

uint64_t StagingPool::mapped() const {
  absl::MutexLock lock(&mu_);
  return mapped_;
}

}  // namespace kvc::server

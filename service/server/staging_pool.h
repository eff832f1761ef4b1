// Reusable staging memory for PutCache uploads. Each upload stages every layer's K, V and Q_obs
// (several MiB to over 100 MiB per tensor) until the layer is compressed; allocating that afresh
// per upload makes the kernel fault in and later unmap every page, which dominated ingest time.
// The pool keeps released buffers (up to a byte cap) for the next upload: a reused buffer's pages
// are already mapped. Large buffers are mmap'ed and advised for transparent huge pages, so even a
// fresh one faults in 2 MiB at a time.
//
// Memory bound: the pool itself holds at most `cap_bytes` of idle buffers; a buffer released
// while the pool is full is unmapped at once. Buffers in use are owned by their uploads (whose
// total is bounded by --max_cache_bytes and --max_concurrent_streams) and never counted twice.
// A cap of 0 disables reuse (every buffer is freed on release).
//
// Thread-safety: Acquire and buffer release may be called from any thread.
#ifndef KVC_SERVICE_SERVER_STAGING_POOL_H_
#define KVC_SERVICE_SERVER_STAGING_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvc::server {

class StagingPool {
 public:
  // Buffers below this size come from the ordinary allocator and are never pooled.
  static constexpr size_t kMinPooledBytes = size_t{1} << 20;
  // Pooled buffers have capacities rounded up to this (the huge page size).
  static constexpr size_t kGranule = size_t{2} << 20;

  // Returns memory to the pool (or frees it) when destroyed. Move-only; an empty Buffer holds
  // nothing. May outlive nothing: the pool must outlive every Buffer it handed out.
  class Buffer {
   public:
    Buffer() = default;
    Buffer(Buffer&& other) noexcept { *this = std::move(other); }
    Buffer& operator=(Buffer&& other) noexcept;
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;
    ~Buffer() { reset(); }

    uint8_t* get() const { return data_; }
    size_t capacity() const { return capacity_; }
    explicit operator bool() const { return data_ != nullptr; }
    void reset();

   private:
    friend class StagingPool;
    StagingPool* pool_ = nullptr;  // null for small buffers (operator new[])
    uint8_t* data_ = nullptr;
    size_t capacity_ = 0;
  };

  explicit StagingPool(uint64_t cap_bytes);
  ~StagingPool();  // unmaps the idle buffers
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // A buffer of at least `bytes` bytes (contents unspecified: never zero-filled). Reuses an idle
  // buffer whose capacity is at least `bytes` and at most twice the rounded size, else maps a new
  // one. Returns an empty Buffer when `bytes` is 0 or the memory cannot be mapped.
  Buffer Acquire(size_t bytes);

  uint64_t cap_bytes() const { return cap_; }
  uint64_t idle_bytes() const;   // held by the pool, not in use
  uint64_t reused() const;       // Acquire calls served from the pool
  uint64_t mapped() const;       // Acquire calls that mapped new memory

 private:
  void Release(uint8_t* data, size_t capacity);

  const uint64_t cap_;
  mutable absl::Mutex mu_;
  std::multimap<size_t, uint8_t*> idle_ ABSL_GUARDED_BY(mu_);  // capacity -> buffer
  uint64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t mapped_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_STAGING_POOL_H_

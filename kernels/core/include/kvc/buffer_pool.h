// Reusable large buffers. A PutCache upload stages each layer's K, V and Q_obs (several MiB to over
// 100 MiB per tensor) and every compact blob the store keeps is as large; allocating that afresh
// makes the kernel fault in (and zero) every page and later unmap it, which dominated ingest time.
// A BufferPool keeps released buffers, up to a byte cap, for the next request: a reused buffer's
// pages are already mapped. Large buffers are mmap'ed and advised for transparent huge pages, so
// even a fresh one faults in 2 MiB at a time.
//
// Two ways in:
//  - Acquire(bytes) hands out a move-only Buffer (upload staging), reusing any idle buffer of at
//    least `bytes` and at most twice the rounded size.
//  - AllocateBlock/FreeBlock back ByteVector (kvc/bytes.h) for blocks of kMinPooledBytes or more
//    through the process-wide pool LargeBuffers(): every compact blob, so the memory of a cache
//    that is evicted or deleted goes to the next upload instead of back to the kernel. A block's
//    capacity is its size rounded up to kGranule, so FreeBlock needs only the size it was
//    allocated with (what std::allocator::deallocate gets).
//
// Memory bound: the pool holds at most cap_bytes() of idle buffers; a buffer released while the
// pool is full is unmapped at once. Buffers in use belong to their owners and are never counted
// twice. A cap of 0 disables reuse (every buffer is unmapped on release). The process-wide pool
// starts with a cap of 0; kvcd sets it from --buffer_pool_bytes.
//
// Thread-safety: every method may be called from any thread.
#ifndef KVC_BUFFER_POOL_H_
#define KVC_BUFFER_POOL_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvc {

class BufferPool {
 public:
  // Buffers below this size come from the ordinary allocator and are never pooled.
  static constexpr size_t kMinPooledBytes = size_t{1} << 20;
  // Pooled buffers have capacities rounded up to this (the huge page size).
  static constexpr size_t kGranule = size_t{2} << 20;

  // Returns memory to the pool (or frees it) when destroyed. Move-only; an empty Buffer holds
  // nothing. The pool must outlive every Buffer it handed out.
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
    friend class BufferPool;
    BufferPool* pool_ = nullptr;  // null for small buffers (operator new[])
    uint8_t* data_ = nullptr;
    size_t capacity_ = 0;
  };

  explicit BufferPool(uint64_t cap_bytes);
  ~BufferPool();  // unmaps the idle buffers
  BufferPool(const BufferPool&) = delete;
  BufferPool& operator=(const BufferPool&) = delete;

  // A buffer of at least `bytes` bytes (contents unspecified: never zero-filled). Reuses an idle
  // buffer whose capacity is at least `bytes` and at most twice the rounded size, else maps a new
  // one. Returns an empty Buffer when `bytes` is 0 or the memory cannot be mapped.
  Buffer Acquire(size_t bytes);

  // A block of `bytes` >= kMinPooledBytes (contents unspecified), from an idle buffer of exactly
  // the rounded size or freshly mapped; nullptr when the memory cannot be mapped. Give it back with
  // FreeBlock(p, bytes), the same `bytes`.
  void* AllocateBlock(size_t bytes);
  void FreeBlock(void* p, size_t bytes);

  // Changes the cap; idle buffers over a lower cap are unmapped at once.
  void set_cap(uint64_t cap_bytes);
  uint64_t cap_bytes() const;
  uint64_t idle_bytes() const;  // held by the pool, not in use
  uint64_t reused() const;      // requests served from the pool
  uint64_t mapped() const;      // requests that mapped new memory

  static size_t Rounded(size_t bytes) { return (bytes + kGranule - 1) / kGranule * kGranule; }

 private:
  // Takes an idle buffer of capacity in [min, max]; nullptr (and counts a mapping) when none.
  uint8_t* TakeIdle(size_t min, size_t max, size_t* capacity);
  void Release(uint8_t* data, size_t capacity);
  // Unmaps the smallest idle buffer (there must be one).
  void UnmapSmallestIdle() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  uint64_t cap_ ABSL_GUARDED_BY(mu_);
  std::multimap<size_t, uint8_t*> idle_ ABSL_GUARDED_BY(mu_);  // capacity -> buffer
  uint64_t idle_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t reused_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t mapped_ ABSL_GUARDED_BY(mu_) = 0;
};

// For executables that move multi-MiB messages (kvcd, benchmarks): glibc serves allocations above
// its mmap threshold (128 KiB until the first large free raises it) with fresh mappings, so
// gRPC's message buffers would be faulted in, zeroed by the kernel and unmapped again for every
// message. This fixes the threshold at 32 MiB (glibc's ceiling) and the trim threshold at
// `trim_bytes`, so those buffers are reused from the heap. Returns false where it cannot (not
// glibc, or mallopt refused). Libraries should leave malloc alone; kvc::Client does not call it.
bool ReuseLargeMallocs(size_t trim_bytes = size_t{128} << 20);

// The process-wide pool behind ByteVector's large blocks (cap 0 until someone sets it). Never
// destroyed, so blobs freed during static destruction still have somewhere to go.
BufferPool& LargeBuffers();

}  // namespace kvc

#endif  // KVC_BUFFER_POOL_H_

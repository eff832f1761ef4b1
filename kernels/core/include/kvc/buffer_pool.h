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
// Requests of other sizes than the idle buffers' still reuse their pages (a service sees uploads
// of many shapes, DENSE exports and blobs of every size, and exact fits alone left the pool full of
// the wrong sizes while every request mapped fresh memory): when no idle buffer fits whole, the
// request takes the front of the smallest larger one and the rest stays idle as a buffer of its
// own; a released buffer merges with the idle ones adjacent to it, so the pieces of one mapping
// become one buffer again. (Growing a smaller idle buffer with mremap was tried and dropped: in
// a replay of transport_bench's requests, writing a grown 130 MiB buffer took up to 220 ms
// against 12 ms for a fresh mapping.)
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
  // Larger requests fail (empty Buffer, nullptr) before any size arithmetic can overflow.
  static constexpr size_t kMaxBytes = SIZE_MAX / 4;

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
  // buffer whose capacity is at least `bytes` and at most twice the rounded size, else the front
  // of a larger one, else maps a new one. Returns an empty Buffer when
  // `bytes` is 0 or over kMaxBytes, or the memory cannot be mapped.
  Buffer Acquire(size_t bytes);

  // A block of `bytes` >= kMinPooledBytes (contents unspecified) of exactly the rounded size: an
  // idle buffer of that size, the front of a larger one, or fresh memory;
  // nullptr when `bytes` is over kMaxBytes or the memory cannot be mapped. Give it back with
  // FreeBlock(p, bytes), the same `bytes`.
  void* AllocateBlock(size_t bytes);
  void FreeBlock(void* p, size_t bytes);

  // Changes the cap; idle buffers over a lower cap are unmapped at once.
  void set_cap(uint64_t cap_bytes);
  uint64_t cap_bytes() const;
  uint64_t idle_bytes() const;  // held by the pool, not in use
  uint64_t reused() const;      // requests served from idle memory (a whole buffer or a front)
  uint64_t mapped() const;      // requests that mapped new memory

  static size_t Rounded(size_t bytes) { return (bytes + kGranule - 1) / kGranule * kGranule; }

 private:
  // Memory for a request of `rounded` bytes that takes an idle buffer whole only up to `max`:
  // an idle buffer (whole, or the front of a larger one), else a fresh mapping. nullptr when no
  // memory can be mapped. Sets *capacity.
  uint8_t* Obtain(size_t rounded, size_t max, size_t* capacity);
  // Under the lock, the first step of Obtain; nullptr (and counts a mapping) when no idle buffer
  // holds `rounded` bytes.
  uint8_t* TakeIdle(size_t rounded, size_t max, size_t* capacity);
  // Idle bookkeeping, under the lock: AddIdle merges with adjacent idle buffers; EraseIdle removes
  // one from both indexes. Neither changes idle_bytes_.
  void AddIdle(uint8_t* data, size_t capacity) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void EraseIdle(uint8_t* data, size_t capacity) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Release(uint8_t* data, size_t capacity);
  // Unmaps `excess` bytes (rounded up to the granule) of idle memory from the smallest idle
  // buffer (there must be one): its tail, or all of it when it is no larger.
  void TrimSmallestIdle(uint64_t excess) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  uint64_t cap_ ABSL_GUARDED_BY(mu_);
  std::multimap<size_t, uint8_t*> idle_ ABSL_GUARDED_BY(mu_);         // capacity -> buffer
  std::map<uint8_t*, size_t> idle_by_address_ ABSL_GUARDED_BY(mu_);  // buffer -> capacity
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

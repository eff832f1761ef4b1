// ByteVector: the owning byte buffer of a compact layer blob (CompactLayer::bytes, a stored
// CacheEntry's layers). It is a std::vector<uint8_t> whose resize(n) and ByteVector(n) leave the
// new bytes uninitialized instead of zero-filling them: a blob is sized once and then every byte is
// written by its producer, so a zero-fill would be a wasted pass over memory. Consequence for
// producers: every byte of a sized buffer must be written before it is read. Copies, assign and
// the value-taking resize(n, v) behave as for std::vector.
// Blocks of BufferPool::kMinPooledBytes (1 MiB) or more come from the process-wide buffer pool
// (kvc/buffer_pool.h): huge-page mappings, reused after a blob is freed when the pool has a cap.
// Thread-safety: as std::vector.
#ifndef KVC_BYTES_H_
#define KVC_BYTES_H_

#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/types/span.h"

namespace kvc {

// A std::allocator whose construct() with no arguments default-initializes (leaves a trivial
// type uninitialized) instead of value-initializing. Stateless; all instances compare equal.
namespace internal {
inline constexpr size_t kLargeBlockBytes = size_t{1} << 20;  // == BufferPool::kMinPooledBytes
// LargeBuffers().AllocateBlock, throwing std::bad_alloc when no memory can be mapped.
void* AllocateLargeBlock(size_t bytes);
void FreeLargeBlock(void* p, size_t bytes) noexcept;
}  // namespace internal

// Blocks of internal::kLargeBlockBytes or more go to the process-wide buffer pool; allocate and
// deallocate decide by the same size, so every block returns to where it came from.
template <class T>
class DefaultInitAllocator : public std::allocator<T> {
 public:
  using value_type = T;
  template <class U>
  struct rebind {
    using other = DefaultInitAllocator<U>;
  };

  DefaultInitAllocator() noexcept = default;
  template <class U>
  DefaultInitAllocator(const DefaultInitAllocator<U>&) noexcept {}  // NOLINT: implicit by design

  T* allocate(size_t n) {
    if (n >= internal::kLargeBlockBytes / sizeof(T)) {
      return static_cast<T*>(internal::AllocateLargeBlock(n * sizeof(T)));
    }
    return std::allocator<T>::allocate(n);
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n >= internal::kLargeBlockBytes / sizeof(T)) {
      internal::FreeLargeBlock(p, n * sizeof(T));
      return;
    }
    std::allocator<T>::deallocate(p, n);
  }

  template <class U>
  void construct(U* p) noexcept(std::is_nothrow_default_constructible_v<U>) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

template <class T, class U>
bool operator==(const DefaultInitAllocator<T>&, const DefaultInitAllocator<U>&) noexcept {
  return true;
}

using ByteVector = std::vector<uint8_t, DefaultInitAllocator<uint8_t>>;

// A ByteVector holding a copy of `bytes` (one memcpy; for code holding a std::vector<uint8_t>
// or any other contiguous bytes).
inline ByteVector ToByteVector(absl::Span<const uint8_t> bytes) {
  ByteVector out(bytes.size());
  if (!bytes.empty()) std::memcpy(out.data(), bytes.data(), bytes.size());
  return out;
}

}  // namespace kvc

#endif  // KVC_BYTES_H_

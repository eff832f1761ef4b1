// BufferPool: reuse of released buffers (whole, or the front of a larger one, with released pieces
// merging again), the idle-byte cap, small buffers outside the pool, buffers that stay writable
// across reuse, and a long random sequence of all of it checked against the pool's promises.
#include "kvc/buffer_pool.h"

#include <cstdint>
#include <cstring>
#include <iterator>
#include <map>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kvc/bytes.h"

namespace kvc {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(BufferPoolTest, ZeroBytesGivesAnEmptyBuffer) {
  BufferPool pool(64 * kMiB);
  BufferPool::Buffer b = pool.Acquire(0);
  EXPECT_FALSE(b);
  EXPECT_EQ(b.capacity(), 0u);
}

TEST(BufferPoolTest, SmallBuffersAreNotPooled) {
  BufferPool pool(64 * kMiB);
  {
    BufferPool::Buffer b = pool.Acquire(1000);
    ASSERT_TRUE(b);
    EXPECT_GE(b.capacity(), 1000u);
    std::memset(b.get(), 7, 1000);
  }
  EXPECT_EQ(pool.idle_bytes(), 0u);
  EXPECT_EQ(pool.mapped(), 0u);
}

TEST(BufferPoolTest, ReleasedBufferIsReusedWithItsContentsIntact) {
  BufferPool pool(64 * kMiB);
  uint8_t* first = nullptr;
  {
    BufferPool::Buffer b = pool.Acquire(3 * kMiB);
    ASSERT_TRUE(b);
    EXPECT_EQ(b.capacity(), 4 * kMiB);  // rounded up to the 2 MiB granule
    std::memset(b.get(), 0x5a, 3 * kMiB);
    first = b.get();
  }
  EXPECT_EQ(pool.idle_bytes(), 4 * kMiB);
  BufferPool::Buffer again = pool.Acquire(4 * kMiB);
  ASSERT_TRUE(again);
  EXPECT_EQ(again.get(), first);
  EXPECT_EQ(again.get()[3 * kMiB - 1], 0x5a);  // reused, not remapped (no zero fill)
  EXPECT_EQ(pool.reused(), 1u);
  EXPECT_EQ(pool.mapped(), 1u);
  EXPECT_EQ(pool.idle_bytes(), 0u);
}

TEST(BufferPoolTest, AMuchLargerIdleBufferGivesItsFrontAndKeepsTheRest) {
  BufferPool pool(64 * kMiB);
  uint8_t* big_data = nullptr;
  {
    BufferPool::Buffer big = pool.Acquire(16 * kMiB);
    ASSERT_TRUE(big);
    std::memset(big.get(), 0x11, 16 * kMiB);
    big_data = big.get();
  }
  BufferPool::Buffer small = pool.Acquire(2 * kMiB);  // 16 MiB is more than twice the need
  ASSERT_TRUE(small);
  EXPECT_EQ(small.capacity(), 2 * kMiB);  // not the whole 16 MiB
  EXPECT_EQ(small.get(), big_data);       // its front, pages already there
  EXPECT_EQ(small.get()[2 * kMiB - 1], 0x11);
  EXPECT_EQ(pool.reused(), 1u);
  EXPECT_EQ(pool.mapped(), 1u);
  EXPECT_EQ(pool.idle_bytes(), 14 * kMiB);  // the rest stays for the next request
  BufferPool::Buffer rest = pool.Acquire(14 * kMiB);
  EXPECT_EQ(rest.get(), big_data + 2 * kMiB);
  EXPECT_EQ(rest.capacity(), 14 * kMiB);
  EXPECT_EQ(rest.get()[14 * kMiB - 1], 0x11);
  EXPECT_EQ(pool.reused(), 2u);
  EXPECT_EQ(pool.idle_bytes(), 0u);
  // Both pieces write and release independently (each is unmapped on its own at the end).
  std::memset(small.get(), 1, small.capacity());
  std::memset(rest.get(), 2, rest.capacity());
  small.reset();
  rest.reset();
  EXPECT_EQ(pool.idle_bytes(), 16 * kMiB);
}

TEST(BufferPoolTest, ABufferUpToTwiceTheNeedIsTakenWhole) {
  BufferPool pool(64 * kMiB);
  { BufferPool::Buffer b = pool.Acquire(6 * kMiB); }
  BufferPool::Buffer b = pool.Acquire(4 * kMiB);
  EXPECT_EQ(b.capacity(), 6 * kMiB);
  EXPECT_EQ(pool.idle_bytes(), 0u);
}

TEST(BufferPoolTest, ReleasedPiecesMergeBackIntoOneBuffer) {
  BufferPool pool(64 * kMiB);
  uint8_t* base = nullptr;
  {
    BufferPool::Buffer big = pool.Acquire(12 * kMiB);
    base = big.get();
  }
  {
    BufferPool::Buffer a = pool.Acquire(2 * kMiB);  // the front of the 12 MiB
    BufferPool::Buffer b = pool.Acquire(2 * kMiB);  // the front of the remaining 10 MiB
    EXPECT_EQ(a.get(), base);
    EXPECT_EQ(b.get(), base + 2 * kMiB);
    EXPECT_EQ(pool.idle_bytes(), 8 * kMiB);
    a.reset();  // not adjacent to the idle 8 MiB: two idle buffers
    EXPECT_EQ(pool.idle_bytes(), 10 * kMiB);
  }  // b joins both neighbours
  EXPECT_EQ(pool.idle_bytes(), 12 * kMiB);
  BufferPool::Buffer whole = pool.Acquire(12 * kMiB);  // one 12 MiB buffer again, no mapping
  EXPECT_EQ(whole.get(), base);
  EXPECT_EQ(whole.capacity(), 12 * kMiB);
  EXPECT_EQ(pool.mapped(), 1u);
  EXPECT_EQ(pool.reused(), 3u);
  std::memset(whole.get(), 3, whole.capacity());
}

TEST(BufferPoolTest, SizesOverTheLimitAreRefusedBeforeAnyArithmetic) {
  BufferPool pool(64 * kMiB);
  EXPECT_FALSE(pool.Acquire(BufferPool::kMaxBytes + 1));
  EXPECT_FALSE(pool.Acquire(SIZE_MAX));
  EXPECT_EQ(pool.AllocateBlock(SIZE_MAX - 1), nullptr);
  EXPECT_EQ(pool.mapped(), 0u);
}

// Requests of changing sizes, as a service sees them (blobs of every size, staging, exports),
// settle on the pool's memory instead of mapping afresh once the pool holds enough.
TEST(BufferPoolTest, MixedSizesStopMappingOnceThePoolHoldsEnough) {
  BufferPool pool(512 * kMiB);
  const size_t sizes[] = {130 * kMiB, 64 * kMiB, 18 * kMiB, 64 * kMiB, 5 * kMiB, 100 * kMiB};
  for (int round = 0; round < 6; ++round) {
    if (round == 2) {
      EXPECT_GT(pool.mapped(), 0u);  // fresh mappings only while warming up
    }
    const uint64_t mapped = pool.mapped();
    std::vector<BufferPool::Buffer> held;
    for (size_t s : sizes) {
      held.push_back(pool.Acquire(s));
      ASSERT_TRUE(held.back());
      held.back().get()[s - 1] = 1;
    }
    held.clear();
    void* block = pool.AllocateBlock(130 * kMiB + 1);
    ASSERT_NE(block, nullptr);
    pool.FreeBlock(block, 130 * kMiB + 1);
    if (round >= 2) {
      EXPECT_EQ(pool.mapped(), mapped) << "round " << round;
    }
    EXPECT_LE(pool.idle_bytes(), 512 * kMiB);
  }
}

TEST(BufferPoolTest, IdleBytesNeverExceedTheCap) {
  BufferPool pool(10 * kMiB);
  {
    std::vector<BufferPool::Buffer> held;
    for (int i = 0; i < 8; ++i) held.push_back(pool.Acquire(4 * kMiB));
    for (const auto& b : held) ASSERT_TRUE(b);
  }  // 32 MiB released into a 10 MiB pool
  EXPECT_LE(pool.idle_bytes(), 10 * kMiB);
  EXPECT_EQ(pool.idle_bytes(), 8 * kMiB);  // two 4 MiB buffers fit
  {
    BufferPool::Buffer huge = pool.Acquire(64 * kMiB);
    ASSERT_TRUE(huge);
  }  // larger than the whole cap: unmapped, and the idle ones are kept
  EXPECT_EQ(pool.idle_bytes(), 8 * kMiB);
}

TEST(BufferPoolTest, ABiggerReleaseDisplacesSmallerIdleBuffers) {
  BufferPool pool(8 * kMiB);
  {
    BufferPool::Buffer a = pool.Acquire(2 * kMiB);
    BufferPool::Buffer b = pool.Acquire(2 * kMiB);
    BufferPool::Buffer c = pool.Acquire(6 * kMiB);
    a.reset();
    b.reset();
    EXPECT_EQ(pool.idle_bytes(), 4 * kMiB);
  }  // c (6 MiB) needs room: one 2 MiB buffer is dropped
  EXPECT_EQ(pool.idle_bytes(), 8 * kMiB);
  BufferPool::Buffer reuse = pool.Acquire(6 * kMiB);
  EXPECT_EQ(pool.reused(), 1u);
}

TEST(BufferPoolTest, ZeroCapDisablesReuse) {
  BufferPool pool(0);
  { BufferPool::Buffer b = pool.Acquire(4 * kMiB); }
  EXPECT_EQ(pool.idle_bytes(), 0u);
  { BufferPool::Buffer b = pool.Acquire(4 * kMiB); }
  EXPECT_EQ(pool.reused(), 0u);
  EXPECT_EQ(pool.mapped(), 2u);
}

TEST(BufferPoolTest, MovedBufferReleasesOnce) {
  BufferPool pool(64 * kMiB);
  BufferPool::Buffer a = pool.Acquire(2 * kMiB);
  BufferPool::Buffer b = std::move(a);
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  ASSERT_TRUE(b);
  b.reset();
  EXPECT_EQ(pool.idle_bytes(), 2 * kMiB);
}

TEST(BufferPoolTest, BlocksHaveExactlyTheirRoundedSize) {
  BufferPool pool(64 * kMiB);
  void* a = pool.AllocateBlock(3 * kMiB);  // capacity 4 MiB
  ASSERT_NE(a, nullptr);
  std::memset(a, 0x33, 3 * kMiB);
  pool.FreeBlock(a, 3 * kMiB);
  EXPECT_EQ(pool.idle_bytes(), 4 * kMiB);
  void* b = pool.AllocateBlock(2 * kMiB);  // 2 MiB: the front of the idle 4 MiB buffer
  EXPECT_EQ(b, a);
  EXPECT_EQ(pool.reused(), 1u);
  EXPECT_EQ(pool.idle_bytes(), 2 * kMiB);
  void* c = pool.AllocateBlock(2 * kMiB);  // the rest, contents left as they were
  EXPECT_EQ(c, static_cast<uint8_t*>(a) + 2 * kMiB);
  EXPECT_EQ(static_cast<uint8_t*>(c)[kMiB - 1], 0x33);
  EXPECT_EQ(pool.reused(), 2u);
  EXPECT_EQ(pool.mapped(), 1u);
  pool.FreeBlock(b, 2 * kMiB);
  pool.FreeBlock(c, 2 * kMiB);
  EXPECT_EQ(pool.idle_bytes(), 4 * kMiB);
  // The two pieces merged back; an Acquire may take a block's buffer (up to twice the need).
  BufferPool::Buffer staging = pool.Acquire(3 * kMiB);
  EXPECT_EQ(staging.get(), a);
  EXPECT_EQ(staging.capacity(), 4 * kMiB);
  EXPECT_EQ(pool.reused(), 3u);
  EXPECT_EQ(pool.mapped(), 1u);
}

TEST(BufferPoolTest, LoweringTheCapUnmapsIdleBuffers) {
  BufferPool pool(64 * kMiB);
  {
    BufferPool::Buffer a = pool.Acquire(2 * kMiB);
    BufferPool::Buffer b = pool.Acquire(8 * kMiB);
  }
  EXPECT_EQ(pool.idle_bytes(), 10 * kMiB);
  pool.set_cap(9 * kMiB);  // the small one goes first
  EXPECT_EQ(pool.cap_bytes(), 9 * kMiB);
  EXPECT_EQ(pool.idle_bytes(), 8 * kMiB);
  pool.set_cap(0);
  EXPECT_EQ(pool.idle_bytes(), 0u);
}

// A seeded random mix of Acquire, AllocateBlock, releases in any order and cap changes, as a
// server's uploads, blobs and exports interleave. After every step: the buffers in use are
// disjoint, each has the capacity the header promises, every 2 MiB granule of each still holds
// the tag written when it was handed out (no piece was handed out twice, none was unmapped under
// its owner), idle memory is within the cap, and every pooled request was counted once.
TEST(BufferPoolTest, RandomRequestsKeepBuffersDisjointIntactAndWithinTheCap) {
  constexpr size_t G = BufferPool::kGranule;
  BufferPool pool(48 * kMiB);
  std::mt19937_64 rng(20261205);
  struct Live {
    BufferPool::Buffer buffer;  // empty for a block
    void* block = nullptr;
    size_t bytes = 0;
    size_t capacity = 0;
    uint64_t tag = 0;
  };
  std::map<uintptr_t, Live> live;  // by address
  uint64_t next_tag = 1, requests = 0;
  auto write_tags = [](uint8_t* p, size_t capacity, uint64_t tag) {
    for (size_t off = 0; off < capacity; off += G) std::memcpy(p + off, &tag, sizeof tag);
  };
  auto tags_intact = [](const uint8_t* p, size_t capacity, uint64_t tag) {
    for (size_t off = 0; off < capacity; off += G) {
      uint64_t got;
      std::memcpy(&got, p + off, sizeof got);
      if (got != tag) return false;
    }
    return true;
  };
  auto release = [&](std::map<uintptr_t, Live>::iterator it) {
    Live& l = it->second;
    ASSERT_TRUE(tags_intact(reinterpret_cast<const uint8_t*>(it->first), l.capacity, l.tag))
        << "buffer of " << l.bytes << " bytes changed under its owner";
    if (l.block != nullptr) pool.FreeBlock(l.block, l.bytes);
    live.erase(it);  // a Buffer returns itself here
  };
  for (int step = 0; step < 2000; ++step) {
    const int op = static_cast<int>(rng() % 10);
    if (op < 5 || live.empty()) {  // a request of 1-24 MiB, at any byte count
      const size_t bytes = kMiB + rng() % (23 * kMiB);
      const size_t rounded = BufferPool::Rounded(bytes);
      Live l;
      l.bytes = bytes;
      l.tag = next_tag++;
      uint8_t* p;
      if (op % 2 == 0) {
        l.buffer = pool.Acquire(bytes);
        ASSERT_TRUE(l.buffer);
        p = l.buffer.get();
        l.capacity = l.buffer.capacity();
        ASSERT_GE(l.capacity, rounded);
        ASSERT_LE(l.capacity, 2 * rounded);
      } else {
        l.block = pool.AllocateBlock(bytes);
        ASSERT_NE(l.block, nullptr);
        p = static_cast<uint8_t*>(l.block);
        l.capacity = rounded;
      }
      ASSERT_EQ(l.capacity % G, 0u);
      ++requests;
      const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
      auto after = live.lower_bound(begin);
      if (after != live.end()) {
        ASSERT_GE(after->first, begin + l.capacity) << "step " << step;
      }
      if (after != live.begin()) {
        auto before = std::prev(after);
        ASSERT_LE(before->first + before->second.capacity, begin) << "step " << step;
      }
      write_tags(p, l.capacity, l.tag);
      live.emplace(begin, std::move(l));
    } else if (op < 9) {  // release one at random
      auto it = std::next(live.begin(), static_cast<long>(rng() % live.size()));
      release(it);
      if (HasFatalFailure()) return;
    } else {  // the operator changes --buffer_pool_bytes
      pool.set_cap((rng() % 97) * kMiB);
    }
    ASSERT_LE(pool.idle_bytes(), pool.cap_bytes()) << "step " << step;
    ASSERT_EQ(pool.reused() + pool.mapped(), requests) << "step " << step;
    if (live.size() > 12) {  // keep the mapped memory bounded: release the lowest address
      release(live.begin());
      if (HasFatalFailure()) return;
    }
  }
  while (!live.empty()) {
    release(live.begin());
    if (HasFatalFailure()) return;
  }
  EXPECT_LE(pool.idle_bytes(), pool.cap_bytes());
  EXPECT_GT(pool.reused(), requests / 4);  // the mix does reuse memory, not only map it
  RecordProperty("reused", static_cast<int>(pool.reused()));
  RecordProperty("requests", static_cast<int>(requests));
}

// ByteVector's large blocks go through the process-wide pool: with a cap, a freed blob's memory
// is what the next blob of the same size gets; small vectors never touch the pool.
TEST(BufferPoolTest, ByteVectorBlobsRecycleThroughTheProcessWidePool) {
  BufferPool& pool = LargeBuffers();
  EXPECT_EQ(pool.cap_bytes(), 0u);  // nothing set it in this process
  pool.set_cap(32 * kMiB);
  const uint64_t mapped = pool.mapped(), reused = pool.reused();
  const uint8_t* first = nullptr;
  {
    ByteVector blob(5 * kMiB);
    blob[5 * kMiB - 1] = 0x77;
    first = blob.data();
  }
  EXPECT_EQ(pool.mapped(), mapped + 1);
  EXPECT_EQ(pool.idle_bytes(), 6 * kMiB);
  {
    ByteVector again(5 * kMiB + 100);  // rounds to the same 6 MiB
    EXPECT_EQ(again.data(), first);
    EXPECT_EQ(pool.reused(), reused + 1);
    ByteVector copy = again;  // a copy is another block
    EXPECT_NE(copy.data(), again.data());
    ByteVector small(kMiB - 1);
    small.back() = 1;
  }
  EXPECT_EQ(pool.mapped(), mapped + 2);  // the copy, not the small vector
  EXPECT_EQ(pool.idle_bytes(), 12 * kMiB);
  pool.set_cap(0);
  EXPECT_EQ(pool.idle_bytes(), 0u);
}

}  // namespace
}  // namespace kvc

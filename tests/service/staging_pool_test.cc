// StagingPool: reuse of released buffers, the idle-byte cap, small buffers outside the pool, and
// buffers that stay writable across reuse.
#include "server/staging_pool.h"

#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace kvc::server {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

TEST(StagingPoolTest, ZeroBytesGivesAnEmptyBuffer) {
  StagingPool pool(64 * kMiB);
  StagingPool::Buffer b = pool.Acquire(0);
  EXPECT_FALSE(b);
  EXPECT_EQ(b.capacity(), 0u);
}

TEST(StagingPoolTest, SmallBuffersAreNotPooled) {
  StagingPool pool(64 * kMiB);
  {
    StagingPool::Buffer b = pool.Acquire(1000);
    ASSERT_TRUE(b);
    EXPECT_GE(b.capacity(), 1000u);
    std::memset(b.get(), 7, 1000);
  }
  EXPECT_EQ(pool.idle_bytes(), 0u);
  EXPECT_EQ(pool.mapped(), 0u);
}

TEST(StagingPoolTest, ReleasedBufferIsReusedWithItsContentsIntact) {
  StagingPool pool(64 * kMiB);
  uint8_t* first = nullptr;
  {
    StagingPool::Buffer b = pool.Acquire(3 * kMiB);
    ASSERT_TRUE(b);
    EXPECT_EQ(b.capacity(), 4 * kMiB);  // rounded up to the 2 MiB granule
    std::memset(b.get(), 0x5a, 3 * kMiB);
    first = b.get();
  }
  EXPECT_EQ(pool.idle_bytes(), 4 * kMiB);
  StagingPool::Buffer again = pool.Acquire(4 * kMiB);
  ASSERT_TRUE(again);
  EXPECT_EQ(again.get(), first);
  EXPECT_EQ(again.get()[3 * kMiB - 1], 0x5a);  // reused, not remapped (no zero fill)
  EXPECT_EQ(pool.reused(), 1u);
  EXPECT_EQ(pool.mapped(), 1u);
  EXPECT_EQ(pool.idle_bytes(), 0u);
}

TEST(StagingPoolTest, DoesNotHandOutABufferMoreThanTwiceTheNeed) {
  StagingPool pool(64 * kMiB);
  { StagingPool::Buffer big = pool.Acquire(16 * kMiB); }
  StagingPool::Buffer small = pool.Acquire(2 * kMiB);
  ASSERT_TRUE(small);
  EXPECT_EQ(small.capacity(), 2 * kMiB);
  EXPECT_EQ(pool.reused(), 0u);
  EXPECT_EQ(pool.idle_bytes(), 16 * kMiB);  // the big one stays for a big request
}

TEST(StagingPoolTest, IdleBytesNeverExceedTheCap) {
  StagingPool pool(10 * kMiB);
  {
    std::vector<StagingPool::Buffer> held;
    for (int i = 0; i < 8; ++i) held.push_back(pool.Acquire(4 * kMiB));
    for (const auto& b : held) ASSERT_TRUE(b);
  }  // 32 MiB released into a 10 MiB pool
  EXPECT_LE(pool.idle_bytes(), 10 * kMiB);
  EXPECT_EQ(pool.idle_bytes(), 8 * kMiB);  // two 4 MiB buffers fit
  {
    StagingPool::Buffer huge = pool.Acquire(64 * kMiB);
    ASSERT_TRUE(huge);
  }  // larger than the whole cap: unmapped, and the idle ones are kept
  EXPECT_EQ(pool.idle_bytes(), 8 * kMiB);
}

TEST(StagingPoolTest, ABiggerReleaseDisplacesSmallerIdleBuffers) {
  StagingPool pool(8 * kMiB);
  {
    StagingPool::Buffer a = pool.Acquire(2 * kMiB);
    StagingPool::Buffer b = pool.Acquire(2 * kMiB);
    StagingPool::Buffer c = pool.Acquire(6 * kMiB);
    a.reset();
    b.reset();
    EXPECT_EQ(pool.idle_bytes(), 4 * kMiB);
  }  // c (6 MiB) needs room: one 2 MiB buffer is dropped
  EXPECT_EQ(pool.idle_bytes(), 8 * kMiB);
  StagingPool::Buffer reuse = pool.Acquire(6 * kMiB);
  EXPECT_EQ(pool.reused(), 1u);
}

TEST(StagingPoolTest, ZeroCapDisablesReuse) {
  StagingPool pool(0);
  { StagingPool::Buffer b = pool.Acquire(4 * kMiB); }
  EXPECT_EQ(pool.idle_bytes(), 0u);
  { StagingPool::Buffer b = pool.Acquire(4 * kMiB); }
  EXPECT_EQ(pool.reused(), 0u);
  EXPECT_EQ(pool.mapped(), 2u);
}

TEST(StagingPoolTest, MovedBufferReleasesOnce) {
  StagingPool pool(64 * kMiB);
  StagingPool::Buffer a = pool.Acquire(2 * kMiB);
  StagingPool::Buffer b = std::move(a);
  EXPECT_FALSE(a);  // NOLINT(bugprone-use-after-move): the moved-from state is specified
  ASSERT_TRUE(b);
  b.reset();
  EXPECT_EQ(pool.idle_bytes(), 2 * kMiB);
}

}  // namespace
}  // namespace kvc::server

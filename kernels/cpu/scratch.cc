// Per-thread scratch of the CPU engine (cpu/engine.h): small arrays kept by their thread, large
// ones borrowed from LargeBuffers() for one task.
#include <algorithm>
#include <atomic>
#include <new>
#include <optional>

#include "cpu/engine.h"
#include "kvc/checked_math.h"

namespace kvc::cpu {
namespace {

std::atomic<uint64_t> g_large_bytes{0};
std::atomic<uint64_t> g_large_peak{0};

void AddLarge(uint64_t bytes) {
  const uint64_t now = g_large_bytes.fetch_add(bytes) + bytes;
  uint64_t peak = g_large_peak.load();
  while (now > peak && !g_large_peak.compare_exchange_weak(peak, now)) {
  }
}

void SubLarge(uint64_t bytes) { g_large_bytes.fetch_sub(bytes); }

}  // namespace

void* ScratchArray::Bytes(size_t n, size_t elem) {
  const std::optional<uint64_t> want = CheckedMul(n, elem);
  if (!want) throw std::bad_alloc();
  const size_t bytes = std::max<size_t>(*want, 1);
  if (bytes <= kScratchKeepBytes) {
    if (bytes > small_bytes_) {
      // Grown to the keep size at once: a thread's small arrays are allocated about once.
      small_.reset(new uint8_t[kScratchKeepBytes]);
      small_bytes_ = kScratchKeepBytes;
    }
    return small_.get();
  }
  if (large_.capacity() < bytes) {
    if (large_) {
      SubLarge(large_.capacity());
      large_.reset();
    }
    large_ = LargeBuffers().Acquire(bytes);
    if (!large_) throw std::bad_alloc();
    AddLarge(large_.capacity());
  }
  return large_.get();
}

void ScratchArray::ReleaseLarge() {
  if (!large_) return;
  SubLarge(large_.capacity());
  large_.reset();
}

Scratch& Scratch::ForThisThread() {
  thread_local Scratch scratch;
  return scratch;
}

void Scratch::ReleaseLarge() {
  for (ScratchArray* a :
       {&q, &k, &v, &logits, &tile, &acc, &row_max, &cand, &stats, &amx_q, &amx_k, &top}) {
    a->ReleaseLarge();
  }
}

uint64_t LargeScratchBytes() { return g_large_bytes.load(); }
uint64_t LargeScratchPeakBytes() { return g_large_peak.load(); }
void ResetScratchPeak() { g_large_peak.store(g_large_bytes.load()); }

}  // namespace kvc::cpu

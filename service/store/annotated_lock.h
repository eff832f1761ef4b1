// Scoped locks for absl::Mutex that ThreadSanitizer understands even when Abseil itself was built
// without it (distribution packages are): absl::Mutex synchronizes through its own futex code,
// which an uninstrumented library hides from TSAN, so every access it guards would be reported as
// a race. Under TSAN these locks also tell the sanitizer about the happens-before edges
// (writers order with everyone, readers only with writers); otherwise they are exactly
// absl::MutexLock and absl::ReaderMutexLock.
//
// Internal to kvc_service; not installed.
#ifndef KVC_SERVICE_STORE_ANNOTATED_LOCK_H_
#define KVC_SERVICE_STORE_ANNOTATED_LOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

#if defined(__SANITIZE_THREAD__)
#define KVC_TSAN_LOCKS 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KVC_TSAN_LOCKS 1
#endif
#endif

#ifdef KVC_TSAN_LOCKS
#include <sanitizer/tsan_interface.h>
#endif

namespace kvc::internal {

#ifdef KVC_TSAN_LOCKS
// Writers release on the mutex's address; readers release on the next byte, which only writers
// acquire, so readers do not appear ordered with each other.
inline void* WriterSync(absl::Mutex* mu) { return mu; }
inline void* ReaderSync(absl::Mutex* mu) { return reinterpret_cast<char*>(mu) + 1; }
inline void AfterWriterLock(absl::Mutex* mu) {
  __tsan_acquire(WriterSync(mu));
  __tsan_acquire(ReaderSync(mu));
}
inline void BeforeWriterUnlock(absl::Mutex* mu) { __tsan_release(WriterSync(mu)); }
inline void AfterReaderLock(absl::Mutex* mu) { __tsan_acquire(WriterSync(mu)); }
inline void BeforeReaderUnlock(absl::Mutex* mu) { __tsan_release(ReaderSync(mu)); }
#else
inline void AfterWriterLock(absl::Mutex*) {}
inline void BeforeWriterUnlock(absl::Mutex*) {}
inline void AfterReaderLock(absl::Mutex*) {}
inline void BeforeReaderUnlock(absl::Mutex*) {}
#endif

class ABSL_SCOPED_LOCKABLE WriterLock {
 public:
  explicit WriterLock(absl::Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->Lock();
    AfterWriterLock(mu_);
  }
  ~WriterLock() ABSL_UNLOCK_FUNCTION() {
    BeforeWriterUnlock(mu_);
    mu_->Unlock();
  }
  WriterLock(const WriterLock&) = delete;
  WriterLock& operator=(const WriterLock&) = delete;

 private:
  absl::Mutex* const mu_;
};

class ABSL_SCOPED_LOCKABLE ReaderLock {
 public:
  explicit ReaderLock(absl::Mutex* mu) ABSL_SHARED_LOCK_FUNCTION(mu) : mu_(mu) {
    mu_->ReaderLock();
    AfterReaderLock(mu_);
  }
  ~ReaderLock() ABSL_UNLOCK_FUNCTION() {
    BeforeReaderUnlock(mu_);
    mu_->ReaderUnlock();
  }
  ReaderLock(const ReaderLock&) = delete;
  ReaderLock& operator=(const ReaderLock&) = delete;

 private:
  absl::Mutex* const mu_;
};

}  // namespace kvc::internal

#endif  // KVC_SERVICE_STORE_ANNOTATED_LOCK_H_

// The one thread pool of kvc: fork-join ParallelFor for the CPU engine (over KV heads or any
// index range) and fire-and-forget Schedule for kvcd's compression jobs.
//
// Thread-safety: every method may be called from any thread, concurrently. ParallelFor jobs and
// scheduled closures share one FIFO queue. The thread calling ParallelFor always works on its own
// job, so nested or concurrent calls cannot deadlock.
//
// Exceptions never escape a worker thread (they would terminate the process): an exception thrown
// by a ParallelFor body is rethrown to the ParallelFor caller, and one escaping a scheduled
// closure is caught, reported on stderr and dropped. Closures that must report failure (e.g. a
// failed allocation) catch their own, for instance with CallNoThrow below.
#ifndef KVC_THREAD_POOL_H_
#define KVC_THREAD_POOL_H_

#include <atomic>
#include <chrono>
#include <cstdio>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace kvc {

class ThreadPool {
 public:
  // Parallelism `num_threads` counts the caller of ParallelFor: num_threads - 1 workers are
  // started. num_threads <= 0 means std::thread::hardware_concurrency(). A pool used only for
  // Schedule therefore needs num_threads = workers + 1.
  // `worker_nice` (Linux; 0 = inherit): the workers' nice value relative to the creating thread,
  // e.g. 10 for background work that should yield the CPU to the process's other threads.
  explicit ThreadPool(int num_threads, int worker_nice = 0);
  // Runs every closure already scheduled, then joins the workers.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }
  int num_workers() const { return static_cast<int>(workers_.size()); }

  // Runs fn(i) once for every i in [0, n) on the workers and the calling thread; returns when all
  // have finished. If fn throws, the indices not yet started are skipped and, once the running
  // ones have finished, the first exception is rethrown on the calling thread.
  void ParallelFor(int n, const std::function<void(int)>& fn);

  // Queues fn to run once on a worker, in FIFO order with other closures and ParallelFor jobs.
  // A pool without workers (num_threads == 1) runs fn on the calling thread before returning.
  void Schedule(std::function<void()> fn);

  // Waits until no scheduled closure is queued or running on a worker (ParallelFor callers wait
  // for their own jobs); false when that has not happened by `deadline`.
  bool WaitIdle(std::chrono::steady_clock::time_point deadline);

  // A process-wide pool with hardware_concurrency threads, created on first use.
  static ThreadPool* Default();

 private:
  struct Job;
  // One queue entry: a ParallelFor job (shared with its caller) or a scheduled closure.
  struct Task {
    std::shared_ptr<Job> job;
    std::function<void()> fn;
  };
  void WorkerLoop();
  static void RunJob(Job* job);
  static void RunClosure(const std::function<void()>& fn);

  // absl::Mutex as everywhere in kvc (STYLE.md), so clang's thread-safety analysis checks the
  // annotations. (ThreadSanitizer sees absl::Mutex only in an Abseil built with it, which holds
  // for every lock in kvc alike.)
  int num_threads_;
  absl::Mutex mu_;
  absl::CondVar cv_;       // signalled when queue_ grows or stop_ is set
  absl::CondVar idle_cv_;  // signalled when the last busy worker finds no closure queued
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  int queued_closures_ ABSL_GUARDED_BY(mu_) = 0;
  int busy_workers_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> workers_;
};

// The status for an exception caught in `e` (non-null): RESOURCE_EXHAUSTED for std::bad_alloc (an
// allocation failed), INTERNAL carrying what() for any other std::exception, INTERNAL for
// anything else. Never throws: when even the message cannot be built (memory is out), the same
// code comes without a message, which needs no allocation.
absl::Status StatusFromException(std::exception_ptr e) noexcept;

// Calls fn() (returning absl::Status or absl::StatusOr<T>) and returns its result, or
// StatusFromException for an exception escaping it: no exception leaves CallNoThrow.
template <typename F>
auto CallNoThrow(F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (...) {
    return StatusFromException(std::current_exception());
  }
}

// Runs body(); an exception escaping it goes to on_error(status) as StatusFromException's status,
// so that code which must end something whatever happens inside it (a stream, an upload) can:
// gRPC, for one, swallows an exception thrown by a reactor's reaction and then never calls its
// OnDone, so the stream would hold its slots forever. Should on_error throw too (memory is out),
// it is called once more with the bare status code, which needs no allocation; an exception from
// that call is reported on stderr. Nothing leaves RunNoThrow.
template <typename Body, typename OnError>
void RunNoThrow(Body&& body, OnError&& on_error) noexcept {
  absl::Status status;
  try {
    body();
    return;
  } catch (...) {
    status = StatusFromException(std::current_exception());
  }
  try {
    on_error(status);
    return;
  } catch (...) {
  }
  try {
    on_error(absl::Status(status.code(), ""));
  } catch (...) {
    std::fputs("kvc: an exception's error handling failed too (out of memory?)\n", stderr);
  }
}

// RunNoThrow for code whose failure can only be reported (a closure nobody waits for, a round of
// a background loop, which must not end its thread and with it the process): an exception's
// status goes to stderr as "`what`: STATUS".
template <typename Body>
void RunOrReport(const char* what, Body&& body) noexcept {
  RunNoThrow(body, [what](const absl::Status& s) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
  });
}

}  // namespace kvc

#endif  // KVC_THREAD_POOL_H_

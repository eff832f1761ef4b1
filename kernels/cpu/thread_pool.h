// A small fork-join pool for the CPU engine: ParallelFor over KV heads (or any index range).
// Thread-safe: several callers may run ParallelFor concurrently on one pool (jobs queue FIFO), and
// the calling thread always works on its own job, so nested or concurrent calls cannot deadlock.
#ifndef KVC_KERNELS_CPU_THREAD_POOL_H_
#define KVC_KERNELS_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace kvc {

class ThreadPool {
 public:
  // Parallelism `num_threads` counts the caller: num_threads - 1 workers are started.
  // num_threads <= 0 means std::thread::hardware_concurrency().
  explicit ThreadPool(int num_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return num_threads_; }

  // Runs fn(i) once for every i in [0, n) on the workers and the calling thread; returns when all
  // have finished. fn must not throw.
  void ParallelFor(int n, const std::function<void(int)>& fn);

  // A process-wide pool with hardware_concurrency threads, created on first use.
  static ThreadPool* Default();

 private:
  struct Job;
  void WorkerLoop();
  static void RunJob(Job* job);

  // std::mutex rather than absl::Mutex: a distribution-built Abseil is invisible to
  // ThreadSanitizer, which then reports every access the lock guards; pthread-based locks keep
  // TSAN runs meaningful.
  int num_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;  // guarded by mu_
  bool stop_ = false;                       // guarded by mu_
  std::vector<std::thread> workers_;
};

}  // namespace kvc

#endif  // KVC_KERNELS_CPU_THREAD_POOL_H_

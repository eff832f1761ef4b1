// A fixed-size pool of worker threads running queued closures in FIFO order. kvcd runs layer
// compression on it so gRPC callback threads never block on the engine.
//
// Thread-safety: Schedule may be called from any thread. The destructor runs every closure
// already queued, then joins the workers.
#ifndef KVC_SERVICE_SERVER_THREAD_POOL_H_
#define KVC_SERVICE_SERVER_THREAD_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace kvc::server {

class ThreadPool {
 public:
  explicit ThreadPool(int num_threads);  // num_threads >= 1
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void Schedule(std::function<void()> fn);

 private:
  void WorkerLoop();

  absl::Mutex mu_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_THREAD_POOL_H_

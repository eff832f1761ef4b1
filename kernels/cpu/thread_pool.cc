#include "cpu/thread_pool.h"

#include <algorithm>
#include <atomic>

namespace kvc {

struct ThreadPool::Job {
  const std::function<void(int)>* fn = nullptr;
  int n = 0;
  std::atomic<int> next{0};
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;  // guarded by mu
};

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  num_threads_ = std::max(1, num_threads);
  workers_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

ThreadPool* ThreadPool::Default() {
  static ThreadPool* const pool = new ThreadPool(0);  // never destroyed: workers outlive statics
  return pool;
}

void ThreadPool::RunJob(Job* job) {
  int finished = 0;
  for (int i = job->next.fetch_add(1); i < job->n; i = job->next.fetch_add(1)) {
    (*job->fn)(i);
    ++finished;
  }
  if (finished > 0) {
    std::lock_guard<std::mutex> lock(job->mu);
    job->done += finished;
    if (job->done == job->n) job->cv.notify_all();
  }
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ and nothing left
      job = queue_.front();
      // Every index of the front job is claimed once its counter reaches n: retire it so workers
      // move on to the next job.
      if (job->next.load() >= job->n) {
        queue_.pop_front();
        continue;
      }
    }
    RunJob(job.get());
  }
}

void ThreadPool::ParallelFor(int n, const std::function<void(int)>& fn) {
  if (n <= 0) return;
  if (n == 1 || workers_.empty()) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  auto job = std::make_shared<Job>();
  job->fn = &fn;
  job->n = n;
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(job);
  }
  cv_.notify_all();
  RunJob(job.get());
  {
    std::unique_lock<std::mutex> lock(job->mu);
    job->cv.wait(lock, [&job] { return job->done == job->n; });
  }
  std::lock_guard<std::mutex> lock(mu_);
  auto it = std::find(queue_.begin(), queue_.end(), job);
  if (it != queue_.end()) queue_.erase(it);
}

}  // namespace kvc

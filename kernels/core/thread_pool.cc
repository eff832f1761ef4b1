#include "kvc/thread_pool.h"

#include <algorithm>
#include <cstdio>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace kvc {

struct ThreadPool::Job {
  const std::function<void(int)>* fn = nullptr;
  int n = 0;
  std::atomic<int> next{0};
  // Set once an index threw: the indices claimed after that are counted done without running.
  std::atomic<bool> failed{false};
  absl::Mutex mu;
  absl::CondVar cv;  // signalled when done reaches n
  int done ABSL_GUARDED_BY(mu) = 0;
  std::exception_ptr error ABSL_GUARDED_BY(mu);  // the first exception fn threw
};

ThreadPool::ThreadPool(int num_threads) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  num_threads_ = std::max(1, num_threads);
  workers_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  cv_.SignalAll();
  for (std::thread& t : workers_) t.join();
}

ThreadPool* ThreadPool::Default() {
  static ThreadPool* const pool = new ThreadPool(0);  // never destroyed: workers outlive statics
  return pool;
}

void ThreadPool::RunJob(Job* job) {
  int finished = 0;
  for (int i = job->next.fetch_add(1); i < job->n; i = job->next.fetch_add(1)) {
    if (!job->failed.load(std::memory_order_relaxed)) {
      // A worker thread must not let an exception out (std::terminate): hand it to the caller.
      try {
        (*job->fn)(i);
      } catch (...) {
        absl::MutexLock lock(&job->mu);
        if (!job->error) job->error = std::current_exception();
        job->failed.store(true, std::memory_order_relaxed);
      }
    }
    ++finished;
  }
  if (finished > 0) {
    absl::MutexLock lock(&job->mu);
    job->done += finished;
    if (job->done == job->n) job->cv.SignalAll();
  }
}

void ThreadPool::RunClosure(const std::function<void()>& fn) {
  // Nobody waits for a scheduled closure, so its exception has no one to go to: report it and
  // keep the worker (and the process) alive.
  try {
    fn();
  } catch (...) {
    const absl::Status s = StatusFromException(std::current_exception());
    std::fprintf(stderr, "kvc::ThreadPool: a scheduled closure threw: %s\n", s.ToString().c_str());
  }
}

void ThreadPool::WorkerLoop() {
  for (;;) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      while (!stop_ && queue_.empty()) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stop_ and nothing left
      Task& front = queue_.front();
      if (front.job == nullptr) {
        task.fn = std::move(front.fn);
        queue_.pop_front();
      } else if (front.job->next.load() >= front.job->n) {
        // Every index of the front job is claimed once its counter reaches n: retire it so
        // workers move on to the next entry.
        queue_.pop_front();
        continue;
      } else {
        task.job = front.job;
      }
    }
    if (task.job != nullptr) {
      RunJob(task.job.get());
    } else {
      RunClosure(task.fn);
    }
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
    absl::MutexLock lock(&mu_);
    queue_.push_back(Task{job, nullptr});
  }
  cv_.SignalAll();
  RunJob(job.get());
  std::exception_ptr error;
  {
    absl::MutexLock lock(&job->mu);
    while (job->done != job->n) job->cv.Wait(&job->mu);
    error = job->error;
  }
  {
    absl::MutexLock lock(&mu_);
    auto it =
        std::find_if(queue_.begin(), queue_.end(), [&job](const Task& t) { return t.job == job; });
    if (it != queue_.end()) queue_.erase(it);
  }
  if (error) std::rethrow_exception(error);
}

void ThreadPool::Schedule(std::function<void()> fn) {
  if (workers_.empty()) {
    RunClosure(fn);
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    queue_.push_back(Task{nullptr, std::move(fn)});
  }
  cv_.Signal();
}

absl::Status StatusFromException(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::bad_alloc& ex) {
    return absl::ResourceExhaustedError(
        absl::StrCat("out of memory: an allocation failed (", ex.what(), ")"));
  } catch (const std::exception& ex) {
    return absl::InternalError(absl::StrCat("unexpected exception: ", ex.what()));
  } catch (...) {
    return absl::InternalError("unexpected exception of unknown type");
  }
}

}  // namespace kvc

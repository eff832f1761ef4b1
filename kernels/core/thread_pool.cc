#include "kvc/thread_pool.h"

#if defined(__linux__)
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <cerrno>
#include <new>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

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

namespace {

// Linux gives every thread its own nice value (setpriority on a thread id); raising it needs no
// privilege. Best effort: a failure only costs fairness.
void AddNice(int delta) {
#if defined(__linux__)
  if (delta == 0) return;
  const auto tid = static_cast<id_t>(syscall(SYS_gettid));
  errno = 0;
  const int current = getpriority(PRIO_PROCESS, tid);
  if (errno != 0) return;
  (void)setpriority(PRIO_PROCESS, tid, std::clamp(current + delta, -20, 19));
#else
  (void)delta;
#endif
}

}  // namespace

ThreadPool::ThreadPool(int num_threads, int worker_nice) {
  if (num_threads <= 0) num_threads = static_cast<int>(std::thread::hardware_concurrency());
  num_threads_ = std::max(1, num_threads);
  workers_.reserve(num_threads_ - 1);
  for (int i = 1; i < num_threads_; ++i) {
    workers_.emplace_back([this, worker_nice] {
      AddNice(worker_nice);
      WorkerLoop();
    });
  }
}

bool ThreadPool::WaitIdle(std::chrono::steady_clock::time_point deadline) {
  const absl::Time until =
      absl::Now() + absl::FromChrono(deadline - std::chrono::steady_clock::now());
  absl::MutexLock lock(&mu_);
  while (queued_closures_ != 0 || busy_workers_ != 0) {
    if (idle_cv_.WaitWithDeadline(&mu_, until)) {  // timed out
      return queued_closures_ == 0 && busy_workers_ == 0;
    }
  }
  return true;
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
  RunOrReport("kvc::ThreadPool: a scheduled closure threw", fn);
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
        --queued_closures_;
      } else if (front.job->next.load() >= front.job->n) {
        // Every index of the front job is claimed once its counter reaches n: retire it so
        // workers move on to the next entry.
        queue_.pop_front();
        continue;
      } else {
        task.job = front.job;
      }
      ++busy_workers_;
    }
    if (task.job != nullptr) {
      RunJob(task.job.get());
    } else {
      RunClosure(task.fn);
      task.fn = nullptr;  // what the closure captured goes now, not at the next task
    }
    absl::MutexLock lock(&mu_);
    if (--busy_workers_ == 0 && queued_closures_ == 0) idle_cv_.SignalAll();
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
    ++queued_closures_;
  }
  cv_.Signal();
}

absl::Status StatusFromException(std::exception_ptr e) noexcept {
  absl::StatusCode code = absl::StatusCode::kInternal;
  try {
    try {
      std::rethrow_exception(e);
    } catch (const std::bad_alloc& ex) {
      code = absl::StatusCode::kResourceExhausted;
      return absl::ResourceExhaustedError(
          absl::StrCat("out of memory: an allocation failed (", ex.what(), ")"));
    } catch (const std::exception& ex) {
      return absl::InternalError(absl::StrCat("unexpected exception: ", ex.what()));
    } catch (...) {
      return absl::InternalError("unexpected exception of unknown type");
    }
  } catch (...) {
    // The message could not be built (memory is out): the code alone needs no allocation.
    return absl::Status(code, "");
  }
}

}  // namespace kvc

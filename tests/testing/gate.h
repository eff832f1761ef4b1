// A gate that holds the threads reaching it until it is opened, for tests that need a server
// to be busy (or stalled) at a known point: Pass() counts the caller and waits, WaitEntered()
// waits until someone is held, Open() lets everyone through from then on.
#ifndef KVC_TESTS_TESTING_GATE_H_
#define KVC_TESTS_TESTING_GATE_H_

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvc::testing {

struct Gate {
  absl::Mutex mu;
  bool open ABSL_GUARDED_BY(mu) = false;
  int entered ABSL_GUARDED_BY(mu) = 0;

  void Pass() {
    absl::MutexLock lock(&mu);
    ++entered;
    mu.Await(absl::Condition(&open));
  }
  // True once a thread has reached Pass (false after `timeout`).
  bool WaitEntered(absl::Duration timeout) {
    absl::MutexLock lock(&mu);
    return mu.AwaitWithTimeout(
        absl::Condition(+[](Gate* g) ABSL_NO_THREAD_SAFETY_ANALYSIS { return g->entered > 0; },
                        this),
        timeout);
  }
  void Open() {
    absl::MutexLock lock(&mu);
    open = true;
  }
};

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_GATE_H_

// A gate that holds the threads reaching it until it is opened, for tests that need a server
// to be busy (or stalled) at a known point: Pass() counts the caller and waits, WaitEntered()
// waits until someone is held, Open() lets everyone through from then on. GateBackstop opens it
// after a timeout.
#ifndef KVC_TESTS_TESTING_GATE_H_
#define KVC_TESTS_TESTING_GATE_H_

#include <memory>
#include <thread>
#include <utility>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
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

// Opens `gate` after `timeout` at the latest, or at once when it goes out of scope: a test whose
// code under test should not wait at the gate still ends (with failed expectations) if it does.
class GateBackstop {
 public:
  GateBackstop(std::shared_ptr<Gate> gate, absl::Duration timeout)
      : thread_([gate = std::move(gate), timeout, this] {
          finished_.WaitForNotificationWithTimeout(timeout);
          gate->Open();
        }) {}
  ~GateBackstop() {
    finished_.Notify();
    thread_.join();
  }
  GateBackstop(const GateBackstop&) = delete;
  GateBackstop& operator=(const GateBackstop&) = delete;

 private:
  absl::Notification finished_;
  std::thread thread_;  // last: starts after finished_ exists
};

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_GATE_H_

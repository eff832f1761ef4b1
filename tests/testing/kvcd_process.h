// Test helpers around a real kvcd: the launcher (kvc/kvcd_process.h, shared with kvcctl soak and
// the benchmarks) under the names the tests use, and two probes only tests need.
#ifndef KVC_TESTS_TESTING_KVCD_PROCESS_H_
#define KVC_TESTS_TESTING_KVCD_PROCESS_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "kvc/kvcd_process.h"

namespace kvc::testing {

using ::kvc::HttpGet;
using ::kvc::KvcdProcess;
using ::kvc::MetricValue;
using ::kvc::WaitForMetric;

// grpc.health.v1 Check of `service` ("" = the whole server) at `address`: true for SERVING,
// false for NOT_SERVING; an error for anything else (including an RPC failure).
absl::StatusOr<bool> HealthServing(const std::string& address, const std::string& service = "",
                                   absl::Duration timeout = absl::Seconds(5));

// Returns a TCP port on 127.0.0.1 that was free a moment ago (for servers that cannot take
// port 0, like Prometheus).
absl::StatusOr<int> PickFreeLoopbackPort();

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_KVCD_PROCESS_H_

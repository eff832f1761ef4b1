// The options of a kvcd assembled inside a test process (server::KvcServer, wired as
// kvcd_main.cc wires it), for tests that share something in-process with it, such as the fake
// NCCL data plane: loopback on a free port, no health or metrics port, a 64 MiB store, the CPU
// backend, 2 threads. Header-only: only tests that link kvc_service include it.
#ifndef KVC_TESTS_TESTING_IN_PROCESS_KVCD_H_
#define KVC_TESTS_TESTING_IN_PROCESS_KVCD_H_

#include <cstdint>

#include "server/server.h"

namespace kvc::testing {

inline server::KvcServer::Options InProcessKvcdOptions(uint64_t max_chunk_bytes) {
  server::KvcServer::Options options;
  options.config.listen = "127.0.0.1:0";
  options.config.health_listen = "";
  options.config.metrics_listen = "";
  options.config.store_bytes = 64 << 20;
  options.config.max_chunk_bytes = max_chunk_bytes;
  options.config.backend = "cpu";
  options.config.threads = 2;
  return options;
}

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_IN_PROCESS_KVCD_H_

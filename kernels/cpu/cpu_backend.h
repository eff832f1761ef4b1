// The CPU engine's entry points for the backend registry (kernels/registry.cc), internal to
// kernels/.
#ifndef KVC_KERNELS_CPU_CPU_BACKEND_H_
#define KVC_KERNELS_CPU_CPU_BACKEND_H_

#include <memory>

#include "core/host_fallback.h"
#include "kvc/backend_interface.h"

namespace kvc::cpu {

// The CPU backend with its own pool of num_threads threads (0 = hardware concurrency; must be
// >= 0, the registry checks it).
std::unique_ptr<Backend> NewCpuBackend(int num_threads, int thread_nice);

// The host engine other backends fall back to (core/host_fallback.h), running on
// ThreadPool::Default(). Process-wide, never destroyed, thread-safe.
const HostFallback& HostEngine();

}  // namespace kvc::cpu

#endif  // KVC_KERNELS_CPU_CPU_BACKEND_H_

// The CPU engine as the host fallback of other backends (core/host_fallback.h): the same stages
// the CPU backend runs after scoring, on the process-wide pool.
#include <chrono>
#include <vector>

#include "cpu/cpu_backend.h"
#include "cpu/engine.h"
#include "cpu/pack.h"
#include "cpu/score_extra.h"
#include "kvc/status_macros.h"
#include "kvc/thread_pool.h"

namespace kvc::cpu {
namespace {

class CpuHostFallback final : public HostFallback {
 public:
  absl::StatusOr<CompactLayer> Compress(const LayerInput& in, const CompressionSpec& spec,
                                        CompressTimings* timings) const override {
    return CompressOnPool(in, spec, ThreadPool::Default(), timings);
  }

  ExpectedStats ExpectedStatistics(const LayerInput& in, const EvictionSpec& spec) const override {
    return ComputeExpectedStats(in, spec);
  }

  absl::StatusOr<CompactLayer> CompressFromScores(const LayerInput& in, const CompressionSpec& spec,
                                                  std::vector<float>* scores,
                                                  CompressTimings* timings) const override {
    const auto start = std::chrono::steady_clock::now();
    ThreadPool* pool = ThreadPool::Default();
    const TokenSelection tokens = SelectFromScoresImpl(in, spec, pool, scores);
    const ChannelSelection channels = SelectChannelsImpl(in, tokens, spec, pool);
    const auto selected = std::chrono::steady_clock::now();
    ASSIGN_OR_RETURN(CompactLayer layer,
                     PackLayerImpl(in, tokens, channels, spec, pool, /*work=*/nullptr));
    const auto packed = std::chrono::steady_clock::now();
    if (timings != nullptr) {
      auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
      timings->select = secs(start, selected);
      timings->pack = secs(selected, packed);
    }
    return layer;
  }
};

}  // namespace

const HostFallback& HostEngine() {
  static const CpuHostFallback* const engine = new CpuHostFallback();  // never destroyed
  return *engine;
}

}  // namespace kvc::cpu

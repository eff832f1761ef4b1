#include "cuda/adaptive_select.h"

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu/engine.h"
#include "cpu/pack.h"
#include "cuda/resources.h"
#include "kvc/status_macros.h"
#include "kvc/thread_pool.h"

namespace kvc::cuda {

absl::StatusOr<CompactLayer> AdaptiveFromDeviceScores(const LayerInput& in,
                                                      const CompressionSpec& spec,
                                                      const float* device_scores,
                                                      cudaStream_t stream,
                                                      CompressTimings* timings) {
  const auto start = std::chrono::steady_clock::now();
  const size_t n = static_cast<size_t>(in.shape.num_kv_heads) * in.shape.seq_len;
  std::vector<float> scores(n);
  KVC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(scores.data(), device_scores, sizeof(float) * n,
                                           cudaMemcpyDeviceToHost, stream),
                           "copy scores to host");
  KVC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "scores");
  const auto scored = std::chrono::steady_clock::now();
  ThreadPool* pool = ThreadPool::Default();
  const TokenSelection tokens = cpu::SelectFromScoresImpl(in, spec, pool, &scores);
  const ChannelSelection channels = cpu::SelectChannelsImpl(in, tokens, spec, pool);
  const auto selected = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(CompactLayer layer,
                   cpu::PackLayerImpl(in, tokens, channels, spec, pool, /*work=*/nullptr));
  const auto packed = std::chrono::steady_clock::now();
  if (timings != nullptr) {
    auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    // The score kernels were queued before this call: score is the wait for them and the copy.
    timings->score = secs(start, scored);
    timings->select = secs(scored, selected);
    timings->pack = secs(selected, packed);
    timings->quantize = 0;
    timings->total = secs(start, packed);
  }
  return layer;
}

}  // namespace kvc::cuda

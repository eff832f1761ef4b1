#include "cuda/adaptive_select.h"

#include <chrono>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/resources.h"
#include "kvc/status_macros.h"

namespace kvc::cuda {

absl::StatusOr<CompactLayer> AdaptiveFromDeviceScores(
    const LayerInput& in, const CompressionSpec& spec, const HostFallback& host,
    const float* device_scores, cudaStream_t stream, CompressTimings* timings) {
  const auto start = std::chrono::steady_clock::now();
  const size_t n = static_cast<size_t>(in.shape.num_kv_heads) * in.shape.seq_len;
  std::vector<float> scores(n);
  KVC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(scores.data(), device_scores, sizeof(float) * n,
                                           cudaMemcpyDeviceToHost, stream),
                           "copy scores to host");
  KVC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream), "scores");
  const auto scored = std::chrono::steady_clock::now();
  CompressTimings host_times;
  ASSIGN_OR_RETURN(CompactLayer layer, host.CompressFromScores(in, spec, &scores, &host_times));
  const auto packed = std::chrono::steady_clock::now();
  if (timings != nullptr) {
    auto secs = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
    // The score kernels were queued before this call: score is the wait for them and the copy.
    timings->score = secs(start, scored);
    timings->select = host_times.select;
    timings->pack = host_times.pack;
    timings->quantize = 0;
    timings->total = secs(start, packed);
  }
  return layer;
}

}  // namespace kvc::cuda

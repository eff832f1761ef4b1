// The CPU backend: validate, SelectTokens, SelectChannels, PackLayer, each stage timed. One
// ThreadPool per backend parallelizes over KV heads (scoring, selection and packing); per-thread
// scratch keeps hot loops free of allocation. NHD inputs are read in place through strided row
// conversion (no transposed copy).
#include "cpu/cpu_backend.h"

#include <chrono>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "cpu/engine.h"
#include "cpu/pack.h"
#include "kvc/attention.h"
#include "kvc/backend_interface.h"
#include "kvc/compact.h"
#include "kvc/cpu_isa.h"
#include "kvc/status_macros.h"
#include "kvc/thread_pool.h"

namespace kvc::cpu {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& options)
      : pool_(options.num_threads, options.thread_nice),
        attention_{.math = options.attention_math},
        scoring_math_(options.scoring_math) {}

  std::string_view name() const override { return "cpu"; }

  std::string description() const override {
    // Which arithmetic attention scoring uses per dtype (cpu/amx_logits.h), for logs and
    // benchmark rows.
    return absl::StrCat("cpu: ", pool_.num_threads(), " threads, ", CpuIsaDescription(),
                        ", scoring logits: ", ScoringLogitsDescription(scoring_math_));
  }

  absl::StatusOr<CompactLayer> Compress(const LayerInput& in, const CompressionSpec& spec,
                                        CompressTimings* timings) override {
    return CompressOnPool(WithOptions(in), spec, &pool_, timings);
  }

  bool CanScoreKeys() const override { return true; }
  absl::StatusOr<KeyScores> ScoreKeys(const LayerInput& in, const CompressionSpec& spec) override {
    return ScoreKeysOnPool(WithOptions(in), spec, &pool_);
  }
  absl::StatusOr<CompactLayer> CompressScored(const LayerInput& in, const CompressionSpec& spec,
                                              KeyScores scores,
                                              CompressTimings* timings) override {
    return CompressOnPool(WithOptions(in), spec, &pool_, timings, &scores);
  }

  absl::Status Attend(const CompactLayerView& cache, const DecodeQuery& query,
                      float* out) override {
    return PackedAttentionCpu(cache, query, out, &pool_, attention_);
  }

 private:
  // The input as this backend's options say to compute it.
  LayerInput WithOptions(const LayerInput& in) const {
    LayerInput out = in;
    out.scoring_math = scoring_math_;
    return out;
  }

  ThreadPool pool_;
  PackedAttentionOptions attention_;
  ScoringMath scoring_math_;
};

}  // namespace

absl::StatusOr<KeyScores> ScoreKeysOnPool(const LayerInput& in, const CompressionSpec& spec,
                                          ThreadPool* pool) {
  return CallNoThrow([&]() -> absl::StatusOr<KeyScores> {
    const auto start = std::chrono::steady_clock::now();
    // V is never read here: validate the rest as Compress would (with k standing in for v).
    LayerInput check = in;
    if (check.v == nullptr) check.v = check.k;
    RETURN_IF_ERROR(ValidateInput(check));
    RETURN_IF_ERROR(ValidateSpec(spec, in.shape, in.layer_index));
    RETURN_IF_ERROR(ValidateSpecInput(spec, check));
    KeyScores out;
    out.computed = cpu::NeedsScores(in, spec);
    if (out.computed) {
      LayerInput keys_only = in;
      keys_only.v = nullptr;  // a scorer that read V would fault here, not read stale memory
      cpu::RawScoresImpl(keys_only, spec.eviction, pool, &out.scores);
    }
    RETURN_IF_ERROR(cpu::CancelStatus(in));
    out.seconds = SecondsSince(start);
    return out;
  });
}

absl::StatusOr<CompactLayer> CompressOnPool(const LayerInput& in, const CompressionSpec& spec,
                                            ThreadPool* pool, CompressTimings* timings,
                                            KeyScores* early) {
  // Packing runs on the pool, one task per (KV head, K or V), and quantization happens inside
  // those tasks. `pack` + `quantize` is the wall time of that packing stage, split in proportion
  // to the time (summed over tasks, cpu::PackWork) the tasks spent quantizing (computing and
  // writing scales, zeros and codes) versus everything else (gather, fp32 conversion); `quantize`
  // is 0 when bits == 0.
  // Scratch and result buffers are sized from the shape; a failed allocation (std::bad_alloc,
  // rethrown here from whichever pool thread hit it) is RESOURCE_EXHAUSTED, never an exception
  // out of the backend.
  return CallNoThrow([&]() -> absl::StatusOr<CompactLayer> {
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(ValidateInput(in));
    RETURN_IF_ERROR(ValidateSpec(spec, in.shape, in.layer_index));
    RETURN_IF_ERROR(ValidateSpecInput(spec, in));
    CompressTimings t;
    const auto select_start = std::chrono::steady_clock::now();
    // Cancelled work stops within a block of each stage; nothing after it runs.
    RETURN_IF_ERROR(cpu::CancelStatus(in));
    TokenSelection tokens;
    double scored_here = 0;  // of t.score, the part spent in this call
    if (early == nullptr) {
      tokens = cpu::SelectTokensImpl(in, spec, pool, &t.score);
      scored_here = t.score;
    } else {
      // Scored before V arrived: the value weighting now, then the same selection.
      if (early->computed != cpu::NeedsScores(in, spec) ||
          (early->computed && early->scores.size() != static_cast<size_t>(in.shape.num_kv_heads) *
                                                          in.shape.seq_len)) {
        return absl::InvalidArgumentError("scores: not ScoreKeys' output for this input and spec");
      }
      const auto weight_start = std::chrono::steady_clock::now();
      if (early->computed) cpu::ApplyValueWeights(in, spec.eviction, pool, &early->scores);
      scored_here = SecondsSince(weight_start);
      t.score = early->seconds + scored_here;
      RETURN_IF_ERROR(cpu::CancelStatus(in));
      if (!early->head_counts.empty()) {
        if (!early->computed) {
          return absl::InvalidArgumentError("head_counts: the layer has no scores");
        }
        ASSIGN_OR_RETURN(tokens, cpu::SelectCountsImpl(in, spec, pool, early->scores,
                                                       early->head_counts));
      } else {
        tokens =
            cpu::SelectFromScoresImpl(in, spec, pool, early->computed ? &early->scores : nullptr);
      }
    }
    RETURN_IF_ERROR(cpu::CancelStatus(in));
    ChannelSelection channels = cpu::SelectChannelsImpl(in, tokens, spec, pool);
    RETURN_IF_ERROR(cpu::CancelStatus(in));
    t.select = SecondsSince(select_start) - scored_here;
    const auto pack_start = std::chrono::steady_clock::now();
    cpu::PackWork work;
    ASSIGN_OR_RETURN(CompactLayer layer,
                     cpu::PackLayerImpl(in, tokens, channels, spec, pool, &work));
    const double pack_wall = SecondsSince(pack_start);
    t.quantize =
        work.task_seconds > 0 ? pack_wall * (work.quantize_seconds / work.task_seconds) : 0;
    t.pack = pack_wall - t.quantize;
    t.total = SecondsSince(start);
    if (timings != nullptr) *timings = t;
    return layer;
  });
}

std::unique_ptr<Backend> NewCpuBackend(const BackendOptions& options) {
  return std::unique_ptr<Backend>(new CpuBackend(options));
}

}  // namespace kvc::cpu

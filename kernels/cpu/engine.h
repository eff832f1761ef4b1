// Internal entry points of the CPU engine: the public functions of kvc/selection.h run these on
// ThreadPool::Default(); the CPU backend runs them on its own pool.
//
// BLAS threading: the stages run one single-threaded sgemm per KV head in parallel on the pool
// (measured faster than one multi-threaded sgemm per head for Hkv >= threads, see engine_bench).
// When the pool has more than one thread they therefore set OpenBLAS to one thread (a
// process-wide OpenBLAS setting); with a one-thread pool OpenBLAS's own setting is left alone.
#ifndef KVC_KERNELS_CPU_ENGINE_H_
#define KVC_KERNELS_CPU_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "kvc/buffer_pool.h"
#include "kvc/cancel.h"
#include "kvc/layer.h"
#include "kvc/selection.h"
#include "kvc/spec.h"
#include "kvc/thread_pool.h"

namespace kvc::cpu {

// Preconditions for the *Impl functions: input and spec already validated. They stop early,
// within one row block or chunk, once in.cancel reads as cancelled; what they return is then
// meaningless, and callers check CancelStatus(in) after each stage.
// The policy's scores (its CPU scorer, scorers.cc), value-weighted where its row composes with
// value weighting (kvc/policy.h).
void ScoreTokensImpl(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                     std::vector<float>* scores);
// ScoreTokensImpl in its two steps: the scorer alone (reads K and the queries, never V), then the
// value weighting (reads V; a no-op for a policy or spec without it).
void RawScoresImpl(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                   std::vector<float>* scores);
void ApplyValueWeights(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                       std::vector<float>* scores);
// Whether the spec's selection of this layer needs scores at all (false when the protected sinks
// and recent tokens fill the budget).
bool NeedsScores(const LayerInput& in, const CompressionSpec& spec);
// The scorer of h2o, snapkv and keyformer (scoring.cc): the observation queries' attention,
// pooled for snapkv, with Gumbel noise for keyformer; out [Hkv, S].
void ObservedAttentionScores(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                             float* out);
TokenSelection SelectTokensImpl(const LayerInput& in, const CompressionSpec& spec, ThreadPool* pool,
                                double* score_seconds);
// SelectTokensImpl's selection from given scores ([num_kv_heads, S], as ScoreTokensImpl writes
// them; may be modified): the CUDA backend scores on the device and selects here for head-adaptive
// budgets. `scores` may be null when the protected tokens fill the budget (no scores needed).
TokenSelection SelectFromScoresImpl(const LayerInput& in, const CompressionSpec& spec,
                                    ThreadPool* pool, std::vector<float>* scores);
// Layer-adaptive selection: head h keeps counts[h] tokens (its protected ones for the layer's
// budget, then its best by score), from ScoreKeys' scores. INVALID_ARGUMENT for counts that do
// not fit (size, below the protected tokens, above S).
absl::StatusOr<TokenSelection> SelectCountsImpl(const LayerInput& in, const CompressionSpec& spec,
                                                ThreadPool* pool, const std::vector<float>& scores,
                                                const std::vector<int32_t>& counts);
ChannelSelection SelectChannelsImpl(const LayerInput& in, const TokenSelection& tokens,
                                    const CompressionSpec& spec, ThreadPool* pool);

// Validates that `tokens` fits the input (heads, budget, positions ascending and < S).
absl::Status ValidateTokenSelection(const LayerInput& in, const TokenSelection& tokens);

// r: the most recent kept tokens that stay unpruned and unquantized (see CompressionSpec).
int RecentCount(const CompressionSpec& spec, int budget);

// Sets OpenBLAS to one thread when the pool runs several (see the file comment).
void PrepareBlas(const ThreadPool* pool);

// How attention scoring (h2o, snapkv, keyformer, kvzip) computes its logits for a layer of this
// dtype and head_dim at the active instruction-set level (kvc/cpu_isa.h): AMX tiles with bf16
// hi/lo splits (near-fp32); with ScoringMath::kInteger and without AMX, int8 dot products from
// AVX2 up (AVX-512 VNNI, else AVX2 with 7-bit queries; cpu/int8_logits.h); AVX-512 BF16 dot
// products on bf16 layers (exact products, cpu/amx_logits.h); otherwise, from AVX2 up, fp32
// multiply-adds from packed copies of the keys (cpu/f32_logits.h: sgemm's values up to the order
// of the additions); below AVX2, sgemm on fp32 copies. LogitsPathName is what benchmarks and logs
// print (with the level for kF32Fma, the kernel for kInt8Dot).
enum class LogitsPath { kSgemm, kBf16Dot, kAmx, kInt8Dot, kF32Fma };
LogitsPath ScoringLogitsPath(DType dtype, int head_dim, ScoringMath math = ScoringMath::kExact);
std::string_view LogitsPathName(LogitsPath path);

// One scratch array of a thread: Get<T>(n) returns room for at least n elements (contents
// unspecified; earlier contents are not kept when it grows). Below kScratchKeepBytes the memory is
// the thread's own and kept for its next task (at most kScratchKeepBytes per array and thread: a
// fixed overhead); larger memory comes from LargeBuffers() (kvc/buffer_pool.h) and goes back
// there when the task ends (ReleaseLarge), so a request's scratch never outlives it except as the
// pool's idle buffers, which its cap bounds. Throws std::bad_alloc when memory cannot be had (the
// backends turn that into RESOURCE_EXHAUSTED).
inline constexpr size_t kScratchKeepBytes = size_t{256} << 10;
class ScratchArray {
 public:
  template <typename T>
  T* Get(size_t n) {
    return static_cast<T*>(Bytes(n, sizeof(T)));
  }
  void ReleaseLarge();

 private:
  void* Bytes(size_t n, size_t elem);
  std::unique_ptr<uint8_t[]> small_;
  size_t small_bytes_ = 0;
  BufferPool::Buffer large_;
};

// Observation rows [begin, end) of a KV head's group that see the same keys: [0, sink_end) and
// [lo, hi) (AttentionScoreHead; causal rows stop earlier).
struct RowSpan {
  int begin, end;
  int sink_end, lo, hi;
};

// The arrays one task of the engine uses (every stage names its own use of them).
struct Scratch {
  ScratchArray q, k, v, logits, tile, acc, row_max, cand, stats;
  ScratchArray amx_q, amx_k;  // AMX-packed queries and keys (scoring.cc, cpu/amx_logits.h)
  ScratchArray top;  // kvzip's top_rows largest probabilities per token (AttentionScoreHead)
  std::vector<const float*> rows;  // row pointers of one chunk (AttentionScoreHead): small
  // One row block's key pieces (start, length) in AttentionScoreHead: small, like `rows`.
  std::vector<std::pair<int, int>> pieces;
  static Scratch& ForThisThread();
  void ReleaseLarge();
};

// Gives the calling thread's large scratch back when destroyed: each task body that uses Scratch
// (one KV head of a stage) holds one, so large scratch lives only while its task runs.
class ScratchTask {
 public:
  ScratchTask() = default;
  ScratchTask(const ScratchTask&) = delete;
  ScratchTask& operator=(const ScratchTask&) = delete;
  ~ScratchTask() { Scratch::ForThisThread().ReleaseLarge(); }
};

// Bytes of large scratch (taken from LargeBuffers()) held by all threads now, and the most held
// at once since the last ResetScratchPeak (for tests of the cost model's scratch bound).
uint64_t LargeScratchBytes();
uint64_t LargeScratchPeakBytes();
void ResetScratchPeak();

// The engine's check between blocks (see kvc/cancel.h).
inline bool Cancelled(const LayerInput& in) { return kvc::Cancelled(in.cancel); }
// OK, or the status of the input's token once cancelled.
inline absl::Status CancelStatus(const LayerInput& in) {
  return in.cancel != nullptr ? in.cancel->status() : absl::OkStatus();
}

// Converts `count` Q_obs rows of KV head h's query group, starting at group row `first`, to float
// [count, D]; group row r is row r % W of query head h * g + r / W.
void LoadQueryRows(const LayerInput& in, int h, int first, int count, float* dst);
// Where token `first` of K (or V when `values`) head h starts in the input; *stride is the
// distance in elements from one token's row to the next (HND: D, NHD: Hkv * D).
const uint8_t* HeadRows(const LayerInput& in, bool values, int h, int first, size_t* stride);
// Converts tokens [first, first + count) of K (or V when `values`) head h to float, [count, D].
void LoadHeadRows(const LayerInput& in, bool values, int h, int first, int count, float* dst);

}  // namespace kvc::cpu

#endif  // KVC_KERNELS_CPU_ENGINE_H_

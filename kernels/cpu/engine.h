// Internal entry points of the CPU engine: the public functions of kvc/selection.h run these on
// ThreadPool::Default(); the CPU backend runs them on its own pool.
//
// BLAS threading: the stages run one single-threaded sgemm per KV head in parallel on the pool
// (measured faster than one multi-threaded sgemm per head for Hkv >= threads, see engine_bench).
// When the pool has more than one thread they therefore set OpenBLAS to one thread (a
// process-wide OpenBLAS setting); with a one-thread pool OpenBLAS's own setting is left alone.
#ifndef KVC_KERNELS_CPU_ENGINE_H_
#define KVC_KERNELS_CPU_ENGINE_H_

#include <vector>

#include "absl/status/statusor.h"
#include "kvc/layer.h"
#include "kvc/selection.h"
#include "kvc/spec.h"
#include "kvc/thread_pool.h"

namespace kvc::cpu {

// Preconditions for the *Impl functions: input and spec already validated.
// The policy's scores (its CPU scorer, scorers.cc), value-weighted where its row composes with
// value weighting (kvc/policy.h).
void ScoreTokensImpl(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                     std::vector<float>* scores);
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
ChannelSelection SelectChannelsImpl(const LayerInput& in, const TokenSelection& tokens,
                                    const CompressionSpec& spec, ThreadPool* pool);

// Validates that `tokens` fits the input (heads, budget, positions ascending and < S).
absl::Status ValidateTokenSelection(const LayerInput& in, const TokenSelection& tokens);

// r: the most recent kept tokens that stay unpruned and unquantized (see CompressionSpec).
int RecentCount(const CompressionSpec& spec, int budget);

// Sets OpenBLAS to one thread when the pool runs several (see the file comment).
void PrepareBlas(const ThreadPool* pool);

// Per-thread scratch buffers, grown on demand and kept for reuse so that the hot loops do not
// allocate (and page-fault) on every call.
struct Scratch {
  std::vector<float> q, k, v, logits, tile, acc, row_max;
  static Scratch& ForThisThread();
};

// Converts Q_obs rows of KV head h's query group to float, [g * W, D] (row i * W + t).
void LoadQueryGroup(const LayerInput& in, int h, float* dst);
// Converts tokens [first, first + count) of K (or V when `values`) head h to float, [count, D].
void LoadHeadRows(const LayerInput& in, bool values, int h, int first, int count, float* dst);

}  // namespace kvc::cpu

#endif  // KVC_KERNELS_CPU_ENGINE_H_

// The cost model of kvc/cost.h. Each eviction policy's scoring is priced by the formula its row
// of the policy table names (kvc/policy.h, ScoreCost); each key channel policy by a row of the
// table below. The formulas follow the CPU engine's loops (scoring.cc, score_extra.cc,
// selection.cc, channels.cc, compact.cc) and its blocking (ScoreRowBlock, kScoreTokenChunk). Buffers a task reuses for several purposes are
// counted once per purpose, so scratch stays an upper bound.
#include "kvc/cost.h"

#include <algorithm>
#include <initializer_list>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kvc/buffer_pool.h"
#include "kvc/checked_math.h"
#include "kvc/policy.h"

namespace kvc {
namespace {

constexpr uint64_t kSaturated = std::numeric_limits<uint64_t>::max();
constexpr uint64_t kFloat = 4;
constexpr uint64_t kT = kTranscendentalFlops;

// The product of `factors`, UINT64_MAX when it does not fit.
uint64_t Mul(std::initializer_list<uint64_t> factors) {
  const std::optional<uint64_t> p = CheckedProduct(factors);
  return p ? *p : kSaturated;
}

uint64_t Add(uint64_t a, uint64_t b) {
  const std::optional<uint64_t> s = CheckedAdd(a, b);
  return s ? *s : kSaturated;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

// What every row reads: the shape as 64-bit counts, the layer's budget and the spec.
struct Input {
  uint64_t hkv, hq, g, s, d, w;
  uint64_t budget;  // B: kept tokens per KV head
  uint64_t pruned;  // m = B - r: kept tokens that lose channels or get quantized
  uint64_t rows;    // g * W: observation rows of one KV head
  uint64_t row_block;
  uint64_t chunk;  // min(S, kScoreTokenChunk)
  bool whole_layer_statistics;
  const CompressionSpec* spec;
};

// Named terms of one or more layers. Scratch comes in stages (scoring, selection, channels,
// packing: one pool job each, whose tasks free their scratch when they end); within a stage a
// task's buffers add up, and the peak is the largest stage.
class Sheet {
 public:
  void Flops(const std::string& term, uint64_t value) {
    uint64_t& t = flops_[term];
    t = Add(t, Mul({value, repeat_}));
  }
  // Flops added from now on count `times` times (identical layers).
  void SetRepeat(uint64_t times) { repeat_ = times; }
  // Starts the next stage of the current layer.
  void Stage() {
    Close();
    task_ = call_ = 0;
    task_terms_.clear();
    call_terms_.clear();
  }
  void Task(const std::string& term, uint64_t bytes) {
    // Large arrays come from LargeBuffers(), whose buffers are rounded up to its granule.
    if (bytes >= BufferPool::kMinPooledBytes && bytes < kSaturated - BufferPool::kGranule) {
      bytes = BufferPool::Rounded(bytes);
    }
    task_ = Add(task_, bytes);
    task_terms_.emplace_back(term, bytes);
  }
  void Call(const std::string& term, uint64_t bytes) {
    call_ = Add(call_, bytes);
    call_terms_.emplace_back(term, bytes);
  }

  WorkCost Finish(const CostConcurrency& c, uint64_t tasks_per_layer) {
    Close();
    WorkCost out;
    for (const auto& [term, value] : flops_) {
      out.flops = Add(out.flops, value);
      if (value > out.flops_term_value || out.flops_term.empty()) {
        out.flops_term = term;
        out.flops_term_value = value;
      }
    }
    const uint64_t layers = static_cast<uint64_t>(std::max(1, c.concurrent_layers));
    const uint64_t tasks = std::min(static_cast<uint64_t>(std::max(1, c.parallel_tasks)),
                                    Mul({tasks_per_layer, layers}));
    out.scratch_bytes = Add(Mul({max_task_, tasks}), Mul({max_call_, layers}));
    const uint64_t task_part = Mul({task_term_.second, tasks});
    const uint64_t call_part = Mul({call_term_.second, layers});
    if (task_part >= call_part) {
      out.scratch_term = task_term_.first + " per task";
      out.scratch_term_value = task_part;
    } else {
      out.scratch_term = call_term_.first;
      out.scratch_term_value = call_part;
    }
    return out;
  }

 private:
  using Term = std::pair<std::string, uint64_t>;
  static Term Largest(const std::vector<Term>& terms) {
    Term best{"", 0};
    for (const Term& t : terms) {
      if (t.second > best.second) best = t;
    }
    return best;
  }
  void Close() {
    if (task_ > max_task_) {
      max_task_ = task_;
      task_term_ = Largest(task_terms_);
    }
    if (call_ > max_call_) {
      max_call_ = call_;
      call_term_ = Largest(call_terms_);
    }
  }

  std::map<std::string, uint64_t> flops_;
  uint64_t repeat_ = 1;
  uint64_t task_ = 0, call_ = 0, max_task_ = 0, max_call_ = 0;
  std::vector<Term> task_terms_, call_terms_;
  Term task_term_{"", 0}, call_term_{"", 0};
};

// ---- Token scores, one row per eviction policy
// ---------------------------------------------------

void NoScores(const Input&, Sheet*) {}

// h2o, snapkv, keyformer: per KV head, its g * W query rows against all S keys in row blocks
// (scoring.cc, AttentionScoreHead).
void AttentionScores(const Input& in, Sheet* s) {
  const EvictionSpec& e = in.spec->eviction;
  // Causal: observation row t sees S - W + t + 1 keys, W * S - W * (W - 1) / 2 for the W rows
  // of a query head. A block's GEMM runs to its last row's limit: beyond the causal count by at
  // most min(W, row_block) keys per row (a block spans at most two query heads' rows).
  // kvzip's reconstruction rows come after the context: each sees all S keys, or with
  // reconstruction passes its pass's sinks and chunk only.
  const bool recon = Policy(e.policy).rows_after_context;
  const bool passes = recon && !e.pass_rows.empty();
  uint64_t causal = 0;
  uint64_t converted = 0;  // keys converted per KV head: each row block converts the keys it sees
  if (passes) {
    for (size_t p = 0; p < e.pass_rows.size(); ++p) {
      const PassKeys pk = PassKeyRange(e, static_cast<int>(in.s), p);
      const uint64_t rows = static_cast<uint64_t>(e.pass_rows[p]);
      const auto keys = static_cast<uint64_t>(pk.sink_end + (pk.hi - pk.lo));
      causal = Add(causal, Mul({rows, keys}));
      // One span per query head and pass, in blocks of row_block rows.
      converted = Add(converted, Mul({in.g, CeilDiv(rows, in.row_block), keys}));
    }
  } else if (recon) {
    causal = Mul({in.w, in.s});
  } else {
    causal = Mul({in.w, in.s}) - (in.w > 0 ? Mul({in.w, in.w - 1}) / 2 : 0);
  }
  const uint64_t logits = Mul({in.hq, causal});
  const uint64_t trimmed =
      Add(logits, Mul({in.hkv, in.rows, std::min<uint64_t>(in.w, in.row_block)}));
  s->Flops("attention scores (num_q_heads*causal_keys*head_dim*2)", Mul({trimmed, in.d, 2}));
  s->Flops("attention softmax (num_q_heads*causal_keys exp)", Mul({logits, kT}));
  if (e.policy == EvictionPolicy::kKeyformer) {
    s->Flops("keyformer noise (num_q_heads*causal_keys*2 log)", Mul({logits, 2, kT}));
  }
  if (recon && e.top_rows > 1) {
    // Each probability is compared with its token's K-th largest; one above it moves up to K-1
    // (priced at K: the worst case, rows in increasing order).
    const auto k = static_cast<uint64_t>(e.top_rows);
    s->Flops("kvzip top rows (num_q_heads*causal_keys*top_rows)", Mul({logits, k}));
    s->Task("kvzip top rows (top_rows*seq_len floats)", Mul({k, in.s, kFloat}));
  }
  if (!passes) {
    converted = Mul({CeilDiv(std::max<uint64_t>(in.rows, 1), in.row_block), in.s});
  }
  s->Flops("key conversion (num_kv_heads*row_blocks*keys_seen*head_dim)",
           Mul({in.hkv, converted, in.d}));
  s->Flops("query conversion (num_q_heads*obs_window*head_dim)", Mul({in.hq, in.w, in.d}));
  // A row block's key pieces: the sinks' one more with passes (kvc/cost.h: kScoreTokenChunk).
  const uint64_t chunks = CeilDiv(in.s, kScoreTokenChunk) + (passes ? 1 : 0);
  s->Task("query rows (row_block*head_dim floats)", Mul({in.row_block, in.d, kFloat}));
  s->Task("key chunk", Mul({in.chunk, in.d, kFloat}));
  s->Task("logit tile", Mul({in.row_block, in.chunk, kFloat}));
  // The AMX path's bf16 hi/lo copies (cpu/amx_logits.h; counted on every machine, so that a
  // request's cost does not depend on the CPU that serves it): rows and keys padded to 32.
  s->Task("AMX query rows (2*row_block*head_dim bf16)",
          Mul({CeilDiv(in.row_block, 32), 32, in.d, 2, 2}));
  s->Task("AMX key chunk (2*chunk*head_dim bf16)", Mul({CeilDiv(in.chunk, 32), 32, in.d, 2, 2}));
  s->Task("parked logits (row_block*seq_len floats)",
          Mul({Add(Mul({in.row_block, kScoreTokenChunk, chunks - 1}), 16), kFloat}));
  s->Task("softmax statistics", Mul({in.row_block, chunks + 2, kFloat}));
  if (e.policy == EvictionPolicy::kSnapKV) {
    s->Flops("snapkv pooling (num_kv_heads*seq_len*pool_kernel)",
             Mul({in.hkv, in.s, std::min<uint64_t>(in.s, static_cast<uint64_t>(e.pool_kernel))}));
    s->Task("pooling copy (seq_len floats)", Mul({in.s, kFloat}));
  }
}

// Expected attention (score_extra.cc): per query head its statistics (from Q_obs in row blocks,
// or copied from q_stats), rotated to the horizon, then k^T Sigma k for every key.
void ExpectedScores(const Input& in, Sheet* s) {
  const EvictionSpec& e = in.spec->eviction;
  const uint64_t dd = Mul({in.d, in.d});
  if (e.query_stats) {
    s->Flops("query statistics copy (num_q_heads*(head_dim+head_dim^2))",
             Mul({in.hq, Add(in.d, dd)}));
  } else {
    s->Flops("query un-rotation (num_q_heads*obs_window*head_dim trig)",
             Mul({in.hq, in.w, in.d, kT}));
    s->Flops("query covariance (num_q_heads*obs_window*head_dim^2*2)", Mul({in.hq, in.w, dd, 2}));
    const uint64_t block = std::min<uint64_t>(std::max<uint64_t>(in.w, 1),
                                              std::max<uint64_t>(kScoreQueryFloats / in.d, 1));
    s->Task("query rows of one head (row_block*head_dim floats)", Mul({block, in.d, kFloat}));
  }
  s->Flops("statistics rotation (num_q_heads*head_dim^2*4)", Mul({in.hq, dd, 4}));
  s->Flops("expected scores (num_q_heads*seq_len*head_dim^2*2)", Mul({in.hq, in.s, dd, 2}));
  s->Flops("expected logits (num_q_heads*seq_len*head_dim*5)", Mul({in.hq, in.s, in.d, 5}));
  s->Flops("expected softmax (num_q_heads*seq_len exp)", Mul({in.hq, in.s, kT}));
  s->Task("logits of one query head (seq_len floats)", Mul({in.s, kFloat}));
  s->Task("key chunk and its product with the covariance", Mul({in.chunk, in.d, 2, kFloat}));
  s->Task("one head's statistics (float and double)", Mul({Add(in.d, dd), kFloat + 8}));
  // The CUDA backend computes the statistics of every query head on the host and copies them to
  // the device in one piece.
  if (in.whole_layer_statistics) {
    s->Call("statistics of all query heads (num_q_heads*(head_dim+head_dim^2) floats)",
            Mul({in.hq, Add(in.d, dd), kFloat}));
  }
}

void KeyDiffScores(const Input& in, Sheet* s) {
  s->Flops("keydiff scores (num_kv_heads*seq_len*head_dim*6)", Mul({in.hkv, in.s, in.d, 6}));
  s->Flops("key norms (num_kv_heads*seq_len sqrt)", Mul({in.hkv, in.s, kT}));
  s->Task("key chunk", Mul({in.chunk, in.d, kFloat}));
}

void KNormScores(const Input& in, Sheet* s) {
  s->Flops("key norms (num_kv_heads*seq_len*head_dim*3)", Mul({in.hkv, in.s, in.d, 3}));
  s->Flops("key norms (num_kv_heads*seq_len sqrt)", Mul({in.hkv, in.s, kT}));
  s->Task("key chunk", Mul({in.chunk, in.d, kFloat}));
}

void RandomScores(const Input& in, Sheet* s) {
  s->Flops("random scores (num_kv_heads*seq_len*32)", Mul({in.hkv, in.s, 32}));
}

using ScoreCostFn = void (*)(const Input&, Sheet*);

// The formula a policy's row names (kvc/policy.h, PolicyInfo::cost).
ScoreCostFn ScoreCostOf(EvictionPolicy p) {
  if (!IsKnownPolicy(p)) return nullptr;
  switch (Policy(p).cost) {
    case ScoreCost::kNone:
      return NoScores;
    case ScoreCost::kRandom:
      return RandomScores;
    case ScoreCost::kAttention:
      return AttentionScores;
    case ScoreCost::kKeyNorms:
      return KNormScores;
    case ScoreCost::kKeyDiff:
      return KeyDiffScores;
    case ScoreCost::kExpected:
      return ExpectedScores;
  }
  return nullptr;
}

// Value-aware weighting (score_extra.cc, ValueWeightHead), in the scoring stage.
void ValueWeightCost(const Input& in, Sheet* s) {
  const ValueWeight w = EffectiveValueWeight(in.spec->eviction);
  if (w != ValueWeight::kMul && w != ValueWeight::kAdd) return;
  s->Flops("value norms (num_kv_heads*seq_len*head_dim*3)", Mul({in.hkv, in.s, in.d, 3}));
  s->Task("value chunk", Mul({in.chunk, in.d, kFloat}));
  s->Task("value norms (seq_len floats)", Mul({in.s, kFloat}));
}

// Selection (selection.cc): per head nth_element and a sort of the kept positions, or AdaKV's
// pooled selection over every head.
void SelectionCost(const Input& in, Sheet* s) {
  const EvictionSpec& e = in.spec->eviction;
  s->Call("kept positions (num_kv_heads*budget int32)", Mul({in.hkv, in.budget, 4}));
  if (!PolicyHasScores(e.policy)) return;
  s->Call("token scores (num_kv_heads*seq_len floats)", Mul({in.hkv, in.s, kFloat}));
  uint64_t log_b = 1;
  while ((uint64_t{1} << log_b) < in.budget && log_b < 63) ++log_b;
  s->Flops("token selection (num_kv_heads*(seq_len*16 + budget*log2(budget)*2))",
           Add(Mul({in.hkv, in.s, 16}), Mul({in.hkv, in.budget, log_b, 2})));
  if (e.adaptive) {
    s->Flops("head-adaptive selection (num_kv_heads*seq_len*(16 + exp))",
             Mul({in.hkv, in.s, 16 + kT}));
    s->Call("head-adaptive candidates (num_kv_heads*seq_len*16 bytes)", Mul({in.hkv, in.s, 16}));
  } else {
    s->Task("candidates (seq_len int32)", Mul({in.s, 4}));
  }
}

// ---- Channels, one row per key channel policy, plus value pruning
// --------------------------------

void NoKeyChannels(const Input&, Sheet*) {}

// l1 / l2 / think (channels.cc, KeyChannelScores): the pruned tokens' keys in chunks; think also
// the group's query rows in blocks.
void KeyChannelCost(const Input& in, Sheet* s) {
  s->Flops("key channel scores (num_kv_heads*pruned_tokens*head_dim*3)",
           Mul({in.hkv, in.pruned, in.d, 3}));
  s->Task(
      "kept key chunk",
      Mul({std::min<uint64_t>(std::max<uint64_t>(in.pruned, 1), kScoreTokenChunk), in.d, kFloat}));
  if (in.spec->channels.key_policy == ChannelPolicy::kThink) {
    s->Flops("think query squares (num_q_heads*obs_window*head_dim*3)",
             Mul({in.hq, in.w, in.d, 3}));
    s->Task("query rows (row_block*head_dim floats)", Mul({in.row_block, in.d, kFloat}));
  }
}

using ChannelCostFn = void (*)(const Input&, Sheet*);
struct ChannelCostRow {
  ChannelPolicy policy;
  ChannelCostFn keys;
};
// One row per key channel policy.
constexpr ChannelCostRow kChannelCost[] = {
    {ChannelPolicy::kNone, NoKeyChannels},
    {ChannelPolicy::kThink, KeyChannelCost},
    {ChannelPolicy::kL1, KeyChannelCost},
    {ChannelPolicy::kL2, KeyChannelCost},
};

ChannelCostFn ChannelCostOf(ChannelPolicy p) {
  for (const ChannelCostRow& row : kChannelCost) {
    if (row.policy == p) return row.keys;
  }
  return nullptr;
}

// Value pruning (channels.cc, ValueChannelScores): attention of the group's rows over the kept
// keys, in row blocks, times the pruned values.
void ValueChannelCost(const Input& in, Sheet* s) {
  if (!in.spec->channels.prune_values) return;
  const uint64_t rows_total = Mul({in.hq, in.w});
  s->Flops("value pruning scores (num_q_heads*obs_window*budget*head_dim*2)",
           Mul({rows_total, in.budget, in.d, 2}));
  s->Flops("value pruning softmax (num_q_heads*obs_window*budget exp)",
           Mul({rows_total, in.budget, kT}));
  s->Flops("value pruning outputs (num_q_heads*obs_window*pruned_tokens*head_dim*2)",
           Mul({rows_total, in.pruned, in.d, 2}));
  s->Flops("kept token gather (num_kv_heads*2*budget*head_dim)", Mul({in.hkv, in.budget, in.d, 2}));
  const uint64_t b = std::max<uint64_t>(in.budget, 1);
  const uint64_t block =
      std::clamp<uint64_t>(std::min<uint64_t>(kScoreLogitFloats / b, kScoreQueryFloats / in.d), 1,
                           std::max<uint64_t>(in.rows, 1));
  s->Task("value pruning query rows and outputs", Mul({block, in.d, 2, kFloat}));
  s->Task("value pruning logits (row_block*budget floats)", Mul({block, b, kFloat}));
  s->Task("kept keys and values (2*budget*head_dim floats)", Mul({b, in.d, 2, kFloat}));
}

// Packing and quantization (compact.cc): a gather of the kept rows; the quantized ones in chunks.
void PackCost(const Input& in, Sheet* s) {
  s->Flops("gather (num_kv_heads*budget*head_dim*2)", Mul({in.hkv, in.budget, in.d, 2}));
  s->Call("kept positions (num_kv_heads*budget int32)", Mul({in.hkv, in.budget, 4}));
  if (in.spec->quant.bits > 0) {
    s->Flops("quantization (num_kv_heads*pruned_tokens*head_dim*2*12)",
             Mul({in.hkv, in.pruned, in.d, 24}));
    const uint64_t group = static_cast<uint64_t>(std::max(1, in.spec->quant.group_size));
    s->Task("quantization rows",
            Mul({std::max<uint64_t>(8192, Mul({group, in.d})) + in.d, kFloat}));
  }
}

Input MakeInput(const LayerShape& sh, const CompressionSpec& spec, int layer_index,
                bool whole_layer_statistics) {
  Input in;
  in.whole_layer_statistics = whole_layer_statistics;
  in.hkv = static_cast<uint64_t>(sh.num_kv_heads);
  in.hq = static_cast<uint64_t>(sh.num_q_heads);
  in.g = static_cast<uint64_t>(std::max(1, sh.group_size()));
  in.s = static_cast<uint64_t>(sh.seq_len);
  in.d = static_cast<uint64_t>(sh.head_dim);
  in.w = static_cast<uint64_t>(sh.obs_window);
  // Layer-adaptive budgets may give one layer up to all its tokens: priced at S per head.
  const int budget = spec.eviction.layer_adaptive
                         ? sh.seq_len
                         : EffectiveBudget(spec.eviction, layer_index, sh.seq_len);
  in.budget = static_cast<uint64_t>(budget);
  const bool reduced = spec.channels.key_policy != ChannelPolicy::kNone ||
                       spec.channels.prune_values || spec.quant.bits > 0;
  const int recent = reduced ? std::clamp(spec.recent_tokens, 0, budget) : 0;
  in.pruned = static_cast<uint64_t>(budget - recent);
  in.rows = in.g * in.w;
  in.row_block = static_cast<uint64_t>(ScoreRowBlock(
      sh.seq_len, static_cast<int>(std::min<uint64_t>(in.rows, 1u << 30)), sh.head_dim));
  in.chunk = std::min<uint64_t>(in.s, kScoreTokenChunk);
  in.spec = &spec;
  return in;
}

void AddLayer(const LayerShape& shape, DType dtype, const CompressionSpec& spec, int layer_index,
              const CostConcurrency& c, Sheet* s) {
  (void)dtype;  // the same multiply-adds on fp32 copies or bf16 dot products: bytes, not work
  const Input in = MakeInput(shape, spec, layer_index, c.whole_layer_statistics);
  s->Stage();  // scoring
  if (ScoreCostFn f = ScoreCostOf(spec.eviction.policy); f != nullptr) f(in, s);
  if (PolicyHasScores(spec.eviction.policy)) ValueWeightCost(in, s);
  s->Stage();  // selection
  SelectionCost(in, s);
  s->Stage();  // channels
  if (ChannelCostFn f = ChannelCostOf(spec.channels.key_policy); f != nullptr) f(in, s);
  ValueChannelCost(in, s);
  s->Stage();  // packing
  PackCost(in, s);
}

}  // namespace

int ScoreRowBlock(int seq_len, int rows, int head_dim) {
  const size_t by_logits = kScoreLogitFloats / static_cast<size_t>(std::max(seq_len, 1));
  const size_t by_queries = kScoreQueryFloats / static_cast<size_t>(std::max(head_dim, 1));
  return static_cast<int>(std::clamp<size_t>(std::min(by_logits, by_queries), 1,
                                             static_cast<size_t>(std::max(rows, 1))));
}

WorkCost LayerCost(const LayerShape& shape, DType dtype, const CompressionSpec& spec,
                   int layer_index, const CostConcurrency& concurrency) {
  Sheet sheet;
  AddLayer(shape, dtype, spec, layer_index, concurrency, &sheet);
  return sheet.Finish(concurrency, static_cast<uint64_t>(shape.num_kv_heads));
}

WorkCost CompressCost(const LayerShape& shape, DType dtype, const CompressionSpec& spec,
                      int num_layers, const CostConcurrency& concurrency) {
  Sheet sheet;
  // Layers past the per-layer budgets all cost the same: the last distinct layer is added once
  // with its flops counted for every remaining layer.
  const int distinct =
      std::max(1, std::min(num_layers, static_cast<int>(spec.eviction.layer_budgets.size()) + 1));
  for (int l = 0; l < distinct; ++l) {
    sheet.SetRepeat(l + 1 == distinct ? static_cast<uint64_t>(std::max(1, num_layers - l)) : 1);
    AddLayer(shape, dtype, spec, l, concurrency, &sheet);
  }
  if (spec.eviction.layer_adaptive) {
    // Every layer's scores are held until the last layer is scored, then AllocateAcrossLayers
    // (kvc/layer_budget.h) sorts each head's candidates and finds one threshold over a copy.
    const uint64_t all = Mul({static_cast<uint64_t>(std::max(0, num_layers)),
                              static_cast<uint64_t>(shape.num_kv_heads),
                              static_cast<uint64_t>(shape.seq_len)});
    uint64_t log_s = 1;
    while ((uint64_t{1} << log_s) < static_cast<uint64_t>(shape.seq_len) && log_s < 63) ++log_s;
    sheet.SetRepeat(1);
    sheet.Flops("layer-adaptive allocation (num_layers*num_kv_heads*seq_len*(log2(seq_len)+4))",
                Mul({all, log_s + 4}));
  }
  WorkCost out = sheet.Finish(concurrency, static_cast<uint64_t>(shape.num_kv_heads));
  if (spec.eviction.layer_adaptive) {
    const uint64_t held = Mul({static_cast<uint64_t>(std::max(0, num_layers)),
                               static_cast<uint64_t>(shape.num_kv_heads),
                               static_cast<uint64_t>(shape.seq_len), 3, kFloat});
    out.scratch_bytes = Add(out.scratch_bytes, held);
    if (held > out.scratch_term_value) {
      out.scratch_term = "layer-adaptive scores (3*num_layers*num_kv_heads*seq_len floats)";
      out.scratch_term_value = held;
    }
  }
  return out;
}

}  // namespace kvc

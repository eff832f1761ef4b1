// Decode attention straight on the packed bytes, bound by the bytes it reads.
//
// Work is cut into tasks: per KV head, chunks of ChunkRows old rows, plus one task for the recent
// rows and new tokens. A task streams its key rows once (two rows at a time against all the
// queries of the head's group, converting fp16 with F16C or unpacking codes in registers), takes
// a partial softmax (its own max and sum), then streams its value rows once in L1-sized blocks,
// keeping the accumulators of a 16-channel slice in registers. Partial results are merged exactly
// per head at the end (flash-decoding), which keeps ragged heads balanced across threads.
// Quantized keys fold the per-channel scale into the query ((q * s) . code + q . zero); by default
// that query is then quantized to int8 and the dot products are integer (attention_int.h), as are
// 2/4-bit values (options.math); otherwise they are fp32 and values are dequantized in registers
// (code * s + z, one FMA shared by every query).
#include "kvc/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "core/quantize.h"
#include "cpu/attention_int_rows.h"
#include "cpu/attention_internal.h"
#include "cpu/attention_rows.h"
#include "cpu/simd.h"

namespace kvc {
namespace cpu {
namespace {

using attn::AccumulateRows;
using attn::AccumulateValueCodesInt;
using attn::Dot;
using attn::Rows;
using attn::ScoreKeyCodesInt;
using attn::ScoreRows;
using attn::ValueCodesIntSupported;

// Old rows per task: about 512 KiB of key and value rows, so that starting a task's streams
// (the prefetchers ramping up, the first token group's preparation) is a small part of it, at
// most what keeps its scores [nq, rows] within 64 KiB, and at most `balance` (enough tasks for
// every thread); 1024 to 4096 rows. Measured (decode_bench, 32K x 8): 4096 rows of 2-/4-bit
// codes read 10-15% faster than 1024; fp16 rows (512 bytes: 1024 rows, as before) measured the
// same either way.
int ChunkRows(int nq, size_t row_bytes, size_t balance) {
  const size_t by_bytes = (size_t{512} << 10) / std::max<size_t>(row_bytes, 1);
  const size_t by_scores = 16384 / static_cast<size_t>(std::max(nq, 1));
  return static_cast<int>(
      std::clamp<size_t>(std::min({by_bytes, by_scores, balance}), 1024, 4096));
}
// kAuto's integer path needs this many kept channels in a row: below, the per-group query
// preparation costs more than the integer sums save (head_dim 8 models decode ~25% slower).
constexpr int kAutoMinChannels = 32;
// Below this many cached bytes in a call the pool's hand-off costs more than it saves.
constexpr size_t kMinParallelBytes = size_t{256} << 10;

// One KV head's work: m old rows, r recent rows (dtype, all D channels).
struct HeadWork {
  int m = 0, r = 0;
  Rows k_old, v_old, k_recent, v_recent;
  bool int_keys = false, int_values = false;  // PackedAttentionOptions::math
};

// One attention problem (a sequence): heads, the query and where the output goes.
struct Problem {
  int d = 0, nq = 0;  // nq = queries per KV head (group * n_q)
  const DecodeQuery* query = nullptr;
  float* out = nullptr;
  std::vector<HeadWork> heads;
};

struct Task {
  int problem = 0, head = 0;
  int j0 = 0, j1 = 0;  // old rows [j0, j1), or j0 = j1 = -1 for the recent + new tail
  size_t partial = 0;  // offset of [mx nq | l nq | acc nq*D] in the partial buffer
};

// ---- Tasks --------------------------------------------------------------------------------------

struct Scratch {
  std::vector<float> qm, qs, qz, s, acc, row;
};

// s[a * len + j] -> exp(s - max_a) in place; writes max and sum per query.
void PartialSoftmax(float* s, int len, int nq, float* mx, float* l) {
  for (int a = 0; a < nq; ++a) {
    float* sa = s + static_cast<size_t>(a) * len;
    const float m = simd::Max(sa, static_cast<size_t>(len));
    mx[a] = m;
    if (m == -std::numeric_limits<float>::infinity()) {  // every token masked
      std::fill(sa, sa + len, 0.0f);
      l[a] = 0.0f;
      continue;
    }
    l[a] = simd::ExpShiftSum(sa, static_cast<size_t>(len), m);
  }
}

// Old rows [t.j0, t.j1) of one head.
void RunOldChunk(const Problem& P, const Task& t, Scratch* sc, float* part) {
  const HeadWork& hw = P.heads[t.head];
  const int nq = P.nq, d = P.d, len = t.j1 - t.j0;
  float* mx = part;
  float* l = part + nq;
  float* out = part + 2 * nq;
  const float* qh = P.query->q + static_cast<size_t>(t.head) * nq * d;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  const Rows& K = hw.k_old;
  const int tk = K.n;
  // Only the kept key channels take part; the 1/sqrt(D) scale is folded into the query.
  sc->qm.resize(static_cast<size_t>(nq) * tk);
  for (int a = 0; a < nq; ++a) {
    for (int c = 0; c < tk; ++c) {
      sc->qm[static_cast<size_t>(a) * tk + c] =
          qh[static_cast<size_t>(a) * d + (K.idx != nullptr ? K.idx[c] : c)] * inv_sqrt_d;
    }
  }
  sc->s.resize(static_cast<size_t>(nq) * len);
  float* s = sc->s.data();
  if (K.kind == Rows::kKeyCodes && hw.int_keys) {
    ScoreKeyCodesInt(K, t.j0, t.j1, sc->qm.data(), nq, s, len);
  } else if (K.kind == Rows::kKeyCodes) {
    // Per-channel groups of G tokens: q . (code * scale + zero) = (q * scale) . code + q . zero.
    const int64_t g = K.group;  // 64-bit: g may be near INT_MAX
    sc->qs.resize(static_cast<size_t>(nq) * tk);
    sc->qz.resize(nq);
    for (int64_t g0 = (t.j0 / g) * g; g0 < t.j1; g0 += g) {
      const int64_t gi = g0 / g;
      const int a0 = static_cast<int>(std::max<int64_t>(t.j0, g0));
      const int a1 = static_cast<int>(std::min<int64_t>(t.j1, g0 + g));
      const float* scale = K.scale + static_cast<size_t>(gi) * tk;
      const float* zero = K.zero + static_cast<size_t>(gi) * tk;
      for (int a = 0; a < nq; ++a) {
        const float* qa = &sc->qm[static_cast<size_t>(a) * tk];
        float* qs = &sc->qs[static_cast<size_t>(a) * tk];
        for (int c = 0; c < tk; ++c) qs[c] = qa[c] * scale[c];
        sc->qz[a] = Dot(qa, zero, tk);
      }
      ScoreRows(K, a0, a1, sc->qs.data(), sc->qz.data(), nq, s + (a0 - t.j0), len, &sc->row);
    }
  } else {
    ScoreRows(K, t.j0, t.j1, sc->qm.data(), nullptr, nq, s, len, &sc->row);
  }
  PartialSoftmax(s, len, nq, mx, l);
  // Values accumulate over the kept value channels and are scattered to D once.
  const Rows& V = hw.v_old;
  sc->acc.assign(static_cast<size_t>(nq) * V.n, 0.0f);
  if (hw.int_values && ValueCodesIntSupported(V)) {
    AccumulateValueCodesInt(V, t.j0, t.j1, s, len, nq, sc->acc.data());
  } else {
    AccumulateRows(V, t.j0, t.j1, s, len, nq, sc->acc.data(), &sc->row);
  }
  std::fill(out, out + static_cast<size_t>(nq) * d, 0.0f);
  for (int a = 0; a < nq; ++a) {
    const float* acc = &sc->acc[static_cast<size_t>(a) * V.n];
    float* o = out + static_cast<size_t>(a) * d;
    for (int c = 0; c < V.n; ++c) o[V.idx != nullptr ? V.idx[c] : c] = acc[c];
  }
}

// The recent rows (all channels) and the new tokens (causal) of one head.
void RunTail(const Problem& P, const Task& t, Scratch* sc, float* part) {
  const HeadWork& hw = P.heads[t.head];
  const DecodeQuery& q = *P.query;
  const int nq = P.nq, d = P.d, r = hw.r, n_new = q.n_new;
  const int len = r + n_new;
  float* mx = part;
  float* l = part + nq;
  float* out = part + 2 * nq;
  const float* qh = q.q + static_cast<size_t>(t.head) * nq * d;
  const float* k_new = q.k_new + static_cast<size_t>(t.head) * n_new * d;
  const float* v_new = q.v_new + static_cast<size_t>(t.head) * n_new * d;
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(d));
  sc->qm.resize(static_cast<size_t>(nq) * d);
  for (size_t i = 0; i < sc->qm.size(); ++i) sc->qm[i] = qh[i] * inv_sqrt_d;
  sc->s.resize(static_cast<size_t>(nq) * len);
  float* s = sc->s.data();
  if (r > 0) ScoreRows(hw.k_recent, 0, r, sc->qm.data(), nullptr, nq, s, len, &sc->row);
  // Query i of n_q sees new tokens [0, n_new - n_q + i].
  for (int a = 0; a < nq; ++a) {
    const int last = n_new - q.n_q + a % q.n_q;
    for (int j = 0; j < n_new; ++j) {
      s[static_cast<size_t>(a) * len + r + j] =
          j <= last
              ? Dot(&sc->qm[static_cast<size_t>(a) * d], k_new + static_cast<size_t>(j) * d, d)
              : -std::numeric_limits<float>::infinity();
    }
  }
  PartialSoftmax(s, len, nq, mx, l);
  std::fill(out, out + static_cast<size_t>(nq) * d, 0.0f);
  if (r > 0) AccumulateRows(hw.v_recent, 0, r, s, len, nq, out, &sc->row);
  for (int a = 0; a < nq; ++a) {
    for (int j = 0; j < n_new; ++j) {
      const float p = s[static_cast<size_t>(a) * len + r + j];
      if (p != 0.0f) {
        simd::Axpy(p, v_new + static_cast<size_t>(j) * d, out + static_cast<size_t>(a) * d, d);
      }
    }
  }
}

size_t PartialFloats(const Problem& P) {
  return static_cast<size_t>(P.nq) * (2 + static_cast<size_t>(P.d));
}

// Plans the tasks, runs them and merges the partial results into each problem's output.
void Run(const std::vector<Problem>& problems, ThreadPool* pool) {
  std::vector<Task> tasks;
  size_t floats = 0, bytes = 0;
  // At least four tasks of old rows per thread where the rows allow (a long-context request on
  // many cores keeps them busy).
  size_t old_rows = 0;
  for (const Problem& P : problems) {
    for (const HeadWork& hw : P.heads) old_rows += static_cast<size_t>(hw.m);
  }
  const size_t threads = pool != nullptr ? static_cast<size_t>(pool->num_threads()) : 1;
  const size_t balance = old_rows / (4 * std::max<size_t>(threads, 1));
  for (int pi = 0; pi < static_cast<int>(problems.size()); ++pi) {
    const Problem& P = problems[pi];
    for (int h = 0; h < static_cast<int>(P.heads.size()); ++h) {
      const HeadWork& hw = P.heads[h];
      const int chunk = ChunkRows(P.nq, hw.k_old.row_bytes + hw.v_old.row_bytes, balance);
      for (int j0 = 0; j0 < hw.m; j0 += chunk) {
        tasks.push_back({pi, h, j0, std::min(hw.m, j0 + chunk), floats});
        floats += PartialFloats(P);
      }
      if (hw.r > 0 || P.query->n_new > 0) {
        tasks.push_back({pi, h, -1, -1, floats});
        floats += PartialFloats(P);
      }
      bytes += static_cast<size_t>(hw.m) * (hw.k_old.row_bytes + hw.v_old.row_bytes) +
               static_cast<size_t>(hw.r) * (hw.k_recent.row_bytes + hw.v_recent.row_bytes);
    }
  }
  std::vector<float> partials(floats);
  const auto body = [&](int i) {
    thread_local Scratch scratch;
    const Task& t = tasks[i];
    float* part = partials.data() + t.partial;
    if (t.j0 < 0) {
      RunTail(problems[t.problem], t, &scratch, part);
    } else {
      RunOldChunk(problems[t.problem], t, &scratch, part);
    }
  };
  const int n = static_cast<int>(tasks.size());
  if (pool != nullptr && pool->num_threads() > 1 && n > 1 && bytes >= kMinParallelBytes) {
    pool->ParallelFor(n, body);
  } else {
    for (int i = 0; i < n; ++i) body(i);
  }
  // Merge: tasks of one head are adjacent. out = sum_i e^(mx_i - M) acc_i / sum_i e^(mx_i - M) l_i.
  for (size_t i = 0; i < tasks.size();) {
    size_t e = i + 1;
    while (e < tasks.size() && tasks[e].problem == tasks[i].problem &&
           tasks[e].head == tasks[i].head) {
      ++e;
    }
    const Problem& P = problems[tasks[i].problem];
    const int nq = P.nq, d = P.d;
    float* out = P.out + static_cast<size_t>(tasks[i].head) * nq * d;
    for (int a = 0; a < nq; ++a) {
      float M = -std::numeric_limits<float>::infinity();
      for (size_t k = i; k < e; ++k) M = std::max(M, partials[tasks[k].partial + a]);
      float* o = out + static_cast<size_t>(a) * d;
      std::fill(o, o + d, 0.0f);
      if (M == -std::numeric_limits<float>::infinity()) continue;
      float L = 0.0f;
      for (size_t k = i; k < e; ++k) {
        const float* part = partials.data() + tasks[k].partial;
        const float w = std::exp(part[a] - M);
        L += w * part[nq + a];
        if (w != 0.0f) simd::Axpy(w, part + 2 * nq + static_cast<size_t>(a) * d, o, d);
      }
      const float inv = 1.0f / L;
      for (int c = 0; c < d; ++c) o[c] *= inv;
    }
    i = e;
  }
}

Rows DtypeRows(DType dt, const void* base, int n, const int32_t* idx) {
  Rows R;
  R.kind = Rows::kDtype;
  R.dtype = dt;
  R.base = static_cast<const uint8_t*>(base);
  R.row_bytes = static_cast<size_t>(n) * DTypeSize(dt);
  R.n = n;
  R.idx = idx;
  return R;
}

Rows CodeRows(Rows::Kind kind, const uint8_t* codes, const float* scale, const float* zero, int n,
              const int32_t* idx, int bits, int group) {
  Rows R;
  R.kind = kind;
  R.base = codes;
  R.row_bytes = quant::CodeRowBytes(n, bits);
  R.n = n;
  R.idx = idx;
  R.bits = bits;
  R.group = group;
  R.scale = scale;
  R.zero = zero;
  return R;
}

Problem FromCompact(const CompactLayerView& v, const DecodeQuery& q, float* out) {
  Problem P;
  P.d = v.head_dim();
  P.nq = q.num_q_heads / v.num_kv_heads() * q.n_q;
  P.query = &q;
  P.out = out;
  const DType dt = v.dtype();
  const int kbits = v.key_bits(), vbits = v.value_bits(), g = v.header().quant_group;
  P.heads.resize(v.num_kv_heads());
  for (int h = 0; h < v.num_kv_heads(); ++h) {
    const CompactHead hd = v.head(h);
    HeadWork& w = P.heads[h];
    w.m = hd.n_kept - hd.n_recent;
    w.r = hd.n_recent;
    w.k_old = kbits == 0 ? DtypeRows(dt, hd.key_old, hd.key_channels, hd.key_idx)
                         : CodeRows(Rows::kKeyCodes, hd.key_codes, hd.key_scale, hd.key_zero,
                                    hd.key_channels, hd.key_idx, kbits, g);
    w.v_old = vbits == 0 ? DtypeRows(dt, hd.value_old, hd.value_channels, hd.value_idx)
                         : CodeRows(Rows::kValueCodes, hd.value_codes, hd.value_scale,
                                    hd.value_zero, hd.value_channels, hd.value_idx, vbits, g);
    w.k_recent = DtypeRows(dt, hd.key_recent, P.d, nullptr);
    w.v_recent = DtypeRows(dt, hd.value_recent, P.d, nullptr);
  }
  return P;
}

absl::Status CheckQuery(int hkv, const DecodeQuery& q, const float* out) {
  if (q.num_q_heads < 1 || q.num_q_heads % hkv != 0) {
    return absl::InvalidArgumentError(absl::StrCat("query.num_q_heads: ", q.num_q_heads,
                                                   " is not a positive multiple of the cache's ",
                                                   "num_kv_heads ", hkv));
  }
  if (q.n_q < 0) {
    return absl::InvalidArgumentError(absl::StrCat("query.n_q: ", q.n_q, " is negative"));
  }
  if (q.n_new < q.n_q) {
    return absl::InvalidArgumentError(
        absl::StrCat("query.n_new: ", q.n_new, " is less than n_q ", q.n_q,
                     " (each query is one of the new tokens, so n_new >= n_q)"));
  }
  if (q.n_q > 0 && q.q == nullptr) return absl::InvalidArgumentError("query.q: null");
  if (q.n_new > 0 && q.k_new == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("query.k_new: null with n_new ", q.n_new));
  }
  if (q.n_new > 0 && q.v_new == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("query.v_new: null with n_new ", q.n_new));
  }
  if (q.n_q > 0 && out == nullptr) return absl::InvalidArgumentError("out: null");
  return absl::OkStatus();
}

}  // namespace

absl::Status DenseAttentionBatch(absl::Span<const DenseKv> caches,
                                 absl::Span<const DecodeQuery> queries,
                                 absl::Span<float* const> outs, ThreadPool* pool) {
  if (caches.size() != queries.size() || caches.size() != outs.size()) {
    return absl::InvalidArgumentError("dense attention: caches, queries and outs differ in size");
  }
  std::vector<Problem> problems;
  for (size_t i = 0; i < caches.size(); ++i) {
    const DenseKv& c = caches[i];
    absl::Status st = CheckQuery(c.num_kv_heads, queries[i], outs[i]);
    if (!st.ok()) return st;
    if (queries[i].n_q == 0) continue;
    Problem P;
    P.d = c.head_dim;
    P.nq = queries[i].num_q_heads / c.num_kv_heads * queries[i].n_q;
    P.query = &queries[i];
    P.out = outs[i];
    const size_t head_bytes = static_cast<size_t>(c.seq_len) * c.head_dim * DTypeSize(c.dtype);
    for (int h = 0; h < c.num_kv_heads; ++h) {
      HeadWork w;
      w.m = c.seq_len;
      w.k_old = DtypeRows(c.dtype, static_cast<const uint8_t*>(c.k) + h * head_bytes, c.head_dim,
                          nullptr);
      w.v_old = DtypeRows(c.dtype, static_cast<const uint8_t*>(c.v) + h * head_bytes, c.head_dim,
                          nullptr);
      P.heads.push_back(w);
    }
    problems.push_back(std::move(P));
  }
  return CallNoThrow([&] {
    Run(problems, pool);
    return absl::OkStatus();
  });
}

}  // namespace cpu

absl::Status PackedAttentionBatchCpu(absl::Span<const PackedAttentionItem> items, ThreadPool* pool,
                                     const PackedAttentionOptions& options) {
  std::vector<cpu::Problem> problems;
  problems.reserve(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const PackedAttentionItem& it = items[i];
    const std::string where = items.size() > 1 ? absl::StrCat("item ", i, ": ") : "";
    if (it.cache == nullptr || it.cache->blob().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, "cache: empty view (not produced by CompactLayerView::Parse)"));
    }
    absl::Status st = cpu::CheckQuery(it.cache->num_kv_heads(), it.query, it.out);
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(where, st.message()));
    if (it.query.n_q == 0) continue;
    problems.push_back(cpu::FromCompact(*it.cache, it.query, it.out));
    // Each tensor on integer dot products by its own bits: forced whenever quantized, automatic
    // at 4 bits or fewer over enough channels.
    using Math = PackedAttentionOptions::Math;
    auto integer = [&options](int bits, int channels) {
      if (options.math == Math::kInteger) return bits > 0;
      return options.math == Math::kAuto && bits > 0 && bits <= 4 &&
             channels >= cpu::kAutoMinChannels;
    };
    for (cpu::HeadWork& w : problems.back().heads) {
      w.int_keys = integer(it.cache->key_bits(), w.k_old.n);
      w.int_values = integer(it.cache->value_bits(), w.v_old.n);
    }
  }
  return CallNoThrow([&] {
    cpu::Run(problems, pool);
    return absl::OkStatus();
  });
}

absl::Status PackedAttentionCpu(const CompactLayerView& cache, const DecodeQuery& query, float* out,
                                ThreadPool* pool, const PackedAttentionOptions& options) {
  const PackedAttentionItem item{&cache, query, out};
  return PackedAttentionBatchCpu(absl::MakeConstSpan(&item, 1), pool, options);
}

}  // namespace kvc

// Decode speed on the CPU: what a compact cache buys a decode node.
//
// Attention rows: one decode step (one new token per sequence) of a Llama-3-8B-shaped layer
// (8 KV heads, 32 query heads, head_dim 128, fp16 K/V) at 4K and 32K cached tokens, for batches
// of 1 and 8 sequences (each sequence its own cache in its own memory).
//   BM_DecodePacked/S/B/spec  packed attention (kvc::PackedAttentionBatchCpu) over compact layers
//                             built by the real pipeline (CPU backend Compress) from the spec;
//                             quantized specs also as .../exact (PackedAttentionOptions kExact:
//                             fp32 instead of the default integer dot products)
//   BM_DecodeDense/S/B        the same kernels over the full fp16 cache (the dense baseline)
//   BM_DecodeBlas/S/B         OpenBLAS: scores = Q K^T (sgemm), softmax, out = P V (sgemm) per
//                             KV head, over an fp32 copy of the cache (BLAS has no fp16 path, so
//                             it reads twice the bytes)
//   BM_DecodeMemcpy/S/B       memcpy of the full cache's bytes (the machine's copy bandwidth)
// Every packed and BLAS row times the dense kernel in the same loop, alternating, so
// `speedup` (the median over iterations of dense time / this row's time) is a same-moment ratio
// on a noisy machine.
// Counters: us_per_token (step time / batch), MB_per_token (bytes read per token), GBps (bytes
// read / time), byte_ratio (dense bytes / this row's bytes), speedup, speedup_per_byte_ratio
// (speedup / byte_ratio; the goal is >= 0.8 from keep 0.5 down).
//
// Model rows (--model=PATH, a llama2.c checkpoint; skipped with a message when absent):
//   BM_ModelDecode/spec  tokens/s of teacher-forced decoding on the spec's compact cache vs the
//                        compact cache that keeps everything (same kernels; `speedup`) and vs
//                        kvc::model's own full fp32 cache (`speedup_vs_model_full`), alternating
//                        in one loop; byte_ratio = keep-everything blob bytes / the spec's.
//
// Kernel rows (one thread, no memory traffic to speak of: 8,192 rows that stay in L2):
//   BM_IntKernel/keys|values/bits/isa  the integer decode kernels alone, through the decode's
//                             entry points (kernels/cpu/attention_int_rows.h) with the kernels
//                             capped at isa, on the ×8 rows' shape of one head: 64 key channels
//                             (ThinK 0.5 of 128) in token groups of 32, 128 value channels in
//                             groups of 32, four queries, 1,024-row calls as the decode makes
//                             them; ns_per_row. Each instruction set the CPU has (and the cap
//                             allows) gets its own row.
// A summary table at the end repeats the ratios and the share of memcpy bandwidth.
// Run: decode_bench [--model=PATH] [--benchmark_filter=...]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "../../kernels/cpu/attention_int_rows.h"
#include "../../kernels/cpu/attention_internal.h"
#include "../../kernels/cpu/simd.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "benchmark/benchmark.h"
#include "kvc/attention.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"
#include "kvc/spec.h"
#include "kvc/thread_pool.h"

namespace kvc {
namespace {

constexpr int kKvHeads = 8, kQHeads = 32, kHeadDim = 128, kWindow = 32;
constexpr int kGroup = kQHeads / kKvHeads;

// The packed rows: keyformer eviction (the pipeline's scoring), ThinK key-channel pruning,
// KIVI-style quantization.
const char* const kSpecs[] = {
    "full",
    "keyformer:0.5",
    "keyformer:0.25",
    "keyformer:0.5+think:0.5",
    "keyformer:0.25+think:0.5",
    "keyformer:0.5+think:0.5+q4",
    "keyformer:0.25+think:0.5+q4",
    "keyformer:0.25+think:0.5+q2",
    "keyformer:0.25+think:0.5+q8",
    "keyformer:0.25+think:0.5+q8v4",  // 8-bit keys, 4-bit values
};

using Clock = std::chrono::steady_clock;
double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

ThreadPool& Pool() {
  static ThreadPool* pool = new ThreadPool(0);
  return *pool;
}

void Fill(uint16_t* v, size_t n, uint64_t seed, float scale) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    v[i] = FloatToHalf((static_cast<float>((x >> 40) & 0xffffff) / 16777216.0f - 0.5f) * scale);
  }
}

std::vector<float> RandomFloats(size_t n, uint64_t seed, float scale) {
  std::vector<uint16_t> h(n);
  Fill(h.data(), n, seed, scale);
  std::vector<float> f(n);
  for (size_t i = 0; i < n; ++i) f[i] = HalfToFloat(h[i]);
  return f;
}

// The full fp16 caches of up to 8 sequences at one length (sequence 0 also carries the
// observation queries the compressor scores with), and one decode query per sequence.
struct DenseSet {
  int seq_len = 0;
  std::vector<std::vector<uint16_t>> k, v;  // [seq] HND [Hkv, S, D]
  std::vector<uint16_t> q_obs;              // [Hq, W, D]
  std::vector<std::vector<float>> q, k_new, v_new;
  double bytes_per_seq() const { return 2.0 * kKvHeads * seq_len * kHeadDim * sizeof(uint16_t); }
  LayerInput input() const {
    LayerInput in;
    in.shape = {kKvHeads, kQHeads, seq_len, kHeadDim, kWindow};
    in.dtype = DType::kF16;
    in.layout = Layout::kHND;
    in.k = k[0].data();
    in.v = v[0].data();
    in.q_obs = q_obs.data();
    return in;
  }
  DecodeQuery query(int s) const {
    return DecodeQuery{kQHeads, 1, q[s].data(), 1, k_new[s].data(), v_new[s].data()};
  }
  cpu::DenseKv kv(int s) const {
    return cpu::DenseKv{DType::kF16, kKvHeads, seq_len, kHeadDim, k[s].data(), v[s].data()};
  }
};

constexpr int kMaxBatch = 8;

const DenseSet& GetDense(int seq_len) {
  static std::map<int, std::unique_ptr<DenseSet>> sets;
  auto& slot = sets[seq_len];
  if (!slot) {
    slot = std::make_unique<DenseSet>();
    DenseSet& d = *slot;
    d.seq_len = seq_len;
    const size_t n = static_cast<size_t>(kKvHeads) * seq_len * kHeadDim;
    // Sequence 0 is random; the others are copies in their own memory (generating 1 GiB of
    // random halves would dominate the run).
    for (int s = 0; s < kMaxBatch; ++s) {
      d.k.emplace_back(n);
      d.v.emplace_back(n);
      if (s == 0) {
        Fill(d.k[s].data(), n, 10, 4.0f);
        Fill(d.v[s].data(), n, 11, 2.0f);
      } else {
        std::memcpy(d.k[s].data(), d.k[0].data(), n * sizeof(uint16_t));
        std::memcpy(d.v[s].data(), d.v[0].data(), n * sizeof(uint16_t));
      }
      d.q.push_back(RandomFloats(static_cast<size_t>(kQHeads) * kHeadDim, 100 + s, 4.0f));
      d.k_new.push_back(RandomFloats(static_cast<size_t>(kKvHeads) * kHeadDim, 200 + s, 4.0f));
      d.v_new.push_back(RandomFloats(static_cast<size_t>(kKvHeads) * kHeadDim, 300 + s, 2.0f));
    }
    d.q_obs.resize(static_cast<size_t>(kQHeads) * kWindow * kHeadDim);
    Fill(d.q_obs.data(), d.q_obs.size(), 3, 4.0f);
  }
  return *slot;
}

void RunDense(const DenseSet& d, int batch, std::vector<std::vector<float>>* outs) {
  std::vector<cpu::DenseKv> kv;
  std::vector<DecodeQuery> q;
  std::vector<float*> o;
  for (int s = 0; s < batch; ++s) {
    kv.push_back(d.kv(s));
    q.push_back(d.query(s));
    o.push_back((*outs)[s].data());
  }
  const absl::Status st = cpu::DenseAttentionBatch(kv, q, o, &Pool());
  if (!st.ok()) std::fprintf(stderr, "dense: %s\n", std::string(st.message()).c_str());
}

std::vector<std::vector<float>> Outputs(int batch) {
  return std::vector<std::vector<float>>(
      batch, std::vector<float>(static_cast<size_t>(kQHeads) * kHeadDim));
}

// Results kept for the summary: GB/s and speedup per row name.
struct RowResult {
  double gbps = 0, speedup = 0, byte_ratio = 0;
};
std::map<std::string, RowResult>& Results() {
  static auto* r = new std::map<std::string, RowResult>();
  return *r;
}

// `ratios`: per iteration, dense time / this row's time (measured back to back); their median is
// the row's speedup, which a burst of load on the shared machine moves less than a ratio of sums.
void Report(benchmark::State& state, const std::string& name, double bytes_per_step, double seconds,
            double dense_seconds, double dense_bytes_per_step, int batch,
            std::vector<double> ratios = {}) {
  const double it = static_cast<double>(state.iterations());
  state.counters["us_per_token"] = 1e6 * seconds / it / batch;
  state.counters["MB_per_token"] = bytes_per_step / batch / 1e6;
  state.counters["GBps"] = bytes_per_step * it / seconds / 1e9;
  RowResult r;
  r.gbps = bytes_per_step * it / seconds / 1e9;
  if (dense_seconds > 0) {
    std::sort(ratios.begin(), ratios.end());
    const size_t n = ratios.size();
    r.speedup = n == 0 ? dense_seconds / seconds
                       : (n % 2 == 1 ? ratios[n / 2] : 0.5 * (ratios[n / 2 - 1] + ratios[n / 2]));
    r.byte_ratio = dense_bytes_per_step / bytes_per_step;
    state.counters["dense_GBps"] = dense_bytes_per_step * it / dense_seconds / 1e9;
    state.counters["speedup"] = r.speedup;
    state.counters["byte_ratio"] = r.byte_ratio;
    state.counters["speedup_per_byte_ratio"] = r.speedup / r.byte_ratio;
  }
  Results()[name] = r;
}

// ---- Attention rows -----------------------------------------------------------------------------

// exact: PackedAttentionOptions::Math::kExact (fp32 on quantized blocks instead of the default,
// integer dot products at 2 and 4 bits).
void BM_DecodePacked(benchmark::State& state, int seq_len, int batch, int spec_index, bool exact) {
  const std::string spec_text = kSpecs[spec_index];
  const DenseSet& d = GetDense(seq_len);
  absl::StatusOr<CompressionSpec> spec = ParseSpecString(spec_text);
  if (!spec.ok()) return state.SkipWithError(std::string(spec.status().message()).c_str());
  // The real pipeline on sequence 0's layer, copied into each sequence's own memory.
  static auto* backend = CreateCpuBackend({}).value().release();
  absl::StatusOr<CompactLayer> blob = backend->Compress(d.input(), *spec, nullptr);
  if (!blob.ok()) return state.SkipWithError(std::string(blob.status().message()).c_str());
  std::vector<std::vector<uint8_t>> blobs(batch);
  std::vector<CompactLayerView> views;
  for (int s = 0; s < batch; ++s) {
    blobs[s].assign(blob->bytes.begin(), blob->bytes.end());
    views.push_back(*CompactLayerView::Parse(blobs[s]));
  }
  blob = absl::InternalError("freed");
  auto outs = Outputs(batch), dense_outs = Outputs(batch);
  std::vector<PackedAttentionItem> items;
  for (int s = 0; s < batch; ++s) items.push_back({&views[s], d.query(s), outs[s].data()});
  const std::string row = exact ? spec_text + " exact" : spec_text;
  state.SetLabel(absl::StrCat(row, ", ", CpuIsaDescription()));
  const PackedAttentionOptions options{.math = exact ? PackedAttentionOptions::Math::kExact
                                                     : PackedAttentionOptions::Math::kAuto};
  double packed_s = 0, dense_s = 0;
  std::vector<double> ratios;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    const absl::Status st = PackedAttentionBatchCpu(items, &Pool(), options);
    const auto t1 = Clock::now();
    if (!st.ok()) return state.SkipWithError(std::string(st.message()).c_str());
    RunDense(d, batch, &dense_outs);
    const auto t2 = Clock::now();
    state.SetIterationTime(Seconds(t0, t1));
    packed_s += Seconds(t0, t1);
    dense_s += Seconds(t1, t2);
    ratios.push_back(Seconds(t1, t2) / Seconds(t0, t1));
  }
  Report(state, absl::StrCat("BM_DecodePacked/", seq_len, "/", batch, "/", row),
         static_cast<double>(blobs[0].size()) * batch, packed_s, dense_s, d.bytes_per_seq() * batch,
         batch, ratios);
}

void BM_DecodeDense(benchmark::State& state, int seq_len, int batch) {
  const DenseSet& d = GetDense(seq_len);
  auto outs = Outputs(batch);
  state.SetLabel("fp16, same kernels");
  double s = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    RunDense(d, batch, &outs);
    const double dt = Seconds(t0, Clock::now());
    state.SetIterationTime(dt);
    s += dt;
  }
  Report(state, absl::StrCat("BM_DecodeDense/", seq_len, "/", batch), d.bytes_per_seq() * batch, s,
         0, 0, batch);
}

// Per (sequence, KV head): scores[g, S] = Q[g, D] K[S, D]^T, softmax, out[g, D] = P[g, S] V[S, D];
// single-threaded OpenBLAS calls spread over the pool.
void BM_DecodeBlas(benchmark::State& state, int seq_len, int batch) {
  const DenseSet& d = GetDense(seq_len);
  openblas_set_num_threads(1);
  const size_t head = static_cast<size_t>(seq_len) * kHeadDim;
  std::vector<std::vector<float>> k(batch), v(batch);
  for (int s = 0; s < batch; ++s) {
    k[s].resize(head * kKvHeads);
    v[s].resize(head * kKvHeads);
    ToFloat(d.k[s].data(), DType::kF16, k[s].size(), k[s].data());
    ToFloat(d.v[s].data(), DType::kF16, v[s].size(), v[s].data());
  }
  auto outs = Outputs(batch), dense_outs = Outputs(batch);
  std::vector<std::vector<float>> scores(static_cast<size_t>(batch) * kKvHeads,
                                         std::vector<float>(static_cast<size_t>(kGroup) * seq_len));
  const float inv_sqrt_d = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  const auto task = [&](int i) {
    const int s = i / kKvHeads, h = i % kKvHeads;
    const float* q = d.q[s].data() + static_cast<size_t>(h) * kGroup * kHeadDim;
    float* sc = scores[i].data();
    float* o = outs[s].data() + static_cast<size_t>(h) * kGroup * kHeadDim;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kGroup, seq_len, kHeadDim, inv_sqrt_d, q,
                kHeadDim, k[s].data() + h * head, kHeadDim, 0.0f, sc, seq_len);
    // The new token (one dot per query) joins the softmax; its value is added after the GEMM.
    const float* kn = d.k_new[s].data() + static_cast<size_t>(h) * kHeadDim;
    const float* vn = d.v_new[s].data() + static_cast<size_t>(h) * kHeadDim;
    float pn[kGroup], sums[kGroup];
    for (int a = 0; a < kGroup; ++a) {
      float* row = sc + static_cast<size_t>(a) * seq_len;
      float dot = 0;
      for (int c = 0; c < kHeadDim; ++c) dot += q[a * kHeadDim + c] * kn[c];
      dot *= inv_sqrt_d;
      const float m = std::max(simd::Max(row, seq_len), dot);
      pn[a] = std::exp(dot - m);
      sums[a] = simd::ExpShiftSum(row, seq_len, m) + pn[a];
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kGroup, kHeadDim, seq_len, 1.0f, sc,
                seq_len, v[s].data() + h * head, kHeadDim, 0.0f, o, kHeadDim);
    for (int a = 0; a < kGroup; ++a) {
      float* oa = o + a * kHeadDim;
      for (int c = 0; c < kHeadDim; ++c) oa[c] = (oa[c] + pn[a] * vn[c]) / sums[a];
    }
  };
  state.SetLabel("fp32 copy, sgemm");
  double blas_s = 0, dense_s = 0;
  std::vector<double> ratios;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    Pool().ParallelFor(batch * kKvHeads, task);
    const auto t1 = Clock::now();
    RunDense(d, batch, &dense_outs);
    const auto t2 = Clock::now();
    state.SetIterationTime(Seconds(t0, t1));
    blas_s += Seconds(t0, t1);
    dense_s += Seconds(t1, t2);
    ratios.push_back(Seconds(t1, t2) / Seconds(t0, t1));
  }
  // Same math as the dense kernel: a large difference means one of them is wrong.
  double err = 0;
  for (int s = 0; s < batch; ++s) {
    for (size_t i = 0; i < outs[s].size(); ++i) {
      err = std::max(err, static_cast<double>(std::fabs(outs[s][i] - dense_outs[s][i])));
    }
  }
  state.counters["max_abs_diff_vs_dense"] = err;
  Report(state, absl::StrCat("BM_DecodeBlas/", seq_len, "/", batch),
         2.0 * d.bytes_per_seq() * batch, blas_s, dense_s, d.bytes_per_seq() * batch, batch,
         ratios);
}

void BM_DecodeMemcpy(benchmark::State& state, int seq_len, int batch) {
  const DenseSet& d = GetDense(seq_len);
  const size_t n = d.k[0].size() * sizeof(uint16_t);
  std::vector<uint8_t> dst(n, 0);
  state.SetLabel("K and V bytes of every sequence");
  double s = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    for (int i = 0; i < batch; ++i) {
      std::memcpy(dst.data(), d.k[i].data(), n);
      std::memcpy(dst.data(), d.v[i].data(), n);
      benchmark::ClobberMemory();
    }
    const double dt = Seconds(t0, Clock::now());
    state.SetIterationTime(dt);
    s += dt;
  }
  Report(state, absl::StrCat("BM_DecodeMemcpy/", seq_len, "/", batch), d.bytes_per_seq() * batch, s,
         0, 0, batch);
}

// ---- Kernel rows --------------------------------------------------------------------------------

// The integer kernels alone on one head's rows (see the header comment), through the decode's own
// entry points (ScoreKeyCodesInt, AccumulateValueCodesInt) with the kernels capped at `isa`.
void BM_IntKernel(benchmark::State& state, bool keys, int bits, CpuIsa isa) {
  constexpr int kRows = 8192, kCall = 1024, kNq = 4, kKeyN = 64, kValueN = 128, kG = 32;
  cpu::attn::Rows R;
  R.kind = keys ? cpu::attn::Rows::kKeyCodes : cpu::attn::Rows::kValueCodes;
  R.n = keys ? kKeyN : kValueN;
  R.row_bytes = static_cast<size_t>(R.n) * bits / 8;
  R.bits = bits;
  R.group = kG;
  std::vector<uint16_t> h(kRows * R.row_bytes / 2);
  Fill(h.data(), h.size(), 21, 4.0f);  // random bits for the codes
  const std::vector<float> scale = RandomFloats(kRows * kKeyN, 22, 0.1f);
  const std::vector<float> zero = RandomFloats(kRows * kKeyN, 23, 2.0f);
  R.base = reinterpret_cast<const uint8_t*>(h.data());
  R.scale = scale.data();
  R.zero = zero.data();
  const std::vector<float> q = RandomFloats(kNq * kKeyN, 24, 2.0f);
  std::vector<float> p = RandomFloats(static_cast<size_t>(kNq) * kRows, 25, 1.0f);
  for (float& x : p) x = std::fabs(x) + 0.01f;
  std::vector<float> s(static_cast<size_t>(kNq) * kRows), acc(kNq * kValueN);
  const CpuIsa previous = SetCpuIsaCap(isa);
  for (auto _ : state) {
    for (int j0 = 0; j0 < kRows; j0 += kCall) {
      if (keys) {
        cpu::attn::ScoreKeyCodesInt(R, j0, j0 + kCall, q.data(), kNq, s.data() + j0, kRows);
      } else {
        cpu::attn::AccumulateValueCodesInt(R, j0, j0 + kCall, p.data() + j0, kRows, kNq,
                                           acc.data());
      }
    }
    benchmark::DoNotOptimize(s.data());
    benchmark::DoNotOptimize(acc.data());
  }
  SetCpuIsaCap(previous);
  state.counters["ns_per_row"] = benchmark::Counter(
      static_cast<double>(kRows) * state.iterations(),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
  state.SetLabel(std::string(CpuIsaName(isa)));
}

void RegisterKernelRows() {
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512Vnni}) {
    if (!CpuIsaAtLeast(isa)) continue;
    for (bool keys : {true, false}) {
      for (int bits : {4, 2}) {
        benchmark::RegisterBenchmark(absl::StrCat("BM_IntKernel/", keys ? "keys" : "values", "/",
                                                  bits, "/", std::string(CpuIsaName(isa)))
                                         .c_str(),
                                     BM_IntKernel, keys, bits, isa)
            ->Unit(benchmark::kMicrosecond);
      }
    }
  }
}

void RegisterAttentionRows() {
  for (int seq_len : {4096, 32768}) {
    for (int batch : {1, 8}) {
      const std::string suffix = absl::StrCat("/", seq_len, "/", batch);
      // Fixed counts (~0.3-2 s of decoding per row) so that every row gets several back-to-back
      // pairs and the whole run stays within a few minutes. At least 10: with 3, the 32K x 8
      // rows' ratios moved by +-5% from run to run on a shared machine.
      const int iterations = std::max(10, (4096 * 40) / (seq_len * batch));
      const auto tune = [iterations](benchmark::internal::Benchmark* b) {
        b->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(iterations);
      };
      tune(benchmark::RegisterBenchmark(("BM_DecodeMemcpy" + suffix).c_str(), BM_DecodeMemcpy,
                                        seq_len, batch));
      tune(benchmark::RegisterBenchmark(("BM_DecodeDense" + suffix).c_str(), BM_DecodeDense,
                                        seq_len, batch));
      tune(benchmark::RegisterBenchmark(("BM_DecodeBlas" + suffix).c_str(), BM_DecodeBlas, seq_len,
                                        batch));
      for (int i = 0; i < static_cast<int>(std::size(kSpecs)); ++i) {
        tune(benchmark::RegisterBenchmark(
            absl::StrCat("BM_DecodePacked", suffix, "/", kSpecs[i]).c_str(), BM_DecodePacked,
            seq_len, batch, i, false));
        // Quantized specs also in fp32 (kExact): the integer path's gain in this run.
        if (std::string(kSpecs[i]).find("+q") != std::string::npos) {
          tune(benchmark::RegisterBenchmark(
              absl::StrCat("BM_DecodePacked", suffix, "/", kSpecs[i], "/exact").c_str(),
              BM_DecodePacked, seq_len, batch, i, true));
        }
      }
    }
  }
}

// ---- Model rows ---------------------------------------------------------------------------------

// The fidelity table's configurations (docs/fidelity.md, kvcfidelity), so speed and quality line
// up.
const char* const kModelSpecs[] = {
    "full",
    "keyformer:0.5",
    "keyformer:0.25",
    "snapkv:0.5+think:0.5",
    "q4g8",
    "q2g8",
    "keyformer:0.25+think:0.5+q4g8",
};

struct ModelRig {
  std::unique_ptr<model::Transformer> model;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<fidelity::FidelityEval> eval;
};

ModelRig* g_model = nullptr;

absl::Status LoadModel(const std::string& path) {
  auto rig = std::make_unique<ModelRig>();
  absl::StatusOr<model::Transformer> m = model::Transformer::Load(path);
  if (!m.ok()) return m.status();
  rig->model = std::make_unique<model::Transformer>(*std::move(m));
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCpuBackend({});
  if (!b.ok()) return b.status();
  rig->backend = *std::move(b);
  fidelity::RunOptions o;
  o.num_sequences = 4;
  o.prefix_len = 256;  // as kvcfidelity's defaults
  o.continuation = 64;
  absl::StatusOr<std::unique_ptr<fidelity::FidelityEval>> e =
      fidelity::FidelityEval::Create(rig->model.get(), o, nullptr);
  if (!e.ok()) return e.status();
  rig->eval = *std::move(e);
  g_model = rig.release();
  return absl::OkStatus();
}

// Teacher-forced decoding of every sequence's continuation; returns seconds spent in DecodeStep.
absl::StatusOr<double> DecodeAll(const std::vector<std::unique_ptr<model::KvCache>>& caches) {
  const fidelity::RunOptions& o = g_model->eval->options();
  std::vector<float> logits(g_model->model->config().vocab_size);
  double seconds = 0;
  for (int i = 0; i < o.num_sequences; ++i) {
    const std::vector<int32_t>& seq = g_model->eval->sequences()[i];
    const auto t0 = Clock::now();
    for (int t = 0; t < o.continuation; ++t) {
      absl::Status st = g_model->model->DecodeStep(seq[o.prefix_len + t], caches[i].get(),
                                                   absl::MakeSpan(logits));
      if (!st.ok()) return st;
    }
    seconds += Seconds(t0, Clock::now());
  }
  return seconds;
}

// Per iteration, alternating: the spec's compact cache, the compact cache that keeps everything
// (same attention kernels: the fair baseline), and kvc::model's full fp32 cache.
void BM_ModelDecode(benchmark::State& state, const std::string& spec_text) {
  const fidelity::RunOptions& o = g_model->eval->options();
  const model::LlamaConfig& c = g_model->model->config();
  const fidelity::Compressor compress = fidelity::InProcessCompressor(g_model->backend.get());
  std::vector<std::vector<CompactLayer>> layers, whole;
  double compact_bytes = 0, whole_bytes = 0;
  for (const bool everything : {false, true}) {
    absl::StatusOr<CompressionSpec> spec = ParseSpecString(everything ? "full" : spec_text);
    if (!spec.ok()) return state.SkipWithError(std::string(spec.status().message()).c_str());
    for (int i = 0; i < o.num_sequences; ++i) {
      absl::StatusOr<std::vector<CompactLayer>> l = compress(g_model->eval->prefix(i), *spec, i);
      if (!l.ok()) return state.SkipWithError(std::string(l.status().message()).c_str());
      for (const CompactLayer& b : *l) {
        (everything ? whole_bytes : compact_bytes) += static_cast<double>(b.bytes.size());
      }
      (everything ? whole : layers).push_back(*std::move(l));
    }
  }
  const auto compact_caches = [&](const std::vector<std::vector<CompactLayer>>& blobs)
      -> absl::StatusOr<std::vector<std::unique_ptr<model::KvCache>>> {
    std::vector<std::unique_ptr<model::KvCache>> caches;
    for (int i = 0; i < o.num_sequences; ++i) {
      auto cc = model::CompactKvCache::Create(c, blobs[i], nullptr, o.continuation);
      if (!cc.ok()) return cc.status();
      caches.push_back(*std::move(cc));
    }
    return caches;
  };
  double spec_s = 0, whole_s = 0, full_s = 0;
  for (auto _ : state) {
    auto a = compact_caches(layers);
    auto b = compact_caches(whole);
    if (!a.ok() || !b.ok()) return state.SkipWithError("compact cache creation failed");
    std::vector<std::unique_ptr<model::KvCache>> full;
    for (int i = 0; i < o.num_sequences; ++i) {
      auto fc = model::FullKvCache::FromPrefix(c, *g_model->eval->prefix(i).layers, o.prefix_len,
                                               o.prefix_len, o.prefix_len + o.continuation);
      if (!fc.ok()) return state.SkipWithError(std::string(fc.status().message()).c_str());
      full.push_back(*std::move(fc));
    }
    absl::StatusOr<double> ta = DecodeAll(*a);
    absl::StatusOr<double> tb = DecodeAll(*b);
    absl::StatusOr<double> tf = DecodeAll(full);
    if (!ta.ok() || !tb.ok() || !tf.ok()) return state.SkipWithError("decode failed");
    state.SetIterationTime(*ta);
    spec_s += *ta;
    whole_s += *tb;
    full_s += *tf;
  }
  const double tokens = static_cast<double>(o.num_sequences) * o.continuation * state.iterations();
  state.counters["tokens_per_s"] = tokens / spec_s;
  state.counters["packed_full_tokens_per_s"] = tokens / whole_s;
  state.counters["model_full_tokens_per_s"] = tokens / full_s;
  state.counters["speedup"] = whole_s / spec_s;
  state.counters["speedup_vs_model_full"] = full_s / spec_s;
  state.counters["byte_ratio"] = whole_bytes / compact_bytes;
  state.SetLabel(absl::StrCat(spec_text, " (", o.num_sequences, " sequences, P ", o.prefix_len,
                              ", C ", o.continuation, ")"));
  Results()["BM_ModelDecode/" + spec_text] =
      RowResult{0, whole_s / spec_s, whole_bytes / compact_bytes};
}

void PrintSummary() {
  std::printf("\nSummary (ratios within this run; instruction set %s):\n",
              CpuIsaDescription().c_str());
  std::printf("%-58s %8s %8s %10s %12s %10s\n", "row", "GB/s", "speedup", "byte_ratio",
              "speedup/bytes", "of_memcpy");
  for (const auto& [name, r] : Results()) {
    const size_t a = name.find('/');
    const size_t b = name.find('/', name.find('/', a + 1) + 1);
    double memcpy_gbps = 0;
    if (a != std::string::npos) {
      const auto it = Results().find("BM_DecodeMemcpy" + name.substr(a, b - a));
      if (it != Results().end()) memcpy_gbps = it->second.gbps;
    }
    const bool model = name.rfind("BM_ModelDecode", 0) == 0;
    std::printf(
        "%-58s %8s %8.2f %10.2f %12s %10s\n", name.c_str(),
        model ? "-" : absl::StrFormat("%.2f", r.gbps).c_str(), r.speedup, r.byte_ratio,
        r.byte_ratio > 0 ? absl::StrFormat("%.2f", r.speedup / r.byte_ratio).c_str() : "-",
        memcpy_gbps > 0 && !model ? absl::StrFormat("%.2f", r.gbps / memcpy_gbps).c_str() : "-");
  }
}

}  // namespace
}  // namespace kvc

int main(int argc, char** argv) {
  std::string model_path;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--model=", 8) == 0) {
      model_path = argv[i] + 8;
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  kvc::RegisterAttentionRows();
  kvc::RegisterKernelRows();
  if (model_path.empty()) {
    std::fprintf(stderr, "decode_bench: no --model=PATH given; the model rows are skipped\n");
  } else if (absl::Status st = kvc::LoadModel(model_path); !st.ok()) {
    std::fprintf(stderr, "decode_bench: model rows skipped: %s\n",
                 std::string(st.message()).c_str());
  } else {
    for (const char* spec : kvc::kModelSpecs) {
      benchmark::RegisterBenchmark(absl::StrCat("BM_ModelDecode/", spec).c_str(),
                                   kvc::BM_ModelDecode, std::string(spec))
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("decode_bench: instruction set %s (CPU features: %s; cap with KVC_CPU_ISA)\n",
              kvc::CpuIsaDescription().c_str(), kvc::CpuFeatureList().c_str());
  benchmark::RunSpecifiedBenchmarks();
  kvc::PrintSummary();
  benchmark::Shutdown();
  return 0;
}

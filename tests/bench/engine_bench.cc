// CPU engine throughput on a Llama-3-8B-shaped layer (8 KV heads, 32 query heads, head_dim 128,
// fp16 (the scoring rows also bf16, the path bf16 layers take), W = 32) at 4K and 32K tokens, next to the machine's memcpy bandwidth and sgemm rate
// measured in the same run.
//
// BM_ScoreVsSgemm times scoring and sgemm 2048^2 back to back in one loop (vs_sgemm: their
// median FLOP/s ratio); the instruction set in use (kvc/cpu_isa.h, capped by KVC_CPU_ISA) is in
// its label. BM_ChunkLogits does the same for the scoring GEMM's chunks alone (sgemm's path and
// the fp32 kernels', AVX2 or AVX-512).
//
// Counters: bytes_per_second is the layer's input (K + V, plus Q_obs for stages that read it);
// FLOPS counts 2*M*N*K of the GEMMs; pack reports out_bytes_per_second too (bytes of the packed
// blob), which is what a gather actually copies; compare it with BM_Memcpy's bytes_per_second.
// Run e.g.:
//   engine_bench --benchmark_min_time=0.3 [--pool_mib=512]
#include <cblas.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <map>
#include <memory>
#include <thread>
#include <vector>

#include "../../kernels/core/quantize.h"
#include "../../kernels/cpu/amx_logits.h"
#include "../../kernels/cpu/engine.h"
#include "../../kernels/cpu/f32_logits.h"
#include "../../kernels/cpu/int8_logits.h"
#include "../../kernels/cpu/pack.h"
#include "../../kernels/cpu/simd.h"
#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "kvc/backend.h"
#include "kvc/buffer_pool.h"
#include "kvc/compact.h"
#include "kvc/contiguous_export.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"
#include "kvc/selection.h"
#include "kvc/stream_copy.h"
#include "kvc/thread_pool.h"

namespace kvc {
namespace {

constexpr int kKvHeads = 8, kQHeads = 32, kHeadDim = 128, kWindow = 32;

int HardwareThreads() { return std::max(1u, std::thread::hardware_concurrency()); }

struct Layer {
  LayerShape shape;
  DType dtype = DType::kF16;  // kF16 or kBF16
  std::vector<uint16_t> k, v, q;
  LayerInput input() const {
    LayerInput in;
    in.shape = shape;
    in.dtype = dtype;
    in.layout = Layout::kHND;
    in.k = k.data();
    in.v = v.data();
    in.q_obs = q.data();
    return in;
  }
  double kv_bytes() const { return 2.0 * k.size() * sizeof(uint16_t); }
  double q_bytes() const { return static_cast<double>(q.size()) * sizeof(uint16_t); }
};

void Fill(std::vector<uint16_t>& v, uint64_t seed, float scale, DType t) {
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (uint16_t& e : v) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float u = static_cast<float>((x >> 40) & 0xffffff) / 16777216.0f - 0.5f;
    e = t == DType::kBF16 ? FloatToBFloat16(u * scale) : FloatToHalf(u * scale);
  }
}

// Built once per sequence length and dtype (fp16, or bf16: the same values rounded to bf16) and
// shared by every benchmark.
const Layer& GetLayer(int seq_len, DType dtype = DType::kF16) {
  static std::map<std::pair<int, DType>, std::unique_ptr<Layer>> layers;
  auto& slot = layers[{seq_len, dtype}];
  if (!slot) {
    slot = std::make_unique<Layer>();
    slot->dtype = dtype;
    slot->shape = {kKvHeads, kQHeads, seq_len, kHeadDim, kWindow};
    const size_t kv = static_cast<size_t>(kKvHeads) * seq_len * kHeadDim;
    slot->k.resize(kv);
    slot->v.resize(kv);
    slot->q.resize(static_cast<size_t>(kQHeads) * kWindow * kHeadDim);
    Fill(slot->k, 1, 4.0f, dtype);
    Fill(slot->v, 2, 2.0f, dtype);
    Fill(slot->q, 3, 4.0f, dtype);
  }
  return *slot;
}

CompressionSpec PipelineSpec() {
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kKeyformer;
  s.eviction.keep_ratio = 0.25;
  s.channels.key_policy = ChannelPolicy::kThink;
  s.channels.key_lambda = 0.5;
  return s;
}

double ScoreFlops(const LayerShape& s) {
  return 2.0 * s.num_q_heads * s.obs_window * static_cast<double>(s.seq_len) * s.head_dim;
}

// --- Reference rates -------------------------------------------------------------------------

void BM_Memcpy(benchmark::State& state) {
  const Layer& layer = GetLayer(static_cast<int>(state.range(0)));
  const size_t n = static_cast<size_t>(layer.kv_bytes());
  std::vector<uint8_t> src(n, 1), dst(n, 0);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), n);
    benchmark::DoNotOptimize(dst.data());
    benchmark::ClobberMemory();
  }
  state.counters["bytes_per_second"] =
      benchmark::Counter(static_cast<double>(n) * state.iterations(), benchmark::Counter::kIsRate);
}

// Turning the keys a DENSE_CONTIGUOUS download sends (kvc/contiguous_export.h): the keys of the
// 32K layer, a quarter of them kept (8 heads x 8,192 x 128, Llama-3's RoPE), fp16 (first arg 0)
// or bf16 (1), turned by -(32768 - 8192) positions in place (second arg 0) or from the layer's
// keys into a buffer of their own, as the export does (1); bytes_per_second counts the keys
// (compare BM_Memcpy's, which counts K and V).
void BM_TurnKeys(benchmark::State& state) {
  const DType dt = state.range(0) != 0 ? DType::kBF16 : DType::kF16;
  const bool apart = state.range(1) != 0;
  const Layer& layer = GetLayer(32768, dt);
  DenseLayer keys;
  keys.num_kv_heads = kKvHeads;
  keys.head_dim = kHeadDim;
  keys.seq_len = layer.shape.seq_len;
  keys.n_kept = layer.shape.seq_len / 4;
  keys.dtype = dt;
  const size_t bytes = static_cast<size_t>(kKvHeads) * keys.n_kept * kHeadDim * sizeof(uint16_t);
  keys.k.resize(bytes);
  std::memcpy(keys.k.data(), layer.k.data(), bytes);
  RopeParams rope;
  rope.theta = 500000;
  rope.half_split = true;
  // The export's case: every fourth token of the layer kept in a blob, whose key runs are turned
  // into a buffer of their own.
  absl::StatusOr<CompactLayer> blob = absl::UnknownError("not packed");
  absl::StatusOr<CompactLayerView> view = absl::UnknownError("not packed");
  DenseRuns runs;
  if (apart) {
    TokenSelection tokens;
    tokens.num_kv_heads = kKvHeads;
    tokens.budget = keys.n_kept;
    for (int h = 0; h < kKvHeads; ++h) {
      for (int t = 0; t < keys.n_kept; ++t) tokens.positions.push_back(4 * t + 3);
    }
    ChannelSelection channels{kHeadDim, kHeadDim, {}, {}};
    for (int h = 0; h < kKvHeads; ++h) {
      for (int c = 0; c < kHeadDim; ++c) {
        channels.key_idx.push_back(c);
        channels.value_idx.push_back(c);
      }
    }
    blob = PackLayer(layer.input(), tokens, channels, CompressionSpec{});
    if (blob.ok()) view = CompactLayerView::Parse(blob->bytes);
    if (!view.ok() || !DenseRunsOf(*view, &runs)) {
      state.SkipWithError("the kept layer did not pack into runs");
      return;
    }
  }
  for (auto _ : state) {
    if (apart) {
      absl::StatusOr<DenseLayer> out = ExportKeysContiguous(*view, runs, rope);
      if (!out.ok()) {
        state.SkipWithError(std::string(out.status().message()).c_str());
        return;
      }
      benchmark::DoNotOptimize(out->k.data());
      benchmark::ClobberMemory();
      continue;
    }
    // Alternate the direction: the keys stay in range however long the run.
    const int shift = (state.iterations() % 2 == 0 ? 1 : -1) * (keys.seq_len - keys.n_kept);
    if (absl::Status s = RotateKeys(rope, shift, &keys); !s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
    benchmark::DoNotOptimize(keys.k.data());
    benchmark::ClobberMemory();
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(bytes) * state.iterations(), benchmark::Counter::kIsRate);
  state.SetLabel(absl::StrCat(std::string(DTypeName(dt)), " keys, ", apart ? "apart" : "in place",
                              ", ", std::string(CpuIsaName(ActiveCpuIsa()))));
}

// The keys a DENSE download of a channel-pruned cache exports (ExportDenseKeys; the values go
// out from the blob): the 32K layer with every token kept and half of each head's key channels
// (ThinK 0.5: a different half per head), fp16; bytes_per_second counts the dense keys written
// (compare BM_Memcpy's, which counts K and V copied).
void BM_ExportDenseKeys(benchmark::State& state) {
  const Layer& layer = GetLayer(32768);
  const int seq = layer.shape.seq_len;
  TokenSelection tokens;
  tokens.num_kv_heads = kKvHeads;
  tokens.budget = seq;
  for (int h = 0; h < kKvHeads; ++h) {
    for (int t = 0; t < seq; ++t) tokens.positions.push_back(t);
  }
  ChannelSelection channels{kHeadDim / 2, kHeadDim, {}, {}};
  for (int h = 0; h < kKvHeads; ++h) {
    for (int c = 0; c < kHeadDim; ++c) {
      if ((c * 7 + h) % 4 < 2) channels.key_idx.push_back(c);  // every chunk mixed
      channels.value_idx.push_back(c);
    }
  }
  CompressionSpec spec;
  spec.recent_tokens = 32;
  absl::StatusOr<CompactLayer> blob = PackLayer(layer.input(), tokens, channels, spec);
  if (!blob.ok()) {
    state.SkipWithError(std::string(blob.status().message()).c_str());
    return;
  }
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob->bytes);
  if (!view.ok()) {
    state.SkipWithError(std::string(view.status().message()).c_str());
    return;
  }
  size_t bytes = 0;
  for (auto _ : state) {
    absl::StatusOr<DenseLayer> keys = ExportDenseKeys(*view);
    if (!keys.ok()) {
      state.SkipWithError(std::string(keys.status().message()).c_str());
      return;
    }
    bytes = keys->k.size();
    benchmark::DoNotOptimize(keys->k.data());
    benchmark::ClobberMemory();
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(bytes) * state.iterations(), benchmark::Counter::kIsRate);
  state.SetLabel(absl::StrCat("fp16 keys, half the channels, ",
                              std::string(CpuIsaName(ActiveCpuIsa()))));
}

// Dequantizing what a DENSE download of a 4-bit cache exports (quant::DequantizeKeysTo and
// DequantizeValuesTo): one 32K-token head's keys (per-channel scales over groups of 32 tokens)
// and values (per-token scales over groups of 32 channels), head_dim 128, random codes, into
// fp16 (arg 0) or bf16 (arg 1); bytes_per_second counts the dequantized bytes written (compare
// BM_Memcpy's, which counts K and V copied).
void BM_DequantizeHead(benchmark::State& state) {
  const DType dt = state.range(0) != 0 ? DType::kBF16 : DType::kF16;
  constexpr int kTokens = 32768, kBits = 4, kGroup = 32;
  const size_t code_bytes = static_cast<size_t>(kTokens) * kHeadDim * kBits / 8;
  std::vector<uint8_t> key_codes(code_bytes), value_codes(code_bytes);
  uint64_t x = 0x9e3779b97f4a7c15ull;
  for (auto* codes : {&key_codes, &value_codes}) {
    for (uint8_t& b : *codes) {
      x = x * 6364136223846793005ull + 1;
      b = static_cast<uint8_t>(x >> 56);
    }
  }
  // Keys: a scale and zero per channel and group of rows; values: per row and group of channels.
  std::vector<float> key_scale(static_cast<size_t>(kTokens / kGroup) * kHeadDim, 0.01f);
  std::vector<float> key_zero(key_scale.size(), -0.07f);
  std::vector<float> value_scale(static_cast<size_t>(kTokens) * (kHeadDim / kGroup), 0.02f);
  std::vector<float> value_zero(value_scale.size(), -0.15f);
  const size_t out_bytes = static_cast<size_t>(kTokens) * kHeadDim * DTypeSize(dt);
  std::vector<uint8_t> keys(out_bytes), values(out_bytes);
  for (auto _ : state) {
    quant::DequantizeKeysTo(key_scale.data(), key_zero.data(), key_codes.data(), kTokens,
                            kHeadDim, kBits, kGroup, dt, keys.data());
    quant::DequantizeValuesTo(value_scale.data(), value_zero.data(), value_codes.data(),
                              kTokens, kHeadDim, kBits, kGroup, dt, values.data());
    benchmark::DoNotOptimize(keys.data());
    benchmark::DoNotOptimize(values.data());
    benchmark::ClobberMemory();
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      2.0 * static_cast<double>(out_bytes) * state.iterations(), benchmark::Counter::kIsRate);
  state.SetLabel(absl::StrCat(std::string(DTypeName(dt)), ", 4-bit, ",
                              std::string(CpuIsaName(ActiveCpuIsa()))));
}

// Packing keys for the AMX / AVX-512 BF16 logits (cpu/amx_logits.h): every 1024-key chunk of one
// head of the 32K layer (HND), fp16 keys into bf16 hi and lo parts (arg 0) or bf16 keys as their
// own hi part (arg 1); bytes_per_second counts the keys read (compare BM_Memcpy's).
void BM_PackKeys(benchmark::State& state) {
  const bool bf16 = state.range(0) != 0;
  const Layer& layer = GetLayer(32768, bf16 ? DType::kBF16 : DType::kF16);
  if (!cpu::amx::DotUsable(kHeadDim)) {
    state.SkipWithError(absl::StrCat("no AVX-512 BF16 at this level: ", CpuIsaDescription())
                            .c_str());
    return;
  }
  constexpr int kChunk = 1024;
  const size_t elems = cpu::amx::PackedKeyElems(kChunk, kHeadDim);
  std::vector<uint16_t> hi(elems), lo(elems);
  const int seq = layer.shape.seq_len;
  for (auto _ : state) {
    for (int c0 = 0; c0 < seq; c0 += kChunk) {
      cpu::amx::PackKeys(layer.k.data() + static_cast<size_t>(c0) * kHeadDim, layer.dtype,
                         kHeadDim, kChunk, kHeadDim, hi.data(), bf16 ? nullptr : lo.data());
    }
    benchmark::DoNotOptimize(hi.data());
    benchmark::DoNotOptimize(lo.data());
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(seq) * kHeadDim * sizeof(uint16_t) * state.iterations(),
      benchmark::Counter::kIsRate);
  state.SetLabel(bf16 ? "bf16 keys, hi only" : "fp16 keys, hi + lo");
}

// How kvcd places a received layer (kvc/stream_copy.h): 64 KiB pieces (gRPC's slices) from a
// 4 MiB ring that stays in cache into a 128 MiB destination (a 32K-token Llama-3-8B K or V
// tensor), with memcpy (arg 0) or StreamCopy's non-temporal stores (arg 1).
void BM_ReceiveCopy(benchmark::State& state) {
  constexpr size_t kPiece = size_t{64} << 10, kRing = size_t{4} << 20, kDst = size_t{128} << 20;
  const bool stream = state.range(0) != 0;
  std::vector<uint8_t> ring(kRing, 3);
  BufferPool pool(0);
  BufferPool::Buffer dst = pool.Acquire(kDst);
  std::memset(dst.get(), 0, kDst);  // mapped before timing
  for (auto _ : state) {
    for (size_t at = 0; at < kDst; at += kPiece) {
      const uint8_t* src = ring.data() + at % kRing;
      if (stream) {
        StreamCopy(dst.get() + at, src, kPiece);
      } else {
        std::memcpy(dst.get() + at, src, kPiece);
      }
    }
    benchmark::DoNotOptimize(dst.get());
    benchmark::ClobberMemory();
  }
  state.SetLabel(stream ? "StreamCopy" : "memcpy");
  state.counters["bytes_per_second"] = benchmark::Counter(
      static_cast<double>(kDst) * state.iterations(), benchmark::Counter::kIsRate);
}

// C[M, N] = A[M, K] * B[N, K]^T with OpenBLAS using `threads` threads.
void RunSgemm(benchmark::State& state, int M, int N, int K, int threads) {
  openblas_set_num_threads(threads);
  std::vector<float> a(static_cast<size_t>(M) * K, 0.5f), b(static_cast<size_t>(N) * K, 0.25f);
  std::vector<float> c(static_cast<size_t>(M) * N);
  for (auto _ : state) {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, N, K, 1.0f, a.data(), K, b.data(), K,
                0.0f, c.data(), N);
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["FLOPS"] =
      benchmark::Counter(2.0 * M * N * K * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["blas_threads"] = threads;
}

// The scoring GEMM of one layer: per KV head [g*W, D] x [D, S], all heads, OpenBLAS threaded.
void BM_SgemmScoreShape(benchmark::State& state) {
  const int S = static_cast<int>(state.range(0));
  const int threads = state.range(1) ? HardwareThreads() : 1;
  openblas_set_num_threads(threads);
  const int M = (kQHeads / kKvHeads) * kWindow;
  std::vector<float> a(static_cast<size_t>(M) * kHeadDim, 0.5f);
  std::vector<float> b(static_cast<size_t>(S) * kHeadDim, 0.25f), c(static_cast<size_t>(M) * S);
  for (auto _ : state) {
    for (int h = 0; h < kKvHeads; ++h) {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, S, kHeadDim, 1.0f, a.data(), kHeadDim,
                  b.data(), kHeadDim, 0.0f, c.data(), S);
    }
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["FLOPS"] = benchmark::Counter(
      2.0 * M * S * kHeadDim * kKvHeads * state.iterations(), benchmark::Counter::kIsRate);
  state.counters["blas_threads"] = threads;
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The median of v (the mean of the middle two for an even count; 0 when empty).
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t k = v.size();
  return k == 0 ? 0 : (k % 2 == 1 ? v[k / 2] : 0.5 * (v[k / 2 - 1] + v[k / 2]));
}

// The baseline the *VsSgemm rows time in their own loop: sgemm 2048^2 (OpenBLAS, with the
// threads it is set to).
struct SquareSgemm {
  static constexpr int kN = 2048;
  std::vector<float> a = std::vector<float>(static_cast<size_t>(kN) * kN, 0.5f);
  std::vector<float> b = std::vector<float>(a.size(), 0.25f);
  std::vector<float> c = std::vector<float>(a.size());
  static constexpr double kFlops = 2.0 * kN * kN * kN;
  void Run() {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, kN, kN, kN, 1.0f, a.data(), kN, b.data(),
                kN, 0.0f, c.data(), kN);
    benchmark::DoNotOptimize(c.data());
  }
};

// The scoring GEMM's chunks alone, one thread, CPU time: the 32K fp16 layer's keys, each KV
// head's against the same 128 observation rows in 1,024-key chunks, (arg 0) as the sgemm path
// computes them (each chunk converted to fp32, then cblas_sgemm 128 x 1024 x 128) or (arg 1) as
// cpu/f32_logits.h does at the active level (each chunk packed, then its kernel), or (arg 2) as
// cpu/int8_logits.h does (ScoringMath::kInteger: queries and each chunk's keys rounded to
// integers, then the AVX2 or AVX-512 VNNI kernel), with sgemm 2048^2 in the same loop: vs_sgemm
// is the median of their FLOP/s ratios (the share of sgemm's own speed each reaches on this
// shape).
void BM_ChunkLogits(benchmark::State& state) {
  const bool f32_path = state.range(0) == 1, int8_path = state.range(0) == 2;
  if ((f32_path && !cpu::f32::Usable(kHeadDim)) || (int8_path && !cpu::i8::Usable(kHeadDim))) {
    state.SkipWithError(absl::StrCat("no AVX2 at this level: ", CpuIsaDescription()).c_str());
    return;
  }
  const cpu::i8::Kernel i8_kernel = cpu::i8::ActiveKernel();
  const Layer& layer = GetLayer(32768);
  const int S = layer.shape.seq_len, rows = (kQHeads / kKvHeads) * kWindow;
  constexpr int kChunk = 1024;
  std::vector<float> q(static_cast<size_t>(rows) * kHeadDim), qp(q.size());
  ToFloat(layer.q.data(), layer.dtype, q.size(), q.data());
  std::vector<float> k(cpu::f32::PackedKeyElems(kChunk, kHeadDim));
  std::vector<uint8_t> q8(q.size());
  std::vector<float> q8_scales(rows), k8_scales(cpu::i8::PaddedKeys(kChunk));
  std::vector<int8_t> k8(cpu::i8::PaddedKeys(kChunk) * kHeadDim);
  std::vector<int32_t> k8_offsets(k8_scales.size());
  std::vector<float> logits(static_cast<size_t>(rows) * S);
  SquareSgemm square;
  const float scale = 1.0f / std::sqrt(static_cast<float>(kHeadDim));
  openblas_set_num_threads(1);
  std::vector<double> ratios;
  for (auto _ : state) {
    const double t0 = ThreadCpuSeconds();
    square.Run();
    const double t1 = ThreadCpuSeconds();
    if (f32_path) cpu::f32::PackQueries(q.data(), rows, kHeadDim, qp.data());
    if (int8_path) {
      cpu::i8::PackQueries(i8_kernel, q.data(), rows, kHeadDim, scale, q8.data(),
                           q8_scales.data());
    }
    for (int h = 0; h < kKvHeads; ++h) {  // the same rows against each head's keys
      for (int c0 = 0; c0 < S; c0 += kChunk) {
        const uint16_t* keys = layer.k.data() + (static_cast<size_t>(h) * S + c0) * kHeadDim;
        float* dst = logits.data() + static_cast<size_t>(c0) * rows;
        if (f32_path) {
          cpu::f32::PackKeys(keys, layer.dtype, kHeadDim, kChunk, kHeadDim, k.data());
          cpu::f32::Logits(qp.data(), rows, k.data(), kChunk, kHeadDim, scale, dst, kChunk);
        } else if (int8_path) {
          cpu::i8::PackKeys(i8_kernel, keys, layer.dtype, kHeadDim, kChunk, kHeadDim, k8.data(),
                            k8_scales.data(), k8_offsets.data());
          cpu::i8::Logits(i8_kernel, q8.data(), q8_scales.data(), rows, k8.data(),
                          k8_scales.data(), k8_offsets.data(), kChunk, kHeadDim, dst, kChunk);
        } else {
          ToFloat(keys, layer.dtype, static_cast<size_t>(kChunk) * kHeadDim, k.data());
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, kChunk, kHeadDim, scale,
                      q.data(), kHeadDim, k.data(), kHeadDim, 0.0f, dst, kChunk);
        }
      }
    }
    const double t2 = ThreadCpuSeconds();
    benchmark::DoNotOptimize(logits.data());
    ratios.push_back((2.0 * rows * S * kHeadDim * kKvHeads / (t2 - t1)) /
                     (SquareSgemm::kFlops / (t1 - t0)));
  }
  state.counters["vs_sgemm"] = Median(ratios);
  state.SetLabel(absl::StrCat(f32_path    ? "f32 pack + kernel"
                              : int8_path ? absl::StrCat("int8 pack + ",
                                                         cpu::i8::KernelName(i8_kernel), " kernel")
                                          : "fp32 copy + sgemm",
                              ", fp16 keys, 1 thread, CPU time, ", CpuIsaDescription()));
}

// Keyformer's softmax numerator with its Gumbel noise (simd::GumbelExpSum: the counter hash, the
// table logarithm, exp and a division per logit) against the same pass without noise
// (simd::ExpShiftSum, snapkv's and h2o's), both over one head's 32 observation rows of 32K logits
// in the same loop; vs_exp is the plain pass's time over the noisy one's.
void BM_NoiseExpSum(benchmark::State& state) {
  constexpr int kRows = 32, kCols = 32768;
  std::vector<float> logits(static_cast<size_t>(kRows) * kCols), work(logits.size());
  uint64_t x = 12345;
  for (float& v : logits) {  // spread over [-30, 0], as a row's logits minus its max
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = -30.0f * static_cast<float>(x >> 40) / 16777216.0f;
  }
  std::vector<double> ratios;
  double noisy_s = 0;
  for (auto _ : state) {
    work = logits;
    const double t0 = ThreadCpuSeconds();
    float sum = 0;
    for (int r = 0; r < kRows; ++r) {
      sum += simd::ExpShiftSum(&work[size_t{1} * r * kCols], kCols, 0.0f);
    }
    const double t1 = ThreadCpuSeconds();
    work = logits;
    const double t2 = ThreadCpuSeconds();
    for (int r = 0; r < kRows; ++r) {
      sum += simd::GumbelExpSum(&work[size_t{1} * r * kCols], kCols, 0.0f, 7, 3, 5, r, 0);
    }
    const double t3 = ThreadCpuSeconds();
    benchmark::DoNotOptimize(sum);
    noisy_s += t3 - t2;
    ratios.push_back((t1 - t0) / (t3 - t2));
  }
  state.counters["vs_exp"] = Median(ratios);
  state.counters["ns_per_logit"] =
      1e9 * noisy_s / (static_cast<double>(state.iterations()) * kRows * kCols);
  state.SetLabel(absl::StrCat("1 thread, CPU time, ", CpuIsaDescription()));
}

void BM_SgemmSquare(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  RunSgemm(state, n, n, n, HardwareThreads());
}

// --- Stages ----------------------------------------------------------------------------------

void BM_Score(benchmark::State& state) {
  const Layer& layer = GetLayer(static_cast<int>(state.range(0)));
  EvictionSpec spec;
  spec.policy = static_cast<EvictionPolicy>(state.range(1));
  state.SetLabel(std::string(PolicyName(spec.policy)));
  for (auto _ : state) {
    absl::StatusOr<std::vector<float>> s = ScoreTokens(layer.input(), spec);
    if (!s.ok()) state.SkipWithError(std::string(s.status().message()).c_str());
    benchmark::DoNotOptimize(s);
  }
  const double it = static_cast<double>(state.iterations());
  state.counters["bytes_per_second"] =
      benchmark::Counter((layer.kv_bytes() + layer.q_bytes()) * it, benchmark::Counter::kIsRate);
  if (spec.policy != EvictionPolicy::kKNorm) {
    state.counters["FLOPS"] =
        benchmark::Counter(ScoreFlops(layer.shape) * it, benchmark::Counter::kIsRate);
  }
}

// kvzip at S tokens with reconstruction rows as kvc.recon sends them (one pass per 2,048-token
// chunk: its 9 or 21 instruction rows and its chunk's; W = S + those), every row over all S keys
// (range(1) = 0) against each pass's rows over the 4 sinks and their chunk (1), the same layer
// and rows: `vs_whole` is the second's speed-up, measured back to back in each iteration (the
// whole-context time from the same iteration). Both compute one softmax per row; the logits are
// rows * S against rows * (2048 + 4). `top16_cost`: the passes again with top=16 (a token's score
// the mean of its 16 largest probabilities), over the passes' time with the maximum.
void BM_KVzipPasses(benchmark::State& state) {
  const int S = static_cast<int>(state.range(0));
  static std::map<int, std::unique_ptr<Layer>> layers;
  auto& slot = layers[S];
  std::vector<int> rows;
  int W = 0;
  for (int lo = 0; lo < S; lo += kDefaultPassTokens) {
    rows.push_back(std::min(kDefaultPassTokens, S - lo) + (lo == 0 ? 9 : 21));
    W += rows.back();
  }
  if (!slot) {
    slot = std::make_unique<Layer>();
    const Layer& base = GetLayer(S);
    slot->shape = {kKvHeads, kQHeads, S, kHeadDim, W};
    slot->k = base.k;
    slot->v = base.v;
    slot->q.resize(static_cast<size_t>(kQHeads) * W * kHeadDim);
    Fill(slot->q, 4, 4.0f, DType::kF16);
  }
  EvictionSpec whole;
  whole.policy = EvictionPolicy::kKVzip;
  EvictionSpec passes = whole;
  passes.pass_rows = rows;
  EvictionSpec top16 = passes;  // the mean of the 16 largest probabilities (top=16)
  top16.top_rows = 16;
  std::vector<double> ratios, top_cost;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<float>> a = ScoreTokens(slot->input(), whole);
    const auto t1 = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<float>> b = ScoreTokens(slot->input(), passes);
    const auto t2 = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<float>> c = ScoreTokens(slot->input(), top16);
    const auto t3 = std::chrono::steady_clock::now();
    if (!a.ok() || !b.ok() || !c.ok()) state.SkipWithError("kvzip scoring failed");
    benchmark::DoNotOptimize(a);
    benchmark::DoNotOptimize(b);
    benchmark::DoNotOptimize(c);
    const double passes_s = std::chrono::duration<double>(t2 - t1).count();
    ratios.push_back(std::chrono::duration<double>(t1 - t0).count() / passes_s);
    top_cost.push_back(std::chrono::duration<double>(t3 - t2).count() / passes_s);
    state.SetIterationTime(passes_s);
  }
  std::sort(ratios.begin(), ratios.end());
  std::sort(top_cost.begin(), top_cost.end());
  state.counters["vs_whole"] = ratios.empty() ? 0 : ratios[ratios.size() / 2];
  // The time of the same passes with top=16 over the time with the maximum (1: no cost).
  state.counters["top16_cost"] = top_cost.empty() ? 0 : top_cost[top_cost.size() / 2];
  state.counters["passes"] = static_cast<double>(rows.size());
  state.SetLabel(absl::StrCat("kvzip, W=", W, ", time of the passes; ", CpuIsaDescription()));
}

// Scoring against sgemm measured back to back in the same loop: each iteration times one sgemm
// 2048^2 (OpenBLAS, hardware threads, as BM_SgemmSquare) and one ScoreTokens call, and
// `vs_sgemm` is the median over iterations of (score FLOP/s) / (sgemm FLOP/s): a same-moment
// ratio that a burst of load on a shared machine moves less than two separate rows do.
// Label: policy, dtype, the logits path (cpu/engine.h: sgemm, bf16 dot products, AMX) and the
// instruction-set level.
std::string ScoreLabel(const Layer& layer, const EvictionSpec& spec, std::string_view extra,
                       ScoringMath math = ScoringMath::kExact) {
  const cpu::LogitsPath path = cpu::ScoringLogitsPath(layer.dtype, layer.shape.head_dim, math);
  return absl::StrCat(std::string(PolicyName(spec.policy)), ", ",
                      std::string(DTypeName(layer.dtype)), ", ",
                      std::string(cpu::LogitsPathName(path)), std::string(extra), ", ",
                      CpuIsaDescription());
}

// range(2): 0 fp16 layers, 1 bf16.
DType BenchDType(const benchmark::State& state) {
  return state.range(2) == 1 ? DType::kBF16 : DType::kF16;
}

void BM_ScoreVsSgemm(benchmark::State& state) {
  const Layer& layer = GetLayer(static_cast<int>(state.range(0)), BenchDType(state));
  EvictionSpec spec;
  spec.policy = static_cast<EvictionPolicy>(state.range(1));
  SquareSgemm square;
  std::vector<double> ratios;
  double score_s = 0;
  for (auto _ : state) {
    openblas_set_num_threads(HardwareThreads());
    const auto t0 = std::chrono::steady_clock::now();
    square.Run();
    const auto t1 = std::chrono::steady_clock::now();
    absl::StatusOr<std::vector<float>> s = ScoreTokens(layer.input(), spec);
    const auto t2 = std::chrono::steady_clock::now();
    if (!s.ok()) state.SkipWithError(std::string(s.status().message()).c_str());
    const double ts = std::chrono::duration<double>(t2 - t1).count();
    const double tg = std::chrono::duration<double>(t1 - t0).count();
    score_s += ts;
    ratios.push_back((ScoreFlops(layer.shape) / ts) / (SquareSgemm::kFlops / tg));
  }
  state.counters["vs_sgemm"] = Median(ratios);
  state.counters["FLOPS"] =
      ScoreFlops(layer.shape) * static_cast<double>(state.iterations()) / score_s;
  state.SetLabel(ScoreLabel(layer, spec, ""));
}

// The same ratio on one thread (OpenBLAS and the engine's pool), timed in this thread's CPU time:
// time the scheduler gives other processes on a shared machine counts for neither side, so this
// is the kernels' efficiency ratio, not a wall-clock one. range(3): 1 scores with
// ScoringMath::kInteger (int8 logits where the CPU has AVX-512 VNNI), 0 exact.
void BM_ScoreVsSgemmCpu(benchmark::State& state) {
  const Layer& layer = GetLayer(static_cast<int>(state.range(0)), BenchDType(state));
  const ScoringMath math = state.range(3) == 1 ? ScoringMath::kInteger : ScoringMath::kExact;
  LayerInput input = layer.input();
  input.scoring_math = math;
  EvictionSpec spec;
  spec.policy = static_cast<EvictionPolicy>(state.range(1));
  SquareSgemm square;
  ThreadPool one(1);
  std::vector<float> scores;
  std::vector<double> ratios;
  double score_s = 0;
  for (auto _ : state) {
    openblas_set_num_threads(1);
    const double t0 = ThreadCpuSeconds();
    square.Run();
    const double t1 = ThreadCpuSeconds();
    cpu::ScoreTokensImpl(input, spec, &one, &scores);
    const double t2 = ThreadCpuSeconds();
    benchmark::DoNotOptimize(scores.data());
    score_s += t2 - t1;
    ratios.push_back((ScoreFlops(layer.shape) / (t2 - t1)) / (SquareSgemm::kFlops / (t1 - t0)));
  }
  state.counters["vs_sgemm"] = Median(ratios);
  state.counters["FLOPS_cpu"] =
      ScoreFlops(layer.shape) * static_cast<double>(state.iterations()) / score_s;
  state.SetLabel(ScoreLabel(layer, spec, ", 1 thread, CPU time", math));
}

struct Selections {
  TokenSelection tokens;
  ChannelSelection channels;
};

const Selections& GetSelections(int seq_len) {
  static std::map<int, std::unique_ptr<Selections>> cache;
  auto& slot = cache[seq_len];
  if (!slot) {
    const Layer& layer = GetLayer(seq_len);
    slot = std::make_unique<Selections>();
    slot->tokens = *SelectTokens(layer.input(), PipelineSpec());
    slot->channels = *SelectChannels(layer.input(), slot->tokens, PipelineSpec());
  }
  return *slot;
}

void BM_SelectChannels(benchmark::State& state) {
  const Layer& layer = GetLayer(static_cast<int>(state.range(0)));
  const Selections& sel = GetSelections(layer.shape.seq_len);
  for (auto _ : state) {
    absl::StatusOr<ChannelSelection> c = SelectChannels(layer.input(), sel.tokens, PipelineSpec());
    benchmark::DoNotOptimize(c);
  }
  state.counters["bytes_per_second"] = benchmark::Counter(
      (layer.kv_bytes() + layer.q_bytes()) * state.iterations(), benchmark::Counter::kIsRate);
}

// Packing alone on fixed selections: bits 0 is the gather, bits 4 adds quantization. Arg 2 picks
// the path: 0 = the public PackLayer (serial), 1 = the CPU backend's path (cpu::PackLayerImpl on a
// pool with hardware-concurrency threads, one task per KV head and K/V half).
void BM_Pack(benchmark::State& state) {
  const Layer& layer = GetLayer(static_cast<int>(state.range(0)));
  const Selections& sel = GetSelections(layer.shape.seq_len);
  CompressionSpec spec = PipelineSpec();
  spec.quant.bits = static_cast<int>(state.range(1));
  const bool parallel = state.range(2) != 0;
  std::unique_ptr<ThreadPool> pool;
  if (parallel) pool = std::make_unique<ThreadPool>(0);
  state.SetLabel(parallel ? absl::StrCat("backend pool, ", pool->num_threads(), " threads")
                          : "PackLayer, serial");
  size_t out = 0;
  cpu::PackWork sum;
  for (auto _ : state) {
    cpu::PackWork work;
    absl::StatusOr<CompactLayer> blob =
        parallel
            ? cpu::PackLayerImpl(layer.input(), sel.tokens, sel.channels, spec, pool.get(), &work)
            : PackLayer(layer.input(), sel.tokens, sel.channels, spec);
    if (!blob.ok()) state.SkipWithError(std::string(blob.status().message()).c_str());
    out = blob.ok() ? blob->bytes.size() : 0;
    benchmark::DoNotOptimize(blob);
    sum.task_seconds += work.task_seconds;
    sum.quantize_seconds += work.quantize_seconds;
  }
  const double it = static_cast<double>(state.iterations());
  state.counters["bytes_per_second"] =
      benchmark::Counter(layer.kv_bytes() * it, benchmark::Counter::kIsRate);
  state.counters["out_bytes_per_second"] =
      benchmark::Counter(static_cast<double>(out) * it, benchmark::Counter::kIsRate);
  state.counters["ratio"] = layer.kv_bytes() / std::max<double>(1.0, static_cast<double>(out));
  if (parallel && sum.task_seconds > 0) {
    state.counters["quantize_share"] = sum.quantize_seconds / sum.task_seconds;
  }
}

// The whole pipeline through the backend: keyformer keep 0.25 + think lambda 0.5. Arg 1 picks the
// threading: 1 = engine threads over heads with single-threaded BLAS, 0 = one engine thread with
// OpenBLAS threaded inside each GEMM. Arg 2 is spec.quant.bits (0 = no quantization).
void BM_Pipeline(benchmark::State& state) {
  const Layer& layer = GetLayer(static_cast<int>(state.range(0)));
  const bool engine_threads = state.range(1) != 0;
  openblas_set_num_threads(HardwareThreads());
  auto backend = *CreateCpuBackend({.num_threads = engine_threads ? 0 : 1});
  state.SetLabel(engine_threads ? "engine threads" : "blas threads");
  CompressionSpec spec = PipelineSpec();
  spec.quant.bits = static_cast<int>(state.range(2));
  CompressTimings sum;
  for (auto _ : state) {
    CompressTimings t;
    absl::StatusOr<CompactLayer> blob = backend->Compress(layer.input(), spec, &t);
    if (!blob.ok()) state.SkipWithError(std::string(blob.status().message()).c_str());
    benchmark::DoNotOptimize(blob);
    sum.score += t.score;
    sum.select += t.select;
    sum.pack += t.pack;
    sum.quantize += t.quantize;
    sum.total += t.total;
  }
  const double it = static_cast<double>(state.iterations());
  const double in_bytes = layer.kv_bytes() + layer.q_bytes();
  state.counters["bytes_per_second"] =
      benchmark::Counter(in_bytes * it, benchmark::Counter::kIsRate);
  // Per-stage rates from the backend's own timings (bytes of the layer / stage time).
  state.counters["score_GBps"] = in_bytes * it / sum.score / 1e9;
  state.counters["score_GFLOPS"] = ScoreFlops(layer.shape) * it / sum.score / 1e9;
  state.counters["select_GBps"] = in_bytes * it / sum.select / 1e9;
  state.counters["pack_GBps"] = layer.kv_bytes() * it / sum.pack / 1e9;
  state.counters["pack_ms"] = 1e3 * sum.pack / it;
  state.counters["quantize_ms"] = 1e3 * sum.quantize / it;
}

// Short runs: 32K iterations take ~0.1-1 s each on a small machine.
BENCHMARK(BM_Memcpy)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_TurnKeys)
    ->Args({0, 0})
    ->Args({1, 0})
    ->Args({0, 1})
    ->Args({1, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_ExportDenseKeys)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_DequantizeHead)
    ->Arg(0)
    ->Arg(1)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_ReceiveCopy)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_PackKeys)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_SgemmSquare)->Arg(2048)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_NoiseExpSum)->Iterations(9)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ChunkLogits)->Arg(0)->Arg(1)->Arg(2)->Iterations(9)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SgemmScoreShape)
    ->Args({4096, 1})
    ->Args({32768, 1})
    ->Args({32768, 0})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Score)
    ->Args({4096, static_cast<int>(EvictionPolicy::kH2O)})
    ->Args({4096, static_cast<int>(EvictionPolicy::kKeyformer)})
    ->Args({32768, static_cast<int>(EvictionPolicy::kH2O)})
    ->Args({32768, static_cast<int>(EvictionPolicy::kSnapKV)})
    ->Args({32768, static_cast<int>(EvictionPolicy::kKeyformer)})
    ->Args({32768, static_cast<int>(EvictionPolicy::kKNorm)})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_KVzipPasses)->Arg(8192)->Iterations(3)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ScoreVsSgemm)
    ->Args({4096, static_cast<int>(EvictionPolicy::kKeyformer), 0})
    ->Args({32768, static_cast<int>(EvictionPolicy::kH2O), 0})
    ->Args({32768, static_cast<int>(EvictionPolicy::kKeyformer), 0})
    ->Args({4096, static_cast<int>(EvictionPolicy::kKeyformer), 1})
    ->Args({32768, static_cast<int>(EvictionPolicy::kH2O), 1})
    ->Args({32768, static_cast<int>(EvictionPolicy::kKeyformer), 1})
    ->Iterations(9)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_ScoreVsSgemmCpu)
    ->Args({32768, static_cast<int>(EvictionPolicy::kH2O), 0, 0})
    ->Args({32768, static_cast<int>(EvictionPolicy::kKeyformer), 0, 0})
    ->Args({32768, static_cast<int>(EvictionPolicy::kH2O), 1, 0})
    ->Args({32768, static_cast<int>(EvictionPolicy::kKeyformer), 1, 0})
    ->Args({32768, static_cast<int>(EvictionPolicy::kSnapKV), 0, 0})
    ->Args({32768, static_cast<int>(EvictionPolicy::kSnapKV), 1, 0})
    ->Args({32768, static_cast<int>(EvictionPolicy::kSnapKV), 0, 1})
    ->Args({32768, static_cast<int>(EvictionPolicy::kKeyformer), 0, 1})
    ->Args({32768, static_cast<int>(EvictionPolicy::kSnapKV), 1, 1})
    ->Args({32768, static_cast<int>(EvictionPolicy::kKeyformer), 1, 1})
    ->Iterations(5)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_SelectChannels)->Arg(4096)->Arg(32768)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_Pack)
    ->Args({4096, 0, 0})
    ->Args({4096, 0, 1})
    ->Args({4096, 4, 0})
    ->Args({4096, 4, 1})
    ->Args({32768, 0, 0})
    ->Args({32768, 0, 1})
    ->Args({32768, 4, 0})
    ->Args({32768, 4, 1})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_Pipeline)
    ->Args({4096, 1, 0})
    ->Args({32768, 1, 0})
    ->Args({32768, 0, 0})
    ->Args({32768, 1, 4})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

}  // namespace
}  // namespace kvc

// Outputs come from the buffer pool the way they do in kvcd, which keeps 512 MiB of freed blobs
// by default (--buffer_pool_bytes): --pool_mib=N sets the cap here, 0 makes every pack write
// fresh memory (page faults and kernel zeroing included).
int main(int argc, char** argv) {
  uint64_t pool_mib = 512;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--pool_mib=", 11) == 0) {
      pool_mib = std::strtoull(argv[i] + 11, nullptr, 10);
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  kvc::LargeBuffers().set_cap(pool_mib << 20);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("engine_bench: instruction set %s (CPU features: %s; cap with KVC_CPU_ISA)\n",
              kvc::CpuIsaDescription().c_str(), kvc::CpuFeatureList().c_str());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

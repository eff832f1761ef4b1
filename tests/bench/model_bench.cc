// Speed of kvc's reference transformer (kvc::model) on a real checkpoint, e.g. SmolLM2-135M:
//
//   BM_Prefill/S/mode          Transformer::Forward over S tokens; mode 0: the last position's
//                              logits only, no layer export (a plain prefill); mode 1: every
//                              layer's q/k/v exported, no logits (what kvcfidelity/kvcpasskey
//                              ask for); mode 2: logits of every position.
//   BM_PrefillReference/S      the plain scalar forward pass of tests/fidelity/reference_model.h
//                              (one position at a time, no BLAS: the shape of the code before
//                              Forward used OpenBLAS), the baseline; counter `speedup` is its time
//                              over Forward's (mode 0) on the same S, both measured in this run.
//   BM_DecodeStep/C            tokens/s of DecodeStep on a full cache holding C tokens;
//                              `of_weight_stream` = (time to memcpy the fp32 weights once, measured
//                              here) / (step time): 1.0 would be a step as fast as streaming the
//                              weights from memory.
//
// Run (2 cores, the machine the fidelity tools use):
//   model_bench --model=DIR_OR_FILE [--benchmark_filter=...]
// The model rows are skipped (with a message) without --model.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "benchmark/benchmark.h"
#include "fidelity/reference_model.h"
#include "kvc/model/kv_cache.h"
#include "kvc/model/transformer.h"

namespace kvc {
namespace {

using Clock = std::chrono::steady_clock;

struct Rig {
  std::unique_ptr<model::Checkpoint> ck;  // for the reference
  std::unique_ptr<model::Transformer> model;
  std::string path;
  double weight_bytes = 0;
};
Rig* g_rig = nullptr;

std::vector<int32_t> Tokens(int n) {
  const int vocab = g_rig->model->config().vocab_size;
  std::vector<int32_t> t(n);
  uint64_t x = 12345;
  for (int32_t& v : t) {
    x = x * 6364136223846793005ull + 1442695040888963407ull;
    v = static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab));
  }
  return t;
}

double ForwardSeconds(const std::vector<int32_t>& tokens, const model::ForwardOptions& o) {
  const auto t0 = Clock::now();
  absl::StatusOr<model::ForwardOutput> out = g_rig->model->Forward(tokens, o);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  if (!out.ok()) std::fprintf(stderr, "Forward: %s\n", out.status().ToString().c_str());
  benchmark::DoNotOptimize(out);
  return out.ok() ? s : -1;
}

model::ForwardOptions Mode(int mode) {
  model::ForwardOptions o;
  o.last_logits = mode == 2 ? -1 : (mode == 1 ? 0 : 1);
  o.keep_layers = mode == 1;
  return o;
}

void BM_Prefill(benchmark::State& state) {
  const int s = static_cast<int>(state.range(0)), mode = static_cast<int>(state.range(1));
  const std::vector<int32_t> tokens = Tokens(s);
  for (auto _ : state) {
    const double sec = ForwardSeconds(tokens, Mode(mode));
    if (sec < 0) return state.SkipWithError("Forward failed");
    state.SetIterationTime(sec);
  }
  state.counters["tokens_per_s"] =
      benchmark::Counter(static_cast<double>(s) * state.iterations(), benchmark::Counter::kIsRate);
  state.SetLabel(mode == 0 ? "last logits" : mode == 1 ? "layers kept, no logits" : "all logits");
}

void BM_PrefillReference(benchmark::State& state) {
  const int s = static_cast<int>(state.range(0));
  const std::vector<int32_t> tokens = Tokens(s);
  double ref = 0, fwd = 0;
  for (auto _ : state) {
    const auto t0 = Clock::now();
    std::vector<float> logits =
        testing::ReferenceLogits(*g_rig->ck, g_rig->model->config(), tokens);
    benchmark::DoNotOptimize(logits);
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    state.SetIterationTime(sec);
    ref += sec;
    fwd += ForwardSeconds(tokens, Mode(0));  // same moment, same tokens
  }
  state.counters["tokens_per_s"] = static_cast<double>(s) * state.iterations() / ref;
  state.counters["speedup"] = ref / fwd;
}

void BM_DecodeStep(benchmark::State& state) {
  const int ctx = static_cast<int>(state.range(0));
  const model::LlamaConfig& c = g_rig->model->config();
  const std::vector<int32_t> tokens = Tokens(ctx + 1);
  model::ForwardOptions o;
  o.last_logits = 0;
  absl::StatusOr<model::ForwardOutput> fwd =
      g_rig->model->Forward(absl::MakeConstSpan(tokens.data(), ctx), o);
  if (!fwd.ok()) return state.SkipWithError("Forward failed");
  std::vector<float> logits(c.vocab_size);
  // Weight streaming bound: memcpy of the fp32 weights' size.
  std::vector<char> src(static_cast<size_t>(g_rig->weight_bytes), 1), dst(src.size());
  double step = 0, copy = 0;
  int64_t steps = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto cache = model::FullKvCache::FromPrefix(c, fwd->layers, ctx, ctx, ctx + 1);
    if (!cache.ok()) return state.SkipWithError("cache");
    state.ResumeTiming();
    const auto t0 = Clock::now();
    absl::Status st = g_rig->model->DecodeStep(tokens[ctx], cache->get(), absl::MakeSpan(logits));
    const auto t1 = Clock::now();
    if (!st.ok()) return state.SkipWithError("DecodeStep failed");
    std::memcpy(dst.data(), src.data(), src.size());
    benchmark::DoNotOptimize(dst.data());
    const auto t2 = Clock::now();
    step += std::chrono::duration<double>(t1 - t0).count();
    copy += std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(std::chrono::duration<double>(t1 - t0).count());
    ++steps;
  }
  state.counters["tokens_per_s"] = static_cast<double>(steps) / step;
  state.counters["of_weight_stream"] = copy / step;
}

}  // namespace
}  // namespace kvc

int main(int argc, char** argv) {
  std::string path;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strncmp(argv[i], "--model=", 8) == 0) {
      path = argv[i] + 8;
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  if (path.empty()) {
    std::fprintf(stderr, "model_bench: no --model=PATH given; nothing to measure\n");
  } else {
    absl::StatusOr<kvc::model::Checkpoint> ck = kvc::model::Checkpoint::Load(path);
    absl::StatusOr<kvc::model::Transformer> m = kvc::model::Transformer::Load(path);
    if (!ck.ok() || !m.ok()) {
      std::fprintf(stderr, "model_bench: %s\n",
                   (ck.ok() ? m.status() : ck.status()).ToString().c_str());
      return 1;
    }
    auto* rig = new kvc::Rig;
    rig->ck = std::make_unique<kvc::model::Checkpoint>(*std::move(ck));
    rig->model = std::make_unique<kvc::model::Transformer>(*std::move(m));
    rig->path = path;
    const kvc::model::LlamaConfig& c = rig->model->config();
    const double per_layer = 2.0 * c.dim + 2.0 * c.q_dim() * c.dim + 2.0 * c.kv_dim() * c.dim +
                             3.0 * c.hidden_dim * c.dim;
    rig->weight_bytes = 4.0 * (c.n_layers * per_layer + c.vocab_size * c.dim * 1.0 + c.dim);
    kvc::g_rig = rig;
    std::printf(
        "model %s: %d layers, hidden %d, heads %d/%d x %d, vocab %d, fp32 weights %.0f MB\n",
        path.c_str(), c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim(), c.vocab_size,
        rig->weight_bytes / 1e6);
    const int max_len = std::min(4096, c.seq_len);
    for (int s : {1024, 4096}) {
      if (s > max_len) continue;
      for (int mode : {0, 1}) {
        benchmark::RegisterBenchmark("BM_Prefill", kvc::BM_Prefill)
            ->Args({s, mode})
            ->UseManualTime()
            ->Unit(benchmark::kSecond)
            ->Iterations(2);
      }
    }
    benchmark::RegisterBenchmark("BM_Prefill", kvc::BM_Prefill)
        ->Args({std::min(1024, max_len), 2})
        ->UseManualTime()
        ->Unit(benchmark::kSecond)
        ->Iterations(2);
    benchmark::RegisterBenchmark("BM_PrefillReference", kvc::BM_PrefillReference)
        ->Arg(std::min(32, max_len))
        ->UseManualTime()
        ->Unit(benchmark::kSecond)
        ->Iterations(1);
    for (int ctx : {1024, 4096}) {
      if (ctx + 1 > c.seq_len) continue;
      benchmark::RegisterBenchmark("BM_DecodeStep", kvc::BM_DecodeStep)
          ->Arg(ctx)
          ->UseManualTime()
          ->Unit(benchmark::kMillisecond)
          ->Iterations(20);
    }
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}

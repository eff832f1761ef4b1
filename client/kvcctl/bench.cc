// kvcctl bench: concurrent synthetic PutCache/GetCache load against kvcd, with a live progress
// line and a latency/throughput summary.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "kvc/dtype.h"
#include "kvcctl.h"

namespace kvc::ctl {
namespace {

namespace pb = kvcache::v1;

struct OpStats {
  absl::Mutex mu;
  std::vector<double> latencies ABSL_GUARDED_BY(mu);  // seconds
  std::map<std::string, int> errors ABSL_GUARDED_BY(mu);
  std::atomic<uint64_t> bytes{0};
  std::atomic<uint64_t> ok{0};
  std::atomic<uint64_t> failed{0};

  void Record(absl::Duration d, const absl::Status& s, uint64_t n) {
    if (s.ok()) {
      bytes += n;
      ++ok;
    } else {
      ++failed;
    }
    absl::MutexLock lock(&mu);
    if (s.ok()) {
      latencies.push_back(absl::ToDoubleSeconds(d));
    } else {
      ++errors[StatusCodeName(s.code())];
    }
  }
};

// v must be sorted.
double Percentile(const std::vector<double>& v, double p) {
  if (v.empty()) return 0;
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
}

void PrintSummary(const char* name, OpStats& s, double seconds) {
  absl::MutexLock lock(&s.mu);
  std::vector<double>& l = s.latencies;
  // Sorted before the printf: its arguments are evaluated in no fixed order.
  std::sort(l.begin(), l.end());
  std::printf(
      "%-4s %8llu ok %6llu err %9.3f GB/s %9.1f ops/s  latency ms p50 %8.2f p90 %8.2f "
      "p99 %8.2f max %8.2f\n",
      name, static_cast<unsigned long long>(s.ok.load()),
      static_cast<unsigned long long>(s.failed.load()), s.bytes.load() / seconds / 1e9,
      s.ok.load() / seconds, Percentile(l, 0.5) * 1e3, Percentile(l, 0.9) * 1e3,
      Percentile(l, 0.99) * 1e3, l.empty() ? 0.0 : l.back() * 1e3);
  for (const auto& [code, n] : s.errors) std::printf("     errors %s: %d\n", code.c_str(), n);
}

}  // namespace

int RunBench(const std::vector<std::string>& args) {
  const std::string usage =
      "kvcctl bench [--concurrency=N] [--requests=N | --duration=S] [--mode=both|put|get] "
      "[shape flags] [compression flags]";
  FlagSet flags;
  AddGlobalFlags(&flags);
  AddCompressionFlags(&flags);
  flags.Use("concurrency");
  flags.Use("requests");
  flags.Use("duration");
  flags.Use("mode");
  flags.Use("format");
  flags.Use("layers");
  flags.Use("kv_heads");
  flags.Use("q_heads");
  flags.Use("head_dim");
  flags.Use("tokens");
  flags.Use("window");
  flags.Use("dtype");
  flags.Use("id_prefix");
  absl::StatusOr<std::vector<std::string>> pos = flags.Parse(args);
  if (!pos.ok()) return Usage(std::string(pos.status().message()), usage, flags);
  if (flags.GetBool("help")) {
    std::printf("usage: %s\nflags:\n%s", usage.c_str(), flags.Help().c_str());
    return kExitOk;
  }
  if (!pos->empty()) return Usage("bench takes no arguments", usage, flags);
  const int64_t conc = flags.GetInt("concurrency"), requests = flags.GetInt("requests");
  const double duration = flags.GetDouble("duration");
  if (conc < 1 || conc > 256) return Usage("--concurrency: outside [1, 256]", usage, flags);
  if (requests < 0 || duration < 0 || (requests == 0 && duration == 0)) {
    return Usage("give --requests > 0 or --duration > 0", usage, flags);
  }
  const std::string mode = flags.GetString("mode");
  if (mode != "both" && mode != "put" && mode != "get") {
    return Usage("--mode: must be both, put or get", usage, flags);
  }
  const std::string format = flags.GetString("format");
  if (format != "packed" && format != "dense") {
    return Usage("--format: must be packed or dense", usage, flags);
  }
  absl::StatusOr<DType> dtype = ParseDType(flags.GetString("dtype"));
  if (!dtype.ok()) return Usage("--dtype: must be f16, bf16 or f32", usage, flags);
  const int64_t layers = flags.GetInt("layers"), hkv = flags.GetInt("kv_heads"),
                hq = flags.GetInt("q_heads"), dim = flags.GetInt("head_dim"),
                tokens = flags.GetInt("tokens"), window = flags.GetInt("window");
  for (const auto& [name, v, hi] :
       {std::tuple<const char*, int64_t, int64_t>{"layers", layers, 1024},
        {"kv_heads", hkv, 1024},
        {"q_heads", hq, 4096},
        {"head_dim", dim, 256},
        {"tokens", tokens, 1 << 21}}) {
    if (v < 1 || v > hi) {
      return Usage(absl::StrCat("--", name, ": ", v, " is outside [1, ", hi, "]"), usage, flags);
    }
  }
  if (window < 0 || window > tokens) return Usage("--window: outside [0, --tokens]", usage, flags);
  absl::StatusOr<pb::CompressionConfig> compression = CompressionFromFlags(flags);
  if (!compression.ok()) return Usage(std::string(compression.status().message()), usage, flags);
  absl::StatusOr<std::unique_ptr<Client>> client_or = MakeClient(flags);
  if (!client_or.ok()) return Fail("bench", client_or.status());
  Client& client = **client_or;

  // One synthetic layer shared by every layer and worker: the client only reads it.
  const size_t esize = DTypeSize(*dtype);
  const size_t kv_elems = static_cast<size_t>(hkv * tokens * dim);
  const size_t q_elems = static_cast<size_t>(hq * window * dim);
  std::vector<uint8_t> k(kv_elems * esize), v(kv_elems * esize), q(q_elems * esize);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (size_t i = 0; i < kv_elems; ++i) StoreFromFloat(k.data(), *dtype, i, dist(rng));
  for (size_t i = 0; i < kv_elems; ++i) StoreFromFloat(v.data(), *dtype, i, dist(rng));
  for (size_t i = 0; i < q_elems; ++i) StoreFromFloat(q.data(), *dtype, i, dist(rng));
  const std::vector<LayerTensors> tensors(layers, LayerTensors{k.data(), v.data(), q.data()});
  const uint64_t put_bytes = static_cast<uint64_t>(layers) * (k.size() + v.size() + q.size());

  pb::PutCacheHeader base;
  base.set_dtype(*dtype == DType::kF32   ? pb::DTYPE_F32
                 : *dtype == DType::kF16 ? pb::DTYPE_F16
                                         : pb::DTYPE_BF16);
  base.set_layout(pb::LAYOUT_HND);
  pb::ModelShape* shape = base.mutable_shape();
  shape->set_num_layers(layers);
  shape->set_num_kv_heads(hkv);
  shape->set_num_q_heads(hq);
  shape->set_head_dim(dim);
  shape->set_seq_len(tokens);
  shape->set_obs_window(window);
  *base.mutable_compression() = *compression;
  base.set_overwrite(true);
  GetOptions get_opt;
  get_opt.format = format == "dense" ? CacheFormat::kDense : CacheFormat::kPacked;

  OpStats put_stats, get_stats;
  std::atomic<int64_t> claimed{0};
  std::atomic<bool> stop{false};
  const absl::Time start = absl::Now();
  const std::string prefix = absl::StrCat(flags.GetString("id_prefix"), "-", getpid());
  auto worker = [&](int w) {
    const std::string get_id = absl::StrCat(prefix, "-", w, "-get");
    if (mode == "get") {  // one cache per worker, fetched over and over
      pb::PutCacheHeader h = base;
      h.set_cache_id(get_id);
      absl::Status s = client.PutCache(h, tensors).status();
      if (!s.ok()) {
        put_stats.Record(absl::ZeroDuration(), s, 0);
        return;
      }
    }
    for (int64_t n = 0;; ++n) {
      if (stop.load()) break;
      if (requests > 0 && claimed.fetch_add(1) >= requests) break;
      if (duration > 0 && absl::Now() - start > absl::Seconds(duration)) break;
      std::string id = get_id;
      if (mode != "get") {
        pb::PutCacheHeader h = base;
        id = absl::StrCat(prefix, "-", w, "-", n);
        h.set_cache_id(id);
        const absl::Time t0 = absl::Now();
        absl::Status s = client.PutCache(h, tensors).status();
        put_stats.Record(absl::Now() - t0, s, put_bytes);
        if (!s.ok()) continue;
      }
      if (mode != "put") {
        uint64_t got = 0;
        const absl::Time t0 = absl::Now();
        absl::Status s = client.GetCacheStreaming(id, get_opt, nullptr, [&got](LayerData&& l) {
          got += l.packed.size() + l.k.size() + l.v.size() + l.positions.size() * 4;
          return absl::OkStatus();
        });
        get_stats.Record(absl::Now() - t0, s, got);
      }
      if (mode != "get") client.DeleteCache(id).IgnoreError();  // keep the store from filling
    }
    if (mode == "get") client.DeleteCache(get_id).IgnoreError();
  };

  std::vector<std::thread> threads;
  for (int w = 0; w < conc; ++w) threads.emplace_back(worker, w);
  std::atomic<bool> done{false};
  std::thread progress([&] {
    while (!done.load()) {
      absl::SleepFor(absl::Milliseconds(500));
      const double t = absl::ToDoubleSeconds(absl::Now() - start);
      std::fprintf(
          stderr,
          "\r[%6.1fs] put %6llu ok %7.3f GB/s | get %6llu ok %7.3f GB/s | "
          "errors %llu   ",
          t, static_cast<unsigned long long>(put_stats.ok.load()), put_stats.bytes.load() / t / 1e9,
          static_cast<unsigned long long>(get_stats.ok.load()), get_stats.bytes.load() / t / 1e9,
          static_cast<unsigned long long>(put_stats.failed + get_stats.failed));
      std::fflush(stderr);
    }
  });
  for (std::thread& t : threads) t.join();
  done = true;
  progress.join();
  std::fprintf(stderr, "\n");
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf(
      "bench: %lld workers, %.2f s, cache %lld layers x %lld tokens x %lld kv heads x "
      "%lld dims %s (%.2f MiB upload each), policy %s\n",
      static_cast<long long>(conc), seconds, static_cast<long long>(layers),
      static_cast<long long>(tokens), static_cast<long long>(hkv), static_cast<long long>(dim),
      std::string(DTypeName(*dtype)).c_str(), put_bytes / 1048576.0,
      compression->eviction().policy().c_str());
  if (mode != "get" || put_stats.failed > 0) PrintSummary("put", put_stats, seconds);
  if (mode != "put") PrintSummary("get", get_stats, seconds);
  return put_stats.failed + get_stats.failed > 0 ? kExitFailure : kExitOk;
}

}  // namespace kvc::ctl

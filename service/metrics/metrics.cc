// Metrics implementation over prometheus-cpp. Label children are created once and cached as raw
// pointers (prometheus-cpp keeps them alive as long as the family), so the hot path is a map
// lookup and an atomic add, not a label-set hash per call.
#include "kvc/metrics.h"

#include <array>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "metrics/http_exposer.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "prometheus/text_serializer.h"
#include "store/annotated_lock.h"

namespace kvc {

const char* CompressStageName(CompressStage s) {
  switch (s) {
    case CompressStage::kScore:
      return "score";
    case CompressStage::kSelect:
      return "select";
    case CompressStage::kPack:
      return "pack";
    case CompressStage::kQuantize:
      return "quantize";
    case CompressStage::kTotal:
      return "total";
  }
  return "unknown";
}

const char* RejectionReasonName(RejectionReason r) {
  switch (r) {
    case RejectionReason::kInvalidArgument:
      return "invalid_argument";
    case RejectionReason::kTooLarge:
      return "too_large";
    case RejectionReason::kBudget:
      return "budget";
    case RejectionReason::kLimit:
      return "limit";
    case RejectionReason::kDraining:
      return "draining";
    case RejectionReason::kUnauthenticated:
      return "unauthenticated";
    case RejectionReason::kPermissionDenied:
      return "permission_denied";
    case RejectionReason::kStreamIdle:
      return "stream_idle";
    case RejectionReason::kPeerStreams:
      return "peer_streams";
    case RejectionReason::kStaging:
      return "staging";
    case RejectionReason::kWork:
      return "work";
  }
  return "unknown";
}

namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

constexpr int kNumCodes = 17;  // OK .. UNAUTHENTICATED; absl and gRPC share the numbering
constexpr int kNumStages = 5;
constexpr int kNumEvictionReasons = 4;
constexpr int kNumRejectionReasons = 11;

// The KvCache service's methods (proto/kvcache/v1/kvcache.proto), pre-created at start.
constexpr const char* kKnownMethods[] = {"PutCache",    "GetCache",   "StatCache",
                                         "DeleteCache", "ListCaches", "GetServerInfo"};

// Roughly x2.5 steps: a loopback StatCache takes ~100us, a multi-GB PutCache tens of seconds.
Histogram::BucketBoundaries RpcBuckets() {
  return {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
          0.1,    0.25,    0.5,    1,     2.5,    5,     10,   30,    60};
}
// One layer's stage on a GPU can take microseconds; a long prompt on the CPU, seconds.
Histogram::BucketBoundaries CompressBuckets() {
  return {0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
          0.01,    0.025,    0.05,    0.1,    0.25,    0.5,    1,     2.5,    10};
}
Histogram::BucketBoundaries RatioBuckets() {
  return {1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64};
}

std::string CodeName(int code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

absl::Status ValidateOptions(const Metrics::Options& o) {
  if (o.listen_address.empty()) return absl::OkStatus();
  const size_t colon = o.listen_address.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(absl::string_view(o.listen_address).substr(colon + 1), &port) ||
      port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("metrics listen_address '", o.listen_address, "': expected host:port"));
  }
  return absl::OkStatus();
}

}  // namespace

struct Metrics::Impl {
  struct MethodSeries {
    Counter* started = nullptr;
    Histogram* handling = nullptr;
    std::array<Counter*, kNumCodes> handled{};
  };

  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();

  Family<Counter>* started_family = nullptr;
  Family<Counter>* handled_family = nullptr;
  Family<Histogram>* handling_family = nullptr;

  Counter* ingest_bytes = nullptr;
  Counter* served_bytes = nullptr;
  std::array<Histogram*, kNumStages> compress{};
  Histogram* ratio = nullptr;
  Gauge* store_used = nullptr;
  Gauge* store_capacity = nullptr;
  Gauge* store_entries = nullptr;
  std::array<Counter*, kNumEvictionReasons> evictions{};
  std::array<Counter*, kNumRejectionReasons> rejections{};
  Gauge* gpu_memory = nullptr;
  Gauge* pool_idle = nullptr;
  Gauge* pool_cap = nullptr;
  Counter* pool_reused = nullptr;
  Counter* pool_mapped = nullptr;
  uint64_t pool_reused_seen ABSL_GUARDED_BY(mu) = 0;  // totals already added to the counters
  uint64_t pool_mapped_seen ABSL_GUARDED_BY(mu) = 0;
  Gauge* staging_reserved = nullptr;
  Gauge* staging_capacity = nullptr;
  Gauge* active_streams = nullptr;
  Gauge* compressions_running = nullptr;
  Family<Gauge>* build_info_family = nullptr;

  absl::Mutex mu;
  std::map<std::string, MethodSeries, std::less<>> methods ABSL_GUARDED_BY(mu);
  Gauge* build_info ABSL_GUARDED_BY(mu) = nullptr;

  // Declared last: destroyed first, so no scrape runs against a half-destroyed object.
  std::unique_ptr<HttpExposer> exposer;

  MethodSeries MakeMethodSeries(const std::string& method) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    MethodSeries s;
    s.started = &started_family->Add({{"grpc_method", method}});
    s.handling = &handling_family->Add({{"grpc_method", method}}, RpcBuckets());
    for (int code = 0; code < kNumCodes; ++code) {
      s.handled[code] =
          &handled_family->Add({{"grpc_method", method}, {"grpc_code", CodeName(code)}});
    }
    return s;
  }

  MethodSeries Method(absl::string_view method) {
    {
      internal::ReaderLock lock(&mu);
      auto it = methods.find(method);
      if (it != methods.end()) return it->second;
    }
    internal::WriterLock lock(&mu);
    auto it = methods.find(method);
    if (it != methods.end()) return it->second;
    std::string name(method);
    return methods.emplace(name, MakeMethodSeries(name)).first->second;
  }

  void Build() {
    auto& r = *registry;
    started_family = &prometheus::BuildCounter()
                          .Name("grpc_server_started_total")
                          .Help("RPCs started on the server, by method.")
                          .Register(r);
    handled_family = &prometheus::BuildCounter()
                          .Name("grpc_server_handled_total")
                          .Help("RPCs completed on the server, by method and status code.")
                          .Register(r);
    handling_family = &prometheus::BuildHistogram()
                           .Name("grpc_server_handling_seconds")
                           .Help("Time from an RPC's start to its completion, by method.")
                           .Register(r);
    {
      internal::WriterLock lock(&mu);
      for (const char* m : kKnownMethods) methods.emplace(m, MakeMethodSeries(m));
    }

    ingest_bytes = &prometheus::BuildCounter()
                        .Name("kvc_ingest_bytes_total")
                        .Help("Uncompressed KV bytes received by PutCache.")
                        .Register(r)
                        .Add({});
    served_bytes = &prometheus::BuildCounter()
                        .Name("kvc_served_bytes_total")
                        .Help("Cache bytes sent to clients by GetCache and transfer Fetch.")
                        .Register(r)
                        .Add({});
    auto& compress_family = prometheus::BuildHistogram()
                                .Name("kvc_compress_duration_seconds")
                                .Help("Wall time of each compression stage of one layer.")
                                .Register(r);
    for (int s = 0; s < kNumStages; ++s) {
      compress[s] = &compress_family.Add(
          {{"stage", CompressStageName(static_cast<CompressStage>(s))}}, CompressBuckets());
    }
    ratio = &prometheus::BuildHistogram()
                 .Name("kvc_compression_ratio")
                 .Help("Uncompressed input bytes divided by stored bytes, per cache.")
                 .Register(r)
                 .Add({}, RatioBuckets());
    store_used = &prometheus::BuildGauge()
                      .Name("kvc_store_used_bytes")
                      .Help("Bytes held by the cache store, including entries kept by leases.")
                      .Register(r)
                      .Add({});
    store_capacity = &prometheus::BuildGauge()
                          .Name("kvc_store_capacity_bytes")
                          .Help("The cache store's byte budget.")
                          .Register(r)
                          .Add({});
    store_entries = &prometheus::BuildGauge()
                         .Name("kvc_store_entries")
                         .Help("Caches in the store's index.")
                         .Register(r)
                         .Add({});
    auto& eviction_family = prometheus::BuildCounter()
                                .Name("kvc_evictions_total")
                                .Help("Caches removed from the store, by reason.")
                                .Register(r);
    for (int i = 0; i < kNumEvictionReasons; ++i) {
      evictions[i] =
          &eviction_family.Add({{"reason", EvictionReasonName(static_cast<EvictionReason>(i))}});
    }
    auto& rejection_family = prometheus::BuildCounter()
                                 .Name("kvc_rejected_requests_total")
                                 .Help("Requests refused before doing their work, by reason.")
                                 .Register(r);
    for (int i = 0; i < kNumRejectionReasons; ++i) {
      rejections[i] =
          &rejection_family.Add({{"reason", RejectionReasonName(static_cast<RejectionReason>(i))}});
    }
    gpu_memory = &prometheus::BuildGauge()
                      .Name("kvc_gpu_memory_used_bytes")
                      .Help("Device memory held by the CUDA backend (0 without one).")
                      .Register(r)
                      .Add({});
    pool_idle = &prometheus::BuildGauge()
                     .Name("kvc_buffer_pool_idle_bytes")
                     .Help("Freed large buffers kept mapped for reuse (--buffer_pool_bytes).")
                     .Register(r)
                     .Add({});
    pool_cap = &prometheus::BuildGauge()
                    .Name("kvc_buffer_pool_capacity_bytes")
                    .Help("The most idle bytes the buffer pool keeps (--buffer_pool_bytes).")
                    .Register(r)
                    .Add({});
    auto& pool_family = prometheus::BuildCounter()
                            .Name("kvc_buffer_pool_requests_total")
                            .Help(
                                "Large-buffer requests: served from idle pooled memory, a whole "
                                "buffer or the front of a larger one (reused), or by mapping fresh "
                                "memory (mapped).")
                            .Register(r);
    pool_reused = &pool_family.Add({{"result", "reused"}});
    pool_mapped = &pool_family.Add({{"result", "mapped"}});
    staging_reserved = &prometheus::BuildGauge()
                            .Name("kvc_staging_reserved_bytes")
                            .Help(
                                "Staging reserved by uploads in flight (their declared bytes "
                                "and engine scratch), at most --staging_bytes.")
                            .Register(r)
                            .Add({});
    staging_capacity = &prometheus::BuildGauge()
                            .Name("kvc_staging_capacity_bytes")
                            .Help("The staging budget of uploads in flight (--staging_bytes).")
                            .Register(r)
                            .Add({});
    active_streams = &prometheus::BuildGauge()
                          .Name("kvc_active_streams")
                          .Help("PutCache and GetCache streams in progress.")
                          .Register(r)
                          .Add({});
    compressions_running = &prometheus::BuildGauge()
                                .Name("kvc_compressions_running")
                                .Help(
                                    "Layer compressions running in the engine now (uploads "
                                    "whose compression is in progress).")
                                .Register(r)
                                .Add({});
    build_info_family = &prometheus::BuildGauge()
                             .Name("kvc_build_info")
                             .Help("Always 1; labels carry the kvcd version and the backend.")
                             .Register(r);
  }
};

Metrics::Metrics(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Metrics::~Metrics() = default;

absl::StatusOr<std::unique_ptr<Metrics>> Metrics::Create(const Options& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  auto impl = std::make_unique<Impl>();
  impl->Build();
  if (!options.listen_address.empty()) {
    // Not prometheus::Exposer: the civetweb it embeds (1.15, as packaged) formats an
    // uninitialized path buffer in its authorization check for callback-handled URIs, which
    // crashed kvcd on its first scrape in some builds.
    prometheus::Registry* registry = impl->registry.get();
    auto exposer = HttpExposer::Start(options.listen_address, [registry] {
      return prometheus::TextSerializer().Serialize(registry->Collect());
    });
    if (!exposer.ok()) {
      return absl::Status(exposer.status().code(),
                          absl::StrCat("metrics listen_address: ", exposer.status().message()));
    }
    impl->exposer = std::move(exposer).value();
  }
  auto metrics = std::unique_ptr<Metrics>(new Metrics(std::move(impl)));
  metrics->SetBuildInfo(options.version, options.backend);
  return metrics;
}

int Metrics::port() const { return impl_->exposer == nullptr ? 0 : impl_->exposer->port(); }

void Metrics::RecordRpcStarted(absl::string_view method) {
  impl_->Method(method).started->Increment();
}

void Metrics::RecordRpc(absl::string_view method, absl::StatusCode code, double seconds) {
  int c = static_cast<int>(code);
  if (c < 0 || c >= kNumCodes) c = static_cast<int>(absl::StatusCode::kUnknown);
  const Impl::MethodSeries s = impl_->Method(method);
  s.handled[c]->Increment();
  s.handling->Observe(seconds);
}

void Metrics::RecordRpc(absl::string_view method, grpc::StatusCode code, double seconds) {
  RecordRpc(method, static_cast<absl::StatusCode>(static_cast<int>(code)), seconds);
}

void Metrics::AddIngestBytes(uint64_t bytes) { impl_->ingest_bytes->Increment(double(bytes)); }
void Metrics::AddServedBytes(uint64_t bytes) { impl_->served_bytes->Increment(double(bytes)); }

void Metrics::ObserveCompress(CompressStage stage, double seconds) {
  const int s = static_cast<int>(stage);
  if (s >= 0 && s < kNumStages) impl_->compress[s]->Observe(seconds);
}

void Metrics::ObserveCompressTimings(const CompressTimings& t) {
  ObserveCompress(CompressStage::kScore, t.score);
  ObserveCompress(CompressStage::kSelect, t.select);
  ObserveCompress(CompressStage::kPack, t.pack);
  ObserveCompress(CompressStage::kQuantize, t.quantize);
  ObserveCompress(CompressStage::kTotal, t.total);
}

void Metrics::ObserveCompressionRatio(double ratio) { impl_->ratio->Observe(ratio); }

void Metrics::SetStoreStats(const CacheStore::Stats& stats) {
  impl_->store_used->Set(double(stats.used_bytes));
  impl_->store_capacity->Set(double(stats.capacity_bytes));
  impl_->store_entries->Set(double(stats.entries));
}

void Metrics::RecordEviction(EvictionReason reason) {
  const int i = static_cast<int>(reason);
  if (i >= 0 && i < kNumEvictionReasons) impl_->evictions[i]->Increment();
}

void Metrics::RecordRejection(RejectionReason reason) {
  const int i = static_cast<int>(reason);
  if (i >= 0 && i < kNumRejectionReasons) impl_->rejections[i]->Increment();
}

void Metrics::SetGpuMemoryUsed(uint64_t bytes) { impl_->gpu_memory->Set(double(bytes)); }
void Metrics::SetBufferPoolStats(uint64_t idle_bytes, uint64_t cap_bytes, uint64_t reused,
                                 uint64_t mapped) {
  impl_->pool_idle->Set(double(idle_bytes));
  impl_->pool_cap->Set(double(cap_bytes));
  internal::WriterLock lock(&impl_->mu);
  if (reused > impl_->pool_reused_seen) {
    impl_->pool_reused->Increment(double(reused - impl_->pool_reused_seen));
    impl_->pool_reused_seen = reused;
  }
  if (mapped > impl_->pool_mapped_seen) {
    impl_->pool_mapped->Increment(double(mapped - impl_->pool_mapped_seen));
    impl_->pool_mapped_seen = mapped;
  }
}

void Metrics::SetStagingStats(uint64_t reserved_bytes, uint64_t capacity_bytes) {
  impl_->staging_reserved->Set(double(reserved_bytes));
  impl_->staging_capacity->Set(double(capacity_bytes));
}

void Metrics::StreamStarted() { impl_->active_streams->Increment(); }
void Metrics::StreamFinished() { impl_->active_streams->Decrement(); }
void Metrics::AddCompressionsRunning(int delta) {
  impl_->compressions_running->Increment(static_cast<double>(delta));
}

void Metrics::SetBuildInfo(const std::string& version, const std::string& backend) {
  internal::WriterLock lock(&impl_->mu);
  if (impl_->build_info != nullptr) impl_->build_info_family->Remove(impl_->build_info);
  impl_->build_info = &impl_->build_info_family->Add({{"version", version}, {"backend", backend}});
  impl_->build_info->Set(1);
}

std::string Metrics::Scrape() const {
  return prometheus::TextSerializer().Serialize(impl_->registry->Collect());
}

std::shared_ptr<prometheus::Registry> Metrics::registry() const { return impl_->registry; }

}  // namespace kvc

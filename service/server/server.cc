#include "server/server.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/health_check_service_interface.h"
#include "kvc/buffer_pool.h"
#include "kvc/status_macros.h"
#include "kvc/thread_pool.h"

namespace kvc::server {
namespace {

std::string HostOf(const std::string& addr) { return addr.substr(0, addr.rfind(':')); }

// Loading gRPC's reflection library runs its static initializer, which registers a server-builder
// plugin: every server built afterwards serves grpc.reflection.v1alpha. kvcd does not link the
// library, so without --enable_reflection no server has it.
absl::Status LoadReflection() {
  static void* const handle = dlopen(KVC_GRPC_REFLECTION_LIB, RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return absl::UnavailableError(absl::StrCat("--enable_reflection: cannot load ",
                                               KVC_GRPC_REFLECTION_LIB, ": ",
                                               why ? why : "unknown error"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<KvcServer>> KvcServer::Create(Options options) {
  const ServerConfig& c = options.config;
  RETURN_IF_ERROR(ValidateConfig(c));
  std::unique_ptr<KvcServer> s(new KvcServer());
  s->options_ = std::move(options);
  const ServerConfig& config = s->options_.config;
  // Read before anything binds or starts, so a bad file fails start-up naming its flag.
  std::shared_ptr<grpc::ServerCredentials> main_credentials = grpc::InsecureServerCredentials();
  if (!config.tls_cert_file.empty()) {
    ASSIGN_OR_RETURN(s->tls_, TlsFiles::Create(config));
    main_credentials = s->tls_->credentials();
  }

  ASSIGN_OR_RETURN(BackendKind kind, ParseBackendKind(config.backend));
  BackendOptions bo;
  bo.num_threads = config.threads;
  bo.thread_nice = config.compress_nice;
  ASSIGN_OR_RETURN(bo.scoring_math, ParseScoringMath(config.scoring_math));
  ASSIGN_OR_RETURN(s->backend_, CreateBackend(kind, bo));

  Metrics::Options mo;
  mo.listen_address = config.metrics_listen;
  ASSIGN_OR_RETURN(s->metrics_, Metrics::Create(mo));
  if (!config.metrics_listen.empty()) {
    s->metrics_address_ = absl::StrCat(HostOf(config.metrics_listen), ":", s->metrics_->port());
  }
  s->metrics_->SetBuildInfo(s->options_.version, std::string(s->backend_->name()));

  CacheStore::Options so;
  so.capacity_bytes = config.store_bytes;
  // Ingest hashes each compressed layer as it finishes and sets the checksum from those bytes,
  // so Insert need not hash the whole entry again; GetCache still verifies before serving.
  so.verify_on_insert = false;
  Metrics* metrics = s->metrics_.get();
  so.on_evict = [metrics](const CacheEntry&, EvictionReason reason) {
    metrics->RecordEviction(reason);
  };
  ASSIGN_OR_RETURN(s->store_, CacheStore::Create(so));

  const int threads = EffectiveThreads(config);
  // `threads` compression workers; ThreadPool counts the ParallelFor caller too, hence the + 1.
  // They and the backend's threads run at --compress_nice, so that the RPC threads and the I/O
  // pool (cheap jobs clients wait on: completing plain uploads, DENSE exports) win the CPU.
  s->pool_ = std::make_unique<ThreadPool>(threads + 1, config.compress_nice);
  s->io_pool_ = std::make_unique<ThreadPool>(threads + 1);
  s->uploads_ = std::make_unique<UploadTable>();
  // One process-wide pool serves upload staging and every compact blob (ByteVector), so the
  // memory of an evicted or deleted cache goes to the next upload instead of back to the kernel.
  LargeBuffers().set_cap(config.buffer_pool_bytes);

  if (!config.auth_tokens_file.empty()) {
    auto auth = TokenAuth::Load(config.auth_tokens_file);
    if (!auth.ok()) return absl::InvalidArgumentError(auth.status().message());
    s->auth_ = *std::move(auth);
  }

  // Idle streams are checked four times per idle period (at least every 250 ms), so one ends
  // within 1.25 idle periods of its last byte.
  const absl::Duration idle = absl::Seconds(config.stream_idle_seconds);
  s->reaper_ = std::make_unique<StreamReaper>(idle, std::min(idle / 4, absl::Milliseconds(250)));
  s->peer_streams_ = std::make_unique<PeerStreams>(EffectiveStreamsPerPeer(config));
  const uint64_t staging_bytes = EffectiveStagingBytes(config);
  s->staging_budget_ = std::make_unique<StagingBudget>(
      staging_bytes, [metrics, staging_bytes](uint64_t reserved) {
        metrics->SetStagingStats(reserved, staging_bytes);  // metrics_ outlives every upload
      });
  metrics->SetStagingStats(0, staging_bytes);

  s->state_ = std::make_unique<ServiceState>();
  s->state_->auth = s->auth_.get();
  s->state_->config = config;
  s->state_->backend = s->backend_.get();
  s->state_->store = s->store_.get();
  s->state_->metrics = s->metrics_.get();
  s->state_->pool = s->pool_.get();
  s->state_->io_pool = s->io_pool_.get();
  s->state_->uploads = s->uploads_.get();
  s->state_->reaper = s->reaper_.get();
  s->state_->peer_streams = s->peer_streams_.get();
  s->state_->staging_budget = s->staging_budget_.get();
  s->state_->version = s->options_.version;
  s->state_->RefreshStoreGauges();
  s->service_ = std::make_unique<KvCacheServiceImpl>(s->state_.get());

  ServerResources res{&s->state_->config, s->backend_.get(), s->store_.get(), s->metrics_.get(),
                      s->state_.get()};
  for (const auto& factory : s->options_.extra_services) {
    ASSIGN_OR_RETURN(auto service, factory(res));
    s->extra_.push_back(std::move(service));
  }

  grpc::EnableDefaultHealthCheckService(true);
  if (!config.health_listen.empty()) {
    // A server with no services of its own: only the default health service, for probes. Built
    // before reflection is loaded (it applies to every later server).
    // gRPC needs at least one service of its own to start a server; the generic one answers
    // every method except health with UNIMPLEMENTED.
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(config.health_listen, grpc::InsecureServerCredentials(), &port);
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    s->probe_only_ = std::make_unique<grpc::CallbackGenericService>();
    builder.RegisterCallbackGenericService(s->probe_only_.get());
    s->health_server_ = builder.BuildAndStart();
    if (!s->health_server_ || port == 0) {
      return absl::UnavailableError(
          absl::StrCat("--health_listen: cannot bind ", config.health_listen));
    }
    s->health_address_ = absl::StrCat(HostOf(config.health_listen), ":", port);
  }
  if (config.enable_reflection) RETURN_IF_ERROR(LoadReflection());
  {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort(config.listen, main_credentials, &port);
    // Without this gRPC sets SO_REUSEPORT, and a second kvcd on the same port would silently
    // share its traffic instead of failing.
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
    // Keepalive enforcement: kvcd pings a connection silent for --keepalive_time_seconds (60)
    // and drops it when the peer does not answer within --keepalive_timeout_seconds (20): dead
    // clients free their streams, and an upload of theirs stops compressing. A client may ping
    // at most every 10 s while no data flows, else it gets strikes and, at the third, GOAWAY; a
    // connection without calls for 5 minutes is closed (clients reconnect transparently).
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIME_MS,
                               static_cast<int>(config.keepalive_time_seconds * 1000));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                               static_cast<int>(config.keepalive_timeout_seconds * 1000));
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    // gRPC stops pinging after 2 pings without data by default: a stream waiting on a dead
    // client (no data either way) would then never be detected.
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 10 * 1000);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 2);
    builder.AddChannelArgument(GRPC_ARG_MAX_CONNECTION_IDLE_MS, 5 * 60 * 1000);
    builder.SetMaxReceiveMessageSize(static_cast<int>(config.max_message_bytes));
    builder.SetMaxSendMessageSize(static_cast<int>(config.max_message_bytes));
    builder.RegisterService(s->service_.get());
    for (auto& e : s->extra_) builder.RegisterService(e.get());
    s->server_ = builder.BuildAndStart();
    if (!s->server_ || port == 0) {
      if (s->health_server_) s->health_server_->Shutdown();
      if (!config.tls_cert_file.empty()) {
        // gRPC checks the key against the certificate only here, with no reason given.
        return absl::InvalidArgumentError(absl::StrCat(
            "--tls_cert_file/--tls_key_file: TLS setup failed on --listen ", config.listen,
            " (the key does not match the certificate, or the address cannot be bound)"));
      }
      return absl::UnavailableError(absl::StrCat("--listen: cannot bind ", config.listen));
    }
    s->address_ = absl::StrCat(HostOf(config.listen), ":", port);
  }
  for (grpc::Server* srv : {s->server_.get(), s->health_server_.get()}) {
    if (srv && srv->GetHealthCheckService()) srv->GetHealthCheckService()->SetServingStatus(true);
  }
  s->sweeper_ = std::thread([p = s.get()] { p->SweepLoop(); });
  return s;
}

KvcServer::~KvcServer() { Shutdown(); }

void KvcServer::SweepLoop() {
  const absl::Duration period = absl::Seconds(options_.config.ttl_sweep_seconds);
  const absl::Duration tls_period = absl::Seconds(options_.config.tls_reload_seconds);
  const bool reload_tls = tls_ && tls_->reloads();
  const absl::Duration wait = reload_tls ? std::min(period, tls_period) : period;
  absl::Time next_tls = absl::Now() + tls_period;
  while (!stop_sweep_.WaitForNotificationWithTimeout(wait)) {
    // A failed round (memory is out) is reported and the next one tries again.
    RunOrReport("kvcd: the TTL sweep failed", [&] {
      store_->ExpireNow();  // evictions are counted by the store's on_evict callback
      state_->RefreshStoreGauges();
      if (reload_tls && absl::Now() >= next_tls) {
        next_tls = absl::Now() + tls_period;
        if (const std::string line = tls_->Poll(); !line.empty()) {
          std::fprintf(stderr, "kvcd: %s\n", line.c_str());
        }
      }
    });
  }
}

void KvcServer::Drain() {
  if (!state_ || state_->draining.exchange(true)) return;
  for (grpc::Server* srv : {server_.get(), health_server_.get()}) {
    if (srv && srv->GetHealthCheckService()) srv->GetHealthCheckService()->SetServingStatus(false);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(options_.config.drain_seconds);
  while (state_->active_streams.load() > 0 && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
}

void KvcServer::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  if (state_) state_->draining = true;
  // Uploads still compressing after the drain are abandoned: their compression stops at the next
  // row block and their streams end now, so the servers below need not wait for them.
  if (uploads_) {
    const int stopped = uploads_->StopAll(absl::UnavailableError(
        "kvcd is shutting down: the upload was still in progress after the drain "
        "(--drain_seconds), so it was discarded"));
    if (stopped > 0) {
      std::fprintf(stderr, "kvcd: stopped %d upload(s) still in progress\n", stopped);
    }
  }
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(
                            static_cast<int64_t>(options_.config.shutdown_deadline_seconds * 1000));
  if (server_) server_->Shutdown(deadline);
  if (health_server_) health_server_->Shutdown(deadline);
  if (server_) server_->Wait();
  if (health_server_) health_server_->Wait();
  stop_sweep_.Notify();
  if (sweeper_.joinable()) sweeper_.join();
  // No handshake and no reload is left: the private copy of the TLS key goes now, since kvcd
  // exits without destructors (kvcd_main.cc).
  if (tls_) tls_->RemoveCopy();
  reaper_.reset();  // every stream is done: no watch is left to check
  // Queued compressions of stopped uploads return at once and running ones at their next row
  // block; a job that does not (one long step that checks no cancellation) is abandoned with
  // everything it may touch, since joining it could take arbitrarily long.
  const auto idle_by = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(absl::ToInt64Milliseconds(kAbandonAfter));
  const bool idle =
      (!pool_ || pool_->WaitIdle(idle_by)) && (!io_pool_ || io_pool_->WaitIdle(idle_by));
  if (!idle) {
    abandoned_ = true;
    std::fprintf(stderr,
                 "kvcd: compression jobs still running %.1f s after the shutdown; abandoning "
                 "them\n",
                 absl::ToDoubleSeconds(kAbandonAfter));
    (void)pool_.release();
    (void)io_pool_.release();
    (void)backend_.release();
    (void)store_.release();
    (void)state_.release();
    (void)staging_budget_.release();
    (void)metrics_.release();
    (void)uploads_.release();
    (void)service_.release();
    return;
  }
  pool_.reset();
  io_pool_.reset();
}

}  // namespace kvc::server

// kvcd: the KV-cache compression daemon. Flags (also from --flagfile, e.g. a mounted ConfigMap)
// configure addresses and limits; see --help. SIGTERM/SIGINT drain and shut down cleanly.
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/debugging/failure_signal_handler.h"
#include "absl/debugging/symbolize.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvc/backend_interface.h"
#include "kvc/buffer_pool.h"
#include "kvc/cpu_isa.h"
#include "kvc/selection.h"
#include "kvc/transfer.h"
#include "server/config.h"
#include "server/ingest_registry.h"
#include "server/log_limit.h"
#include "server/server.h"
#include "server/transfer_source.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:50051",
          "gRPC address host:port (port 0 picks a free port)");
ABSL_FLAG(std::string, health_listen, "127.0.0.1:50052",
          "plaintext grpc.health.v1-only address for probes; empty disables");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:9464",
          "Prometheus /metrics address; empty disables; port 0 picks a free port");
ABSL_FLAG(std::string, port_file, "", "if set, write the bound gRPC address to this file");
ABSL_FLAG(std::string, store_bytes, "1GiB", "store budget (bytes, or with K/M/G[i][B] suffix)");
ABSL_FLAG(uint32_t, default_ttl_seconds, 0, "TTL of caches whose upload sets none; 0 = none");
ABSL_FLAG(std::string, max_message_bytes, "8MiB", "largest gRPC message accepted");
ABSL_FLAG(std::string, max_chunk_bytes, "4MiB", "largest data payload of one stream message");
ABSL_FLAG(std::string, max_cache_bytes, "",
          "largest upload (K + V + Q_obs bytes) per cache; default: a quarter of --store_bytes");
ABSL_FLAG(std::string, staging_bytes, "",
          "bytes all uploads in flight may stage together: each reserves its declared K + V + "
          "Q_obs bytes at its header, and one that does not fit gets RESOURCE_EXHAUSTED; "
          "default: max(--store_bytes / 2, --max_cache_bytes)");
ABSL_FLAG(uint32_t, max_concurrent_streams, 64,
          "concurrent PutCache/GetCache streams; more get RESOURCE_EXHAUSTED");
ABSL_FLAG(uint32_t, max_streams_per_peer, 0,
          "concurrent streams one client may hold (one tenant with --auth_tokens_file, else one "
          "client IP address); more get RESOURCE_EXHAUSTED; 0 = max(1, "
          "--max_concurrent_streams / 4)");
ABSL_FLAG(double, stream_idle_seconds, 10,
          "a PutCache that receives no message, or a GetCache whose client takes none, for this "
          "long ends with DEADLINE_EXCEEDED, freeing its slot, staging and read lease");
ABSL_FLAG(std::string, buffer_pool_bytes, "512MiB",
          "idle large buffers (upload staging, memory of evicted or deleted caches) kept for reuse "
          "by later uploads (bytes or K/M/G[i][B]); 0 disables reuse");
ABSL_FLAG(std::string, backend, "auto", "compression backend: auto, cpu or cuda");
ABSL_FLAG(int32_t, threads, 0, "engine and compression threads; 0 = hardware concurrency");
ABSL_FLAG(std::string, scoring_math, "exact",
          "attention scoring's logits on the CPU: exact, or integer (int8 dot products, AVX-512 "
          "VNNI or AVX2: about twice as fast, kept sets equal up to near-ties; exact below AVX2 "
          "and on AMX)");
ABSL_FLAG(double, drain_seconds, 5,
          "on SIGTERM, how long to wait for in-flight streams; uploads still compressing then "
          "are stopped (UNAVAILABLE) and their compression abandoned");
ABSL_FLAG(double, shutdown_deadline_seconds, 10, "then, the deadline given to remaining calls");
ABSL_FLAG(double, ttl_sweep_seconds, 1, "period of the TTL sweep and store gauge refresh");
ABSL_FLAG(double, work_flops_per_byte, 8192,
          "work budget of one upload: its compression spec may cost at most this many flops per "
          "uploaded byte (plus --work_base_flops); more is RESOURCE_EXHAUSTED at the header");
ABSL_FLAG(double, work_base_flops, 1e9, "flops every upload may use beyond the per-byte budget");
ABSL_FLAG(double, work_scratch_per_byte, 4,
          "engine scratch memory one upload's spec may need per uploaded byte (plus "
          "--work_base_scratch_bytes); it is reserved from --staging_bytes with the upload");
ABSL_FLAG(std::string, work_base_scratch_bytes, "64MiB",
          "engine scratch every upload may use beyond the per-byte budget");
ABSL_FLAG(double, compress_timeout_seconds, 300,
          "an upload whose compression has run this long is stopped with DEADLINE_EXCEEDED");
ABSL_FLAG(int32_t, compress_nice, 10,
          "nice value added to the compression threads (0..19), so that RPCs keep their speed "
          "while a heavy spec compresses");
ABSL_FLAG(double, keepalive_time_seconds, 60,
          "gRPC keepalive: a connection silent this long is pinged");
ABSL_FLAG(double, keepalive_timeout_seconds, 20,
          "gRPC keepalive: a connection whose ping is not answered within this long is dropped "
          "(its streams cancelled)");
ABSL_FLAG(bool, enable_reflection, false, "serve gRPC server reflection");
ABSL_FLAG(std::string, auth_tokens_file, "",
          "file of 'TOKEN TENANT' lines; when set every RPC but health needs "
          "'authorization: Bearer TOKEN' and each tenant sees only its own caches");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM server certificate (chain) for TLS on --listen; needs --tls_key_file");
ABSL_FLAG(std::string, tls_key_file, "", "PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "PEM CA bundle: require client certificates signed by it (mutual TLS)");
ABSL_FLAG(int32_t, tls_reload_seconds, 60,
          "re-read the --tls_* files this often, so rotated certificates take effect for new "
          "connections without a restart; 0 = read once at start");
ABSL_FLAG(std::string, transfer, "auto",
          "KvCacheTransfer service for PutCache uploads with external_payload and Fetch of "
          "stored caches: auto (on; NCCL where libnccl and a CUDA device are available, else "
          "gRPC bytes only) or off. Not served with --auth_tokens_file");
ABSL_FLAG(uint32_t, transfer_session_idle_seconds, 300,
          "a transfer session unused this long (no upload, fetch or reuse in flight) expires, and "
          "a Transfer or Fetch stream whose client sends nothing this long is ended");
ABSL_FLAG(uint32_t, transfer_max_sessions, 64,
          "open transfer sessions across all clients; more are RESOURCE_EXHAUSTED");

// Under AddressSanitizer (clang's or GCC's spelling): the leak check at exit, and ASan's own fault
// reports instead of the failure signal handler.
#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVC_UNDER_ASAN 1
#endif
#endif
#if !defined(KVC_UNDER_ASAN) && defined(__SANITIZE_ADDRESS__)
#define KVC_UNDER_ASAN 1
#endif
#ifndef KVC_UNDER_ASAN
#define KVC_UNDER_ASAN 0
#endif
#if KVC_UNDER_ASAN
#include <sanitizer/lsan_interface.h>
#endif

namespace {

constexpr int kExitBadFlags = 2;
constexpr char kVersion[] = "0.1.0";

// absl::ParseCommandLine reports an unknown flag or an unparsable value and calls exit(1);
// kvcd promises exit code 2 for every bad flag, so an exit during parsing is turned into 2.
// (--help and --version keep absl's own exit codes.)
std::atomic<bool> g_parsing_flags{false};

void ExitBadFlagsIfParsing() {
  if (g_parsing_flags.load()) std::_Exit(kExitBadFlags);
}

// Shutdown signals go through a self-pipe. Libraries start threads before main (OpenBLAS does
// when it loads), and those threads do not inherit a mask set later in main, so a process-directed
// SIGTERM may land on any of them. A handler runs in whichever thread receives the signal and only
// writes the signal number to the pipe, which the main thread reads; delivery to any thread is
// therefore equivalent. The handler is installed first thing in main, before anything else runs.
int g_signal_pipe[2] = {-1, -1};

void OnShutdownSignal(int sig) {
  const int saved_errno = errno;
  const unsigned char byte = static_cast<unsigned char>(sig);
  // A full pipe means a signal is already pending: dropping this one loses nothing.
  [[maybe_unused]] const ssize_t n = write(g_signal_pipe[1], &byte, 1);
  errno = saved_errno;
}

bool InstallShutdownHandlers() {
  if (pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) return false;
  // The read end blocks: the main thread sleeps on it.
  const int flags = fcntl(g_signal_pipe[0], F_GETFL);
  if (flags < 0 || fcntl(g_signal_pipe[0], F_SETFL, flags & ~O_NONBLOCK) != 0) return false;
  struct sigaction sa = {};
  sa.sa_handler = OnShutdownSignal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  return sigaction(SIGTERM, &sa, nullptr) == 0 && sigaction(SIGINT, &sa, nullptr) == 0;
}

// Blocks until a shutdown signal arrives; returns its number.
int WaitForShutdownSignal() {
  for (;;) {
    unsigned char byte = 0;
    const ssize_t n = read(g_signal_pipe[0], &byte, 1);
    if (n == 1) return byte;
    if (n < 0 && errno == EINTR) continue;
    return SIGTERM;  // the pipe cannot fail while open; treat anything else as a stop request
  }
}

bool AsksForHelpOrVersion(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--help", 0) == 0 || arg.rfind("-help", 0) == 0 || arg == "--version" ||
        arg == "-version" || arg == "--only_check_args") {
      return true;
    }
  }
  return false;
}

absl::StatusOr<kvc::server::ServerConfig> ConfigFromFlags() {
  kvc::server::ServerConfig c;
  c.listen = absl::GetFlag(FLAGS_listen);
  c.health_listen = absl::GetFlag(FLAGS_health_listen);
  c.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  c.port_file = absl::GetFlag(FLAGS_port_file);
  auto bytes = [](const char* name, const std::string& text) {
    return kvc::server::ParseByteSize(name, text);
  };
  auto store = bytes("store_bytes", absl::GetFlag(FLAGS_store_bytes));
  if (!store.ok()) return store.status();
  c.store_bytes = *store;
  auto msg = bytes("max_message_bytes", absl::GetFlag(FLAGS_max_message_bytes));
  if (!msg.ok()) return msg.status();
  c.max_message_bytes = *msg;
  auto chunk = bytes("max_chunk_bytes", absl::GetFlag(FLAGS_max_chunk_bytes));
  if (!chunk.ok()) return chunk.status();
  c.max_chunk_bytes = *chunk;
  if (!absl::GetFlag(FLAGS_max_cache_bytes).empty()) {
    auto cache = bytes("max_cache_bytes", absl::GetFlag(FLAGS_max_cache_bytes));
    if (!cache.ok()) return cache.status();
    if (*cache == 0) return absl::InvalidArgumentError("--max_cache_bytes: must be > 0");
    c.max_cache_bytes = *cache;
  }
  if (!absl::GetFlag(FLAGS_staging_bytes).empty()) {
    auto staging = bytes("staging_bytes", absl::GetFlag(FLAGS_staging_bytes));
    if (!staging.ok()) return staging.status();
    if (*staging == 0) return absl::InvalidArgumentError("--staging_bytes: must be > 0");
    c.staging_bytes = *staging;
  }
  auto pool = bytes("buffer_pool_bytes", absl::GetFlag(FLAGS_buffer_pool_bytes));
  if (!pool.ok()) return pool.status();
  c.buffer_pool_bytes = *pool;
  c.default_ttl_seconds = absl::GetFlag(FLAGS_default_ttl_seconds);
  c.max_concurrent_streams = absl::GetFlag(FLAGS_max_concurrent_streams);
  c.max_streams_per_peer = absl::GetFlag(FLAGS_max_streams_per_peer);
  c.stream_idle_seconds = absl::GetFlag(FLAGS_stream_idle_seconds);
  c.backend = absl::GetFlag(FLAGS_backend);
  c.scoring_math = absl::GetFlag(FLAGS_scoring_math);
  c.threads = absl::GetFlag(FLAGS_threads);
  c.drain_seconds = absl::GetFlag(FLAGS_drain_seconds);
  c.shutdown_deadline_seconds = absl::GetFlag(FLAGS_shutdown_deadline_seconds);
  c.ttl_sweep_seconds = absl::GetFlag(FLAGS_ttl_sweep_seconds);
  c.work_flops_per_byte = absl::GetFlag(FLAGS_work_flops_per_byte);
  c.work_base_flops = absl::GetFlag(FLAGS_work_base_flops);
  c.work_scratch_per_byte = absl::GetFlag(FLAGS_work_scratch_per_byte);
  auto base_scratch =
      bytes("work_base_scratch_bytes", absl::GetFlag(FLAGS_work_base_scratch_bytes));
  if (!base_scratch.ok()) return base_scratch.status();
  c.work_base_scratch_bytes = *base_scratch;
  c.compress_timeout_seconds = absl::GetFlag(FLAGS_compress_timeout_seconds);
  c.compress_nice = absl::GetFlag(FLAGS_compress_nice);
  c.keepalive_time_seconds = absl::GetFlag(FLAGS_keepalive_time_seconds);
  c.keepalive_timeout_seconds = absl::GetFlag(FLAGS_keepalive_timeout_seconds);
  c.enable_reflection = absl::GetFlag(FLAGS_enable_reflection);
  c.auth_tokens_file = absl::GetFlag(FLAGS_auth_tokens_file);
  c.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  c.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  c.tls_client_ca_file = absl::GetFlag(FLAGS_tls_client_ca_file);
  c.tls_reload_seconds = absl::GetFlag(FLAGS_tls_reload_seconds);
  if (auto s = kvc::server::ValidateConfig(c); !s.ok()) return s;
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  // A fault (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) prints the signal and a symbolized stack
  // trace to stderr before kvcd dies of it, so a crash in production or a soak leaves evidence in
  // the log. Installed before the shutdown handlers, which then take SIGTERM and SIGINT back.
  absl::InitializeSymbolizer(argv[0]);
#if !KVC_UNDER_ASAN  // AddressSanitizer reports faults itself, better; its handler stays
  absl::InstallFailureSignalHandler(absl::FailureSignalHandlerOptions());
#endif
  kvc::ReuseLargeMallocs();  // gRPC's multi-MiB message buffers: reused, not remapped each time
  // A client repeating a request protobuf refuses (a non-UTF-8 string) must not flood the log.
  kvc::server::InstallProtobufLogLimit();
  if (!InstallShutdownHandlers()) {
    std::fprintf(stderr, "kvcd: cannot install the SIGTERM/SIGINT handlers\n");
    return 1;
  }
  absl::SetProgramUsageMessage(
      "kvcd: KV-cache compression service. Usage: kvcd [--flag=value ...] [--flagfile=FILE]");
  absl::FlagsUsageConfig usage;
  usage.version_string = [] { return absl::StrCat("kvcd ", kVersion, "\n"); };
  absl::SetFlagsUsageConfig(usage);
  if (!AsksForHelpOrVersion(argc, argv)) {
    g_parsing_flags = true;
    std::atexit(ExitBadFlagsIfParsing);
  }
  absl::ParseCommandLine(argc, argv);
  g_parsing_flags = false;
  auto config = ConfigFromFlags();
  if (!config.ok()) {
    std::fprintf(stderr, "kvcd: %s\n", std::string(config.status().message()).c_str());
    return kExitBadFlags;
  }

  // The CPU kernels' instruction-set cap comes from the environment (kvc/cpu_isa.h).
  if (absl::Status isa = kvc::CpuIsaEnvStatus(); !isa.ok()) {
    std::fprintf(stderr, "kvcd: %s\n", std::string(isa.message()).c_str());
    return kExitBadFlags;
  }
  std::printf("kvcd: cpu kernels: %s (scoring logits: %s)\n", kvc::CpuIsaDescription().c_str(),
              kvc::ScoringLogitsDescription(*kvc::ParseScoringMath(config->scoring_math)).c_str());

  signal(SIGPIPE, SIG_IGN);

  kvc::server::KvcServer::Options options;
  options.config = *config;
  options.version = kVersion;
  // Further services (e.g. the NCCL transfer service) are appended to options.extra_services.
  // The transfer service feeds uploads registered in transfer_ingest; both outlive the server.
  // It has no per-tenant authorization yet, so it is not served when authentication is on.
  kvc::server::IngestRegistry transfer_ingest;
  kvc::server::TransferIngestSink transfer_sink(&transfer_ingest);
  // Fetches read the server's store; made once the store exists, and outlives the server.
  std::unique_ptr<kvc::server::StoreTransferSource> transfer_source;
  const std::string transfer = absl::GetFlag(FLAGS_transfer);
  if (transfer != "auto" && transfer != "off") {
    std::fprintf(stderr, "kvcd: --transfer: '%s' is not auto or off\n", transfer.c_str());
    return kExitBadFlags;
  }
  if (transfer == "auto" && !config->auth_tokens_file.empty()) {
    std::printf("kvcd: transfer service off (not available with --auth_tokens_file)\n");
  } else if (transfer == "auto") {
    options.extra_services.push_back(
        [&transfer_ingest, &transfer_sink, &transfer_source](const kvc::server::ServerResources& r)
            -> absl::StatusOr<std::unique_ptr<grpc::Service>> {
          kvc::transfer::TransferServiceOptions topts;
          topts.sink = &transfer_sink;
          transfer_source = std::make_unique<kvc::server::StoreTransferSource>(r.store, r.metrics);
          topts.source = transfer_source.get();
          topts.metrics = r.metrics;
          // GRPC_BYTES fetches send pieces of GetCache's chunk size, which fits the message limit.
          topts.limits.fetch_chunk_bytes = r.config->max_chunk_bytes;
          topts.limits.session_idle_timeout =
              absl::Seconds(absl::GetFlag(FLAGS_transfer_session_idle_seconds));
          topts.limits.max_sessions = static_cast<int>(
              std::min<uint32_t>(absl::GetFlag(FLAGS_transfer_max_sessions), 1 << 20));
          kvc::server::ShareStreamSlots(r.state, &topts);  // Transfer/Fetch count as streams
          std::string why;
          topts.enable_nccl = kvc::transfer::NcclTransportAvailable(topts.device, &why);
          r.state->nccl_available = topts.enable_nccl;
          r.state->ingest = &transfer_ingest;
          std::printf("kvcd: transfer service on (%s)\n",
                      topts.enable_nccl ? "NCCL and gRPC bytes"
                                        : absl::StrCat("gRPC bytes only: ", why).c_str());
          return kvc::transfer::CreateTransferService(topts);
        });
  }
  auto server = kvc::server::KvcServer::Create(std::move(options));
  if (!server.ok()) {
    std::fprintf(stderr, "kvcd: %s\n", std::string(server.status().message()).c_str());
    return server.status().code() == absl::StatusCode::kInvalidArgument ? kExitBadFlags : 1;
  }
  if (!config->port_file.empty()) {
    // Write then rename, so a reader never sees a partial address; before the address is
    // printed, so whoever waits for that line finds the file in place.
    const std::string tmp = config->port_file + ".tmp";
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << (*server)->address() << "\n";
    }
    if (std::rename(tmp.c_str(), config->port_file.c_str()) != 0) {
      std::fprintf(stderr, "kvcd: --port_file: cannot write %s\n", config->port_file.c_str());
      return 1;
    }
  }
  std::printf("kvcd: listening on %s\n", (*server)->address().c_str());
  if (!(*server)->health_address().empty()) {
    std::printf("kvcd: health on %s\n", (*server)->health_address().c_str());
  }
  if (!(*server)->metrics_address().empty()) {
    std::printf("kvcd: metrics on http://%s/metrics\n", (*server)->metrics_address().c_str());
  }
  std::fflush(stdout);

  const int sig = WaitForShutdownSignal();
  std::printf("kvcd: signal %d, draining\n", sig);
  std::fflush(stdout);
  const absl::Time drain_start = absl::Now();
  (*server)->Drain();
  std::printf("kvcd: drained in %.3f s, shutting down\n",
              absl::ToDoubleSeconds(absl::Now() - drain_start));
  std::fflush(stdout);
  (*server)->Shutdown();
  std::printf("kvcd: stopped after %.3f s\n", absl::ToDoubleSeconds(absl::Now() - drain_start));
  std::fflush(stdout);
  // Everything is stopped: exit without destructors. Destroying the gRPC server runs the
  // library's global shutdown, which in gRPC 1.51 can wait up to 10 s for its executor's next
  // timer; and after an abandoned shutdown (server->abandoned()) jobs still run on the leaked
  // pools, under which no destructor may run.
  std::fflush(stderr);
#if KVC_UNDER_ASAN
  __lsan_do_leak_check();  // what exit() would have run under LeakSanitizer
#endif
  std::_Exit(0);
}

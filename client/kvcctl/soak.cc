// kvcctl soak: N clients put/get/delete random caches against kvcd for a while, verify every
// fetched byte, inject faults, optionally SIGKILL and restart a kvcd it runs itself, and watch
// kvcd's RSS against a stated bound. Exit 0 only when nothing was corrupted, every status was a
// legal one, kvcd never died on its own, served again after every restart, stayed under the RSS
// bound and shut down cleanly at the end. See README.md beside this file.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "kvc/status_macros.h"
#include "kvcctl.h"
#include "soak_kvcd.h"
#include "soak_worker.h"

namespace kvc::ctl {
namespace {

using soak::RssSampler;
using soak::SoakConfig;
using soak::SoakState;
using soak::SoakWorker;

constexpr uint64_t kMiB = uint64_t{1} << 20;

// The largest upload the random shapes can make (K + V + Q_obs of every layer, 4-byte dtype).
uint64_t MaxUploadBytes(const soak::ShapeLimits& l) {
  const uint64_t hkv = l.max_kv_heads, d = l.max_head_dim, s = l.max_tokens;
  return static_cast<uint64_t>(l.max_layers) * (2 * hkv * s * d + 4 * hkv * 32 * d) * 4;
}

// Waits until kvcd answers GetServerInfo on a fresh channel (retrying UNAVAILABLE).
absl::StatusOr<ServerInfo> WaitServing(const std::string& target, absl::Duration timeout) {
  ClientOptions o;
  o.target = target;
  o.unary_timeout = absl::Seconds(5);
  o.buffer_pool_bytes = 0;
  ASSIGN_OR_RETURN(std::unique_ptr<Client> c, Client::Create(o));
  const absl::Time deadline = absl::Now() + timeout;
  absl::StatusOr<ServerInfo> info;
  while (absl::Now() < deadline) {
    info = c->GetServerInfo();
    if (info.ok()) return info;
    absl::SleepFor(absl::Milliseconds(200));
  }
  return info;
}

// After the clients stopped: no stream slot stays held (abandoned uploads included), and once every
// cache of the soak is deleted, a kvcd of our own holds no entry and no byte (no leaked lease).
void EndChecks(const SoakConfig& config, bool own_kvcd, const std::string& metrics,
               SoakState* state) {
  if (!metrics.empty()) {
    if (absl::Status s = WaitForMetric(metrics, "kvc_active_streams", 0, absl::Seconds(30));
        !s.ok()) {
      state->Failure(
          absl::StrCat("stream slots still held after every client stopped: ", s.message()));
    }
  }
  ClientOptions o;
  o.target = config.target;
  o.unary_timeout = config.timeout;
  o.buffer_pool_bytes = 0;
  absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(o);
  if (!client.ok()) {
    state->Failure(absl::StrCat("end checks: ", client.status().ToString()));
    return;
  }
  absl::StatusOr<std::vector<CacheInfo>> all = (*client)->ListCaches(config.id_prefix);
  if (!all.ok()) {
    state->Failure(absl::StrCat("end checks: ListCaches: ", all.status().ToString()));
    return;
  }
  const size_t left = all->size();
  for (const CacheInfo& c : *all) {
    absl::Status s = (*client)->DeleteCache(c.cache_id()).status();
    if (!s.ok() && s.code() != absl::StatusCode::kNotFound) {
      state->Failure(absl::StrCat("end checks: DeleteCache '", c.cache_id(), "': ", s.ToString()));
    }
  }
  all = (*client)->ListCaches(config.id_prefix);
  if (!all.ok() || !all->empty()) {
    state->Failure(absl::StrCat("end checks: caches left after deleting them all: ",
                                all.ok() ? absl::StrCat(all->size()) : all.status().ToString()));
  }
  if (own_kvcd && !metrics.empty()) {
    // The gauges are refreshed every --ttl_sweep_seconds (1 s by default).
    for (const char* series : {"kvc_store_entries", "kvc_store_used_bytes"}) {
      if (absl::Status s = WaitForMetric(metrics, series, 0, absl::Seconds(30)); !s.ok()) {
        state->Failure(
            absl::StrCat("the store is not empty after deleting every cache: ", s.message()));
      }
    }
  }
  std::printf("soak: end checks done (%zu caches deleted%s)\n", left,
              metrics.empty() ? ", no metrics address: stream and store gauges not checked" : "");
}

}  // namespace

int RunSoak(const std::vector<std::string>& args) {
  const std::string usage =
      "kvcctl soak [--kvcd=PATH | --target=HOST:PORT] [--duration=S] [--clients=N] "
      "[--kill_every=S] [--rss_csv=FILE] ...";
  FlagSet flags;
  // Plaintext, no token: the soak is for a kvcd it runs itself or a test deployment.
  for (const char* name :
       {"target", "timeout", "kvcd", "kvcd_flags", "kvcd_log", "store_mib", "buffer_pool_mib", "duration", "clients", "kill_every", "fault_rate", "stall_seconds", "tiny_deadline_ms", "race_ids", "max_layers", "max_kv_heads", "max_tokens", "max_head_dim", "recover_seconds", "rss_csv", "rss_overhead_mib", "rss_bound_mib", "kvcd_pid", "metrics", "id_prefix", "seed", "self_check", "verbose"}) {
    flags.Use(name);
  }
  absl::StatusOr<std::vector<std::string>> pos = flags.Parse(args);
  if (!pos.ok()) return Usage(std::string(pos.status().message()), usage, flags);
  if (flags.GetBool("help")) {
    std::printf(
        "usage: %s\n\nRSS bound (VmRSS and VmHWM of kvcd, sampled every 0.5 s) =\n"
        "  store_mib + buffer_pool_mib + 2 x clients x max upload + rss_overhead_mib\n"
        "where max upload = max_layers x (2 x max_kv_heads x max_tokens x max_head_dim +\n"
        "  4 x max_kv_heads x 32 x max_head_dim) x 4 bytes (each client's in-flight upload,\n"
        "  staged and compressed). At the CI sizes a leak of a few MiB per second fails a\n"
        "  60 s run; longer runs find smaller ones.\n\nflags:\n%s",
        usage.c_str(), flags.Help().c_str());
    return kExitOk;
  }
  if (!pos->empty()) return Usage("soak takes no arguments", usage, flags);

  SoakConfig config;
  config.clients = static_cast<int>(flags.GetInt("clients"));
  config.fault_rate = flags.GetDouble("fault_rate");
  config.stall = absl::Seconds(flags.GetDouble("stall_seconds"));
  config.tiny_deadline_ms = static_cast<int>(flags.GetInt("tiny_deadline_ms"));
  config.race_ids = static_cast<int>(flags.GetInt("race_ids"));
  config.recover = absl::Seconds(flags.GetDouble("recover_seconds"));
  config.limits.max_layers = static_cast<int>(flags.GetInt("max_layers"));
  config.limits.max_kv_heads = static_cast<int>(flags.GetInt("max_kv_heads"));
  config.limits.max_tokens = static_cast<int>(flags.GetInt("max_tokens"));
  config.limits.max_head_dim = static_cast<int>(flags.GetInt("max_head_dim"));
  config.seed = static_cast<uint64_t>(flags.WasSet("seed") ? flags.GetInt("seed") : 1);
  config.verbose = flags.GetBool("verbose");
  config.self_check = flags.GetBool("self_check");
  config.id_prefix = flags.WasSet("id_prefix") ? flags.GetString("id_prefix") : "soak/";
  // --timeout and --duration are shared with other subcommands; the soak's defaults differ.
  const double timeout = flags.WasSet("timeout") ? flags.GetDouble("timeout") : 120;
  config.timeout = absl::Seconds(timeout);
  if (!(timeout > 0)) return Usage("--timeout: must be > 0", usage, flags);
  const double duration = flags.WasSet("duration") ? flags.GetDouble("duration") : 60;
  const double kill_every = flags.GetDouble("kill_every");
  const std::string kvcd_path = flags.GetString("kvcd");
  if (config.clients < 1 || config.clients > 256) {
    return Usage("--clients: outside [1, 256]", usage, flags);
  }
  if (!(duration > 0)) return Usage("--duration: must be > 0", usage, flags);
  if (kill_every < 0 || (kill_every > 0 && kvcd_path.empty())) {
    return Usage("--kill_every: needs --kvcd and must be >= 0", usage, flags);
  }
  if (!(config.fault_rate >= 0 && config.fault_rate <= 1)) {
    return Usage("--fault_rate: outside [0, 1]", usage, flags);
  }
  if (config.limits.max_layers < 1 || config.limits.max_layers > 64 ||
      config.limits.max_kv_heads < 1 || config.limits.max_tokens < 16 ||
      config.limits.max_tokens > 65536 || config.limits.max_head_dim < 32 ||
      config.limits.max_head_dim > 128 || config.race_ids < 0 || config.tiny_deadline_ms < 1 ||
      config.stall < absl::ZeroDuration()) {
    return Usage("a shape or fault flag is out of range (see --help)", usage, flags);
  }
  const uint64_t store = static_cast<uint64_t>(flags.GetInt("store_mib")) * kMiB;
  const uint64_t pool = static_cast<uint64_t>(flags.GetInt("buffer_pool_mib")) * kMiB;
  const uint64_t max_upload = MaxUploadBytes(config.limits);
  const uint64_t inflight = 2 * static_cast<uint64_t>(config.clients) * max_upload;
  const uint64_t overhead = static_cast<uint64_t>(flags.GetInt("rss_overhead_mib")) * kMiB;
  const uint64_t bound = flags.GetInt("rss_bound_mib") > 0
                             ? static_cast<uint64_t>(flags.GetInt("rss_bound_mib")) * kMiB
                             : store + pool + inflight + overhead;

  // kvcd: ours (restartable) or the target.
  std::unique_ptr<KvcdProcess> kvcd;
  if (!kvcd_path.empty()) {
    KvcdProcess::Options o;
    o.binary = kvcd_path;
    const char* tmp = std::getenv("TMPDIR");
    const std::string dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
    o.log_path = flags.GetString("kvcd_log");
    if (o.log_path.empty()) o.log_path = absl::StrCat(dir, "/kvcctl-soak-", getpid(), ".log");
    o.base_flags = {absl::StrCat("--store_bytes=", store),
                    absl::StrCat("--buffer_pool_bytes=", pool)};
    for (absl::string_view f :
         absl::StrSplit(flags.GetString("kvcd_flags"), ' ', absl::SkipWhitespace())) {
      o.flags.emplace_back(f);
    }
    o.start_timeout = absl::Seconds(60);
    o.kill_with_parent = true;  // the spawning thread is the soak's main thread
    absl::StatusOr<std::unique_ptr<KvcdProcess>> started = KvcdProcess::Start(o);
    if (!started.ok()) return Fail("soak: starting kvcd", started.status());
    kvcd = *std::move(started);
    config.target = kvcd->address();
    std::printf("soak: kvcd pid %d on %s, log %s\n", static_cast<int>(kvcd->pid()),
                config.target.c_str(), o.log_path.c_str());
  } else {
    config.target = flags.GetString("target");
  }
  absl::StatusOr<ServerInfo> info = WaitServing(config.target, absl::Seconds(30));
  if (!info.ok()) return Fail("soak: kvcd does not serve", info.status());
  if (info->backend() != "cpu") {
    config.limits.lossless_only = true;
    std::printf(
        "soak: kvcd's backend is %s, not the CPU engine: only uncompressed caches (their "
        "bytes are exact on every backend)\n",
        info->backend().c_str());
  }

  SoakState state(config);
  state.ready_unix_ms = absl::ToUnixMillis(absl::Now());
  std::vector<std::unique_ptr<SoakWorker>> workers;
  for (int i = 0; i < config.clients; ++i) {
    absl::StatusOr<std::unique_ptr<SoakWorker>> w = SoakWorker::Create(&state, i);
    if (!w.ok()) return Fail("soak: client", w.status());
    workers.push_back(*std::move(w));
  }
  std::FILE* csv = nullptr;
  if (!flags.GetString("rss_csv").empty()) {
    csv = std::fopen(flags.GetString("rss_csv").c_str(), "w");
    if (csv == nullptr) {
      return Fail("soak", absl::InvalidArgumentError("--rss_csv: cannot open the file"));
    }
  }
  const pid_t external_pid = static_cast<pid_t>(flags.GetInt("kvcd_pid"));
  KvcdProcess* child = kvcd.get();
  RssSampler sampler([child, external_pid] { return child ? child->pid() : external_pid; },
                     [&state] { return state.ops.load(); }, absl::Milliseconds(500), csv);

  std::printf(
      "soak: %d clients for %.0f s against %s, RSS bound %.0f MiB (store %.0f + pool %.0f "
      "+ in-flight 2 x %d x %.1f + overhead %.0f)\n",
      config.clients, duration, config.target.c_str(), bound / 1048576.0, store / 1048576.0,
      pool / 1048576.0, config.clients, max_upload / 1048576.0, overhead / 1048576.0);
  std::fflush(stdout);
  const absl::Time start = absl::Now();
  std::vector<std::thread> threads;
  for (auto& w : workers) threads.emplace_back([&w] { w->Run(); });

  // Supervisor (this thread: the kvcd child dies with the thread that forked it).
  int kills = 0;
  absl::Duration longest_restart;  // SIGKILL to the new kvcd's --port_file
  absl::Time next_kill =
      kill_every > 0 ? start + absl::Seconds(kill_every) : absl::InfiniteFuture();
  absl::Time next_progress = start + absl::Seconds(5);
  const absl::Time end = start + absl::Seconds(duration);
  bool crashed = false;
  while (absl::Now() < end && !crashed) {
    absl::SleepFor(absl::Milliseconds(100));
    if (kvcd != nullptr) {
      if (absl::Status s = kvcd->CheckAlive(); !s.ok()) {
        state.Failure(
            absl::StrCat("CRASH: ", s.message(), "; log tail:\n", kvcd->OutputTail(4000)));
        crashed = true;
        break;
      }
    }
    // No kill in the last stretch: every client must be seen to recover before the end.
    const absl::Duration tail =
        std::max(absl::Seconds(5), std::min(absl::Seconds(kill_every), absl::Seconds(15)));
    if (absl::Now() >= next_kill && absl::Now() + tail < end) {
      const absl::Time killed = absl::Now();
      state.down = true;
      ++state.epoch;
      kvcd->Kill().IgnoreError();
      state.ledger.Wiped(state.ledger.Tick());
      ++kills;
      state.Fault("kvcd_sigkill");
      if (absl::Status s = kvcd->Restart(); !s.ok()) {
        state.Failure(absl::StrCat("restart after SIGKILL failed: ", s.message()));
        crashed = true;
        break;
      }
      state.ready_unix_ms = absl::ToUnixMillis(absl::Now());
      state.down = false;
      longest_restart = std::max(longest_restart, absl::Now() - killed);
      std::printf("soak: [%5.1fs] SIGKILL + restart %d: kvcd pid %d\n",
                  absl::ToDoubleSeconds(absl::Now() - start), kills, static_cast<int>(kvcd->pid()));
      std::fflush(stdout);
      next_kill = absl::Now() + absl::Seconds(kill_every);
    }
    if (config.verbose && absl::Now() >= next_progress) {
      std::printf("soak: [%5.1fs] %llu ops, %llu verified gets, RSS %.1f MiB (max HWM %.1f)\n",
                  absl::ToDoubleSeconds(absl::Now() - start),
                  static_cast<unsigned long long>(state.ops.load()),
                  static_cast<unsigned long long>(state.verified_gets.load()),
                  sampler.max_rss() / 1048576.0, sampler.max_hwm() / 1048576.0);
      std::fflush(stdout);
      next_progress += absl::Seconds(5);
    }
  }
  state.stop = true;
  for (std::thread& t : threads) t.join();
  if (kill_every > 0 && kills == 0) {
    state.Failure("no SIGKILL happened: --duration is too short for --kill_every");
  }
  for (const auto& w : workers) {
    if (!crashed && kills > 0 && !w->ReachedSince(state.epoch.load())) {
      state.Failure(
          absl::StrCat("client ", w->index(), " never reached kvcd after the last restart"));
    }
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  if (!crashed) {
    // kvcd still serves after everything (a fresh channel, generous retries).
    if (auto s = WaitServing(config.target, config.recover); !s.ok()) {
      state.Failure(absl::StrCat("kvcd does not serve at the end: ", s.status().ToString()));
    } else {
      EndChecks(config, kvcd != nullptr,
                kvcd != nullptr ? kvcd->metrics_address() : flags.GetString("metrics"), &state);
    }
  }
  sampler.Stop();
  if (csv != nullptr) std::fclose(csv);
  if (kvcd != nullptr && !crashed) {
    if (absl::Status s = kvcd->CheckAlive(); !s.ok()) {
      state.Failure(absl::StrCat("CRASH: ", s.message(), "; log tail:\n", kvcd->OutputTail(4000)));
    } else {
      absl::StatusOr<int> code = kvcd->Stop(absl::Seconds(60));
      if (!code.ok() || *code != 0) {
        state.Failure(
            absl::StrCat("kvcd did not shut down cleanly on SIGTERM: ",
                         code.ok() ? absl::StrCat("exit code ", *code) : code.status().ToString(),
                         "; log tail:\n", kvcd->OutputTail(4000)));
      }
    }
  }
  RssSampler::Sample over;
  if (sampler.samples() > 0 && sampler.Exceeded(bound, &over)) {
    state.Failure(absl::StrCat("RSS over the bound at ", over.seconds, " s: VmRSS ",
                               over.status.rss_bytes / kMiB, " MiB, VmHWM ",
                               over.status.hwm_bytes / kMiB, " MiB > ", bound / kMiB, " MiB"));
  }

  // Summary.
  std::printf(
      "\nsoak: %.1f s, %d clients, %llu ops, %d SIGKILL+restart (longest: %.2f s to "
      "listening again)\n",
      seconds, config.clients, static_cast<unsigned long long>(state.ops.load()), kills,
      absl::ToDoubleSeconds(longest_restart));
  std::printf("ops by type and status:\n");
  for (const auto& [op, codes] : state.OpCounts()) {
    std::printf("  %-12s", op.c_str());
    for (const auto& [code, n] : codes) {
      std::printf(" %s %llu", code.c_str(), static_cast<unsigned long long>(n));
    }
    std::printf("\n");
  }
  std::printf("faults injected:");
  for (const auto& [kind, n] : state.FaultCounts()) {
    std::printf(" %s %llu", kind.c_str(), static_cast<unsigned long long>(n));
  }
  std::printf(
      "\nverified: %llu gets, %.1f MiB compared byte for byte (%.1f MiB of them also "
      "against the input)\n",
      static_cast<unsigned long long>(state.verified_gets.load()),
      state.verified_bytes.load() / 1048576.0, state.lossless_bytes.load() / 1048576.0);
  if (sampler.samples() > 0) {
    std::printf(
        "kvcd RSS: max VmRSS %.1f MiB, max VmHWM %.1f MiB, bound %.1f MiB (%llu "
        "samples)\n",
        sampler.max_rss() / 1048576.0, sampler.max_hwm() / 1048576.0, bound / 1048576.0,
        static_cast<unsigned long long>(sampler.samples()));
  }
  const std::vector<std::string> failures = state.Failures();
  if (failures.empty()) {
    std::printf("soak: PASS\n");
    return kExitOk;
  }
  std::printf("soak: FAIL, %llu failures; the first:\n",
              static_cast<unsigned long long>(state.failure_count()));
  for (const std::string& f : failures) std::printf("  - %s\n", f.c_str());
  return kExitFailure;
}

}  // namespace kvc::ctl

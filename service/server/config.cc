#include "server/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <thread>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "kvc/backend_interface.h"

namespace kvc::server {
namespace {

absl::Status CheckAddress(const std::string& flag, const std::string& addr, bool allow_empty) {
  if (addr.empty()) {
    if (allow_empty) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": must not be empty"));
  }
  const size_t colon = addr.rfind(':');
  uint32_t port = 0;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(addr.substr(colon + 1), &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, ": '", addr, "' is not host:port (port 0..65535)"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint64_t> ParseByteSize(const std::string& field, const std::string& text) {
  const std::string t = std::string(absl::StripAsciiWhitespace(text));
  size_t i = 0;
  while (i < t.size() && std::isdigit(static_cast<unsigned char>(t[i]))) ++i;
  uint64_t number = 0;
  if (i == 0 || !absl::SimpleAtoi(t.substr(0, i), &number)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", field, ": '", text, "' is not a byte size (e.g. 1073741824, 64MiB)"));
  }
  std::string suffix = absl::AsciiStrToLower(t.substr(i));
  int shift = 0;
  if (suffix.empty() || suffix == "b") {
    shift = 0;
  } else {
    const char unit = suffix[0];
    const std::string rest = suffix.substr(1);
    if (rest != "" && rest != "b" && rest != "i" && rest != "ib") {
      return absl::InvalidArgumentError(
          absl::StrCat("--", field, ": unknown size suffix in '", text, "'"));
    }
    switch (unit) {
      case 'k':
        shift = 10;
        break;
      case 'm':
        shift = 20;
        break;
      case 'g':
        shift = 30;
        break;
      case 't':
        shift = 40;
        break;
      default:
        return absl::InvalidArgumentError(
            absl::StrCat("--", field, ": unknown size suffix in '", text, "'"));
    }
  }
  if (shift > 0 && number > (std::numeric_limits<uint64_t>::max() >> shift)) {
    return absl::InvalidArgumentError(absl::StrCat("--", field, ": '", text, "' overflows"));
  }
  return number << shift;
}

int EffectiveThreads(const ServerConfig& c) {
  if (c.threads > 0) return c.threads;
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

absl::Status ValidateConfig(const ServerConfig& c) {
  if (auto s = CheckAddress("listen", c.listen, false); !s.ok()) return s;
  if (auto s = CheckAddress("health_listen", c.health_listen, true); !s.ok()) return s;
  if (auto s = CheckAddress("metrics_listen", c.metrics_listen, true); !s.ok()) return s;
  if (c.store_bytes == 0) return absl::InvalidArgumentError("--store_bytes: must be > 0");
  if (c.max_message_bytes < 1024 || c.max_message_bytes > (1ull << 31) - 1) {
    return absl::InvalidArgumentError(absl::StrCat("--max_message_bytes: ", c.max_message_bytes,
                                                   " is outside [1024, 2147483647]"));
  }
  if (c.max_chunk_bytes == 0) return absl::InvalidArgumentError("--max_chunk_bytes: must be > 0");
  // A chunk plus its small header must fit one message.
  if (c.max_chunk_bytes + 512 > c.max_message_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_chunk_bytes: ", c.max_chunk_bytes, " must be at least 512 bytes below ",
                     "--max_message_bytes (", c.max_message_bytes, ")"));
  }
  if (c.max_concurrent_streams == 0) {
    return absl::InvalidArgumentError("--max_concurrent_streams: must be > 0");
  }
  if (c.max_streams_per_peer > c.max_concurrent_streams) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_streams_per_peer: ", c.max_streams_per_peer,
                     " is above --max_concurrent_streams (", c.max_concurrent_streams, ")"));
  }
  if (c.staging_bytes != 0 && c.staging_bytes < EffectiveMaxCacheBytes(c)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--staging_bytes: ", c.staging_bytes, " is below --max_cache_bytes (",
                     EffectiveMaxCacheBytes(c),
                     "), so an upload of the largest allowed size could never start"));
  }
  if (!(c.stream_idle_seconds > 0 && c.stream_idle_seconds <= 86400)) {
    return absl::InvalidArgumentError("--stream_idle_seconds: must be in (0, 86400]");
  }
  if (absl::StatusOr<ScoringMath> math = ParseScoringMath(c.scoring_math); !math.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--", math.status().message()));
  }
  if (c.backend != "auto" && c.backend != "cpu" && c.backend != "cuda") {
    return absl::InvalidArgumentError(
        absl::StrCat("--backend: '", c.backend, "' is not auto, cpu or cuda"));
  }
  if (c.threads < 0 || c.threads > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("--threads: ", c.threads, " is outside [0, 1024]"));
  }
  if (!(c.drain_seconds >= 0 && c.drain_seconds <= 3600)) {
    return absl::InvalidArgumentError("--drain_seconds: must be in [0, 3600]");
  }
  if (!(c.shutdown_deadline_seconds >= 0 && c.shutdown_deadline_seconds <= 3600)) {
    return absl::InvalidArgumentError("--shutdown_deadline_seconds: must be in [0, 3600]");
  }
  if (!(c.ttl_sweep_seconds > 0 && c.ttl_sweep_seconds <= 3600)) {
    return absl::InvalidArgumentError("--ttl_sweep_seconds: must be in (0, 3600]");
  }
  if (!(c.work_flops_per_byte > 0) || !std::isfinite(c.work_flops_per_byte)) {
    return absl::InvalidArgumentError("--work_flops_per_byte: must be finite and > 0");
  }
  if (!(c.work_base_flops >= 0) || !std::isfinite(c.work_base_flops)) {
    return absl::InvalidArgumentError("--work_base_flops: must be finite and >= 0");
  }
  if (!(c.work_scratch_per_byte > 0) || !std::isfinite(c.work_scratch_per_byte)) {
    return absl::InvalidArgumentError("--work_scratch_per_byte: must be finite and > 0");
  }
  if (!(c.compress_timeout_seconds > 0 && c.compress_timeout_seconds <= 86400)) {
    return absl::InvalidArgumentError("--compress_timeout_seconds: must be in (0, 86400]");
  }
  if (c.compress_nice < 0 || c.compress_nice > 19) {
    return absl::InvalidArgumentError(
        absl::StrCat("--compress_nice: ", c.compress_nice, " is outside [0, 19]"));
  }
  if (!(c.keepalive_time_seconds >= 1 && c.keepalive_time_seconds <= 86400)) {
    return absl::InvalidArgumentError("--keepalive_time_seconds: must be in [1, 86400]");
  }
  if (!(c.keepalive_timeout_seconds >= 1 && c.keepalive_timeout_seconds <= 86400)) {
    return absl::InvalidArgumentError("--keepalive_timeout_seconds: must be in [1, 86400]");
  }
  if (c.tls_cert_file.empty() != c.tls_key_file.empty()) {
    return absl::InvalidArgumentError(c.tls_cert_file.empty()
                                          ? "--tls_cert_file: required with --tls_key_file"
                                          : "--tls_key_file: required with --tls_cert_file");
  }
  if (c.tls_reload_seconds < 0 || c.tls_reload_seconds > 86400) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_reload_seconds: ", c.tls_reload_seconds, " is outside [0, 86400]"));
  }
  if (!c.tls_client_ca_file.empty() && c.tls_cert_file.empty()) {
    return absl::InvalidArgumentError(
        "--tls_client_ca_file: needs --tls_cert_file and --tls_key_file");
  }
  return absl::OkStatus();
}

}  // namespace kvc::server

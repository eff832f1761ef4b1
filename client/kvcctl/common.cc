#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "kvcctl.h"

namespace kvc::ctl {

namespace pb = kvcache::v1;

void AddGlobalFlags(FlagSet* flags) {
  flags->Use("target");
  flags->Use("timeout");
  flags->Use("token");
  flags->Use("chunk_mib");
  flags->Use("tls");
  flags->Use("tls_ca");
  flags->Use("tls_cert");
  flags->Use("tls_key");
}

absl::StatusOr<std::unique_ptr<Client>> MakeClient(const FlagSet& flags) {
  ClientOptions o;
  o.target = flags.GetString("target");
  o.bearer_token = flags.GetString("token");
  o.tls_ca_file = flags.GetString("tls_ca");
  o.tls_cert_file = flags.GetString("tls_cert");
  o.tls_key_file = flags.GetString("tls_key");
  o.tls = flags.GetBool("tls") || !o.tls_ca_file.empty() || !o.tls_cert_file.empty() ||
          !o.tls_key_file.empty();
  const double timeout = flags.GetDouble("timeout");
  if (timeout < 0 || !std::isfinite(timeout)) {
    return absl::InvalidArgumentError("--timeout: must be a non-negative number of seconds");
  }
  if (timeout > 0) {
    o.unary_timeout = absl::Seconds(timeout);
    o.stream_timeout = absl::Seconds(timeout);
  }
  const int64_t chunk = flags.GetInt("chunk_mib");
  if (chunk < 1 || chunk > 4) {
    return absl::InvalidArgumentError(absl::StrCat("--chunk_mib: ", chunk, " is outside [1, 4]"));
  }
  o.max_chunk_bytes = static_cast<size_t>(chunk) << 20;
  return Client::Create(o);
}

void AddCompressionFlags(FlagSet* flags) {
  flags->Use("policy");
  flags->Use("ratio");
  flags->Use("budget");
  flags->Use("key_policy");
  flags->Use("lambda");
  flags->Use("bits");
  flags->Use("recent");
  flags->Use("seed");
  flags->Use("ada");
  flags->Use("value_weight");
  flags->Use("value_eps");
  flags->Use("horizon");
}

absl::StatusOr<pb::CompressionConfig> CompressionFromFlags(const FlagSet& flags) {
  pb::CompressionConfig c;
  c.mutable_eviction()->set_policy(flags.GetString("policy"));
  const double ratio = flags.GetDouble("ratio");
  if (ratio < 0 || ratio > 1) {
    return absl::InvalidArgumentError(absl::StrCat("--ratio: ", ratio, " is outside (0, 1]"));
  }
  if (ratio > 0) c.mutable_eviction()->set_keep_ratio(ratio);
  const int64_t budget = flags.GetInt("budget");
  if (budget < 0 || budget > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--budget: ", budget, " is out of range"));
  }
  c.mutable_eviction()->set_budget(static_cast<uint32_t>(budget));
  c.mutable_eviction()->set_seed(static_cast<uint64_t>(flags.GetInt("seed")));
  if (const double ada = flags.GetDouble("ada"); ada != -1) {
    if (!(ada >= 0 && ada <= 1)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--ada: ", ada, " is outside [0, 1] (-1 = off)"));
    }
    c.mutable_eviction()->set_adaptive(true);
    c.mutable_eviction()->set_adaptive_floor(ada);
  }
  c.mutable_eviction()->set_value_weight(flags.GetString("value_weight"));
  const double value_eps = flags.GetDouble("value_eps");
  if (value_eps != -1) {
    if (!(value_eps >= 0) || std::isinf(value_eps)) {
      return absl::InvalidArgumentError(
          absl::StrCat("--value_eps: ", value_eps, " must be finite and >= 0 (-1 = default)"));
    }
    c.mutable_eviction()->set_value_eps(value_eps);
  }
  const int64_t horizon = flags.GetInt("horizon");
  if (horizon < 0 || horizon > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--horizon: ", horizon, " is out of range"));
  }
  if (horizon > 0) c.mutable_eviction()->set_horizon(static_cast<uint32_t>(horizon));
  const double lambda = flags.GetDouble("lambda");
  if (lambda < 0 || lambda >= 1) {
    return absl::InvalidArgumentError(absl::StrCat("--lambda: ", lambda, " is outside [0, 1)"));
  }
  std::string key_policy = flags.GetString("key_policy");
  if (key_policy.empty()) key_policy = lambda > 0 ? "think" : "none";
  c.mutable_channels()->set_key_policy(key_policy);
  c.mutable_channels()->set_key_lambda(lambda);
  const int64_t bits = flags.GetInt("bits");
  if (bits != 0 && bits != 2 && bits != 4 && bits != 8) {
    return absl::InvalidArgumentError(absl::StrCat("--bits: ", bits, " is not 0, 2, 4 or 8"));
  }
  c.mutable_quant()->set_bits(static_cast<uint32_t>(bits));
  const int64_t recent = flags.GetInt("recent");
  if (recent < -1 || recent > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--recent: ", recent, " is out of range"));
  }
  if (recent >= 0) c.set_recent_tokens(static_cast<uint32_t>(recent));
  return c;
}

int Fail(const std::string& what, const absl::Status& status) {
  std::fprintf(stderr, "kvcctl %s: %s: %s\n", what.c_str(), StatusCodeName(status.code()).c_str(),
               std::string(status.message()).c_str());
  return kExitFailure;
}

int Usage(const std::string& message, const std::string& usage, const FlagSet& flags) {
  if (!message.empty()) std::fprintf(stderr, "kvcctl: %s\n", message.c_str());
  std::fprintf(stderr, "usage: %s\nflags:\n%s", usage.c_str(), flags.Help().c_str());
  return kExitUsage;
}

}  // namespace kvc::ctl

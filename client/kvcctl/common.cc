#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kvc/protocol/spec_string.h"
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
  flags->Use("xlayer");
  flags->Use("value_weight");
  flags->Use("value_eps");
  flags->Use("horizon");
}

absl::StatusOr<pb::CompressionConfig> CompressionFromFlags(const FlagSet& flags) {
  // The flags are written as a spec string and parsed by the one grammar (ParseSpecConfig), so
  // they take the values the spec strings and kvcd take. Checked here: what the flags' sentinels
  // mean (0 or -1 = unset) and what a spec string cannot say.
  auto exact = [](double x) { return absl::StrFormat("%.17g", x); };
  const double ratio = flags.GetDouble("ratio");
  if (ratio < 0 || ratio > 1) {
    return absl::InvalidArgumentError(absl::StrCat("--ratio: ", ratio, " is outside (0, 1]"));
  }
  const int64_t budget = flags.GetInt("budget");
  if (budget < 0 || budget > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--budget: ", budget, " is out of range"));
  }
  std::vector<std::string> options;
  if (const int64_t seed = flags.GetInt("seed"); seed != 0) {
    options.push_back(absl::StrCat("seed=", static_cast<uint64_t>(seed)));
  }
  if (const double ada = flags.GetDouble("ada"); ada != -1) {
    options.push_back(absl::StrCat("ada=", exact(ada)));
  }
  if (flags.GetBool("xlayer")) options.push_back("xlayer=1");
  if (const std::string w = flags.GetString("value_weight"); !w.empty()) {
    options.push_back(absl::StrCat("value=", w));
  }
  if (const double eps = flags.GetDouble("value_eps"); eps != -1) {
    options.push_back(absl::StrCat("veps=", exact(eps)));
  }
  const int64_t horizon = flags.GetInt("horizon");
  if (horizon < 0 || horizon > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--horizon: ", horizon, " is out of range"));
  }
  if (horizon > 0) options.push_back(absl::StrCat("horizon=", horizon));
  std::vector<std::string> terms;
  const std::string policy = flags.GetString("policy");
  if (!policy.empty() && policy != "none") {
    std::string term =
        absl::StrCat(policy, budget > 0 ? absl::StrCat("@", budget)
                                        : absl::StrCat(":", exact(ratio > 0 ? ratio : 1)));
    for (const std::string& o : options) absl::StrAppend(&term, ",", o);
    terms.push_back(std::move(term));
  } else if (!options.empty()) {
    return absl::InvalidArgumentError(
        "--seed, --ada, --value_weight, --value_eps and --horizon need an eviction --policy");
  }
  const double lambda = flags.GetDouble("lambda");
  if (lambda < 0 || lambda >= 1) {
    return absl::InvalidArgumentError(absl::StrCat("--lambda: ", lambda, " is outside [0, 1)"));
  }
  std::string key_policy = flags.GetString("key_policy");
  if (key_policy.empty()) key_policy = lambda > 0 ? "think" : "none";
  if (key_policy != "none") terms.push_back(absl::StrCat(key_policy, ":", exact(lambda)));
  if (const int64_t bits = flags.GetInt("bits"); bits != 0)
    terms.push_back(absl::StrCat("q", bits));
  const int64_t recent = flags.GetInt("recent");
  if (recent < -1 || recent > UINT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("--recent: ", recent, " is out of range"));
  }
  if (recent >= 0) terms.push_back(absl::StrCat("r=", recent));
  return ParseSpecConfig(terms.empty() ? "full" : absl::StrJoin(terms, "+"));
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

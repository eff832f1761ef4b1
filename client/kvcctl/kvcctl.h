// kvcctl internals shared by its subcommands. Exit codes: 0 success, 1 an RPC or I/O failure
// (message with the gRPC code name), 2 a usage error (bad flag or argument).
#ifndef KVC_CLIENT_KVCCTL_KVCCTL_H_
#define KVC_CLIENT_KVCCTL_KVCCTL_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "flags.h"
#include "kvc/client.h"

namespace kvc::ctl {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// Adds --target, --timeout, --token, --chunk_mib and --tls* to a subcommand's flags.
void AddGlobalFlags(FlagSet* flags);
absl::StatusOr<std::unique_ptr<Client>> MakeClient(const FlagSet& flags);

// Adds the compression flags (--policy, --ratio, --budget, --key_policy, --lambda, --bits, ...)
// and builds the wire config from them (INVALID_ARGUMENT names a bad flag).
void AddCompressionFlags(FlagSet* flags);
absl::StatusOr<kvcache::v1::CompressionConfig> CompressionFromFlags(const FlagSet& flags);

// Prints "kvcctl <what>: <CODE>: <message>" to stderr; returns kExitFailure.
int Fail(const std::string& what, const absl::Status& status);
// Prints "kvcctl: <message>" and the subcommand's usage to stderr; returns kExitUsage.
int Usage(const std::string& message, const std::string& usage, const FlagSet& flags);

int RunPut(const std::vector<std::string>& args);
int RunGet(const std::vector<std::string>& args);
int RunStat(const std::vector<std::string>& args);
int RunLs(const std::vector<std::string>& args);
int RunRm(const std::vector<std::string>& args);
int RunInfo(const std::vector<std::string>& args);
int RunBench(const std::vector<std::string>& args);
int RunSoak(const std::vector<std::string>& args);

}  // namespace kvc::ctl

#endif  // KVC_CLIENT_KVCCTL_KVCCTL_H_

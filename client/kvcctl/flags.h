// kvcctl's per-subcommand view of its flags. The flags themselves are Abseil flags (ABSL_FLAG in
// flag_defs.cc, the library kvcd uses): their types, defaults, help and value parsing come from
// there. A FlagSet lists which of them a subcommand accepts and parses that subcommand's
// arguments: "--name=value", "--name value", and "--name" / "--noname" for booleans; "--help"
// (or -h) asks for the subcommand's help. Errors (a flag the subcommand does not take, a missing
// or malformed value) are INVALID_ARGUMENT naming the flag; kvcctl turns them into exit code 2.
//
// Not thread-safe: parse once, on the main thread, before starting workers; getters are then
// safe from any thread.
#ifndef KVC_CLIENT_KVCCTL_FLAGS_H_
#define KVC_CLIENT_KVCCTL_FLAGS_H_

#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvc::ctl {

class FlagSet {
 public:
  // Accepts the flag `name` (defined in flag_defs.cc; an undefined name aborts: a bug here).
  void Use(const std::string& name);

  // Parses args (flags and positionals mixed; "--" ends flags); returns the positionals.
  absl::StatusOr<std::vector<std::string>> Parse(const std::vector<std::string>& args);

  // Values of accepted flags (the getter must match the flag's type; a mismatch aborts).
  std::string GetString(const std::string& name) const;
  int64_t GetInt(const std::string& name) const;
  double GetDouble(const std::string& name) const;
  bool GetBool(const std::string& name) const;  // "help": whether --help was given
  bool WasSet(const std::string& name) const;

  // "  --name=<default>  help" lines, in the order of Use.
  std::string Help() const;

 private:
  absl::CommandLineFlag& Flag(const std::string& name) const;

  std::vector<std::string> order_;
  std::set<std::string> accepted_, set_;
  bool help_ = false;
};

}  // namespace kvc::ctl

#endif  // KVC_CLIENT_KVCCTL_FLAGS_H_

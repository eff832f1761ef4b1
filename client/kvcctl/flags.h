// A small per-subcommand flag parser for kvcctl: "--name=value", "--name value", and "--name" /
// "--noname" for booleans. Every flag is declared with its help text, so usage lines come from
// the same table that parses. Errors (unknown flag, missing or malformed value) are
// INVALID_ARGUMENT naming the flag; kvcctl turns them into exit code 2.
#ifndef KVC_CLIENT_KVCCTL_FLAGS_H_
#define KVC_CLIENT_KVCCTL_FLAGS_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace kvc::ctl {

class FlagSet {
 public:
  void AddString(const std::string& name, const std::string& def, const std::string& help);
  void AddInt(const std::string& name, int64_t def, const std::string& help);
  void AddDouble(const std::string& name, double def, const std::string& help);
  void AddBool(const std::string& name, bool def, const std::string& help);

  // Parses args (flags and positionals mixed; "--" ends flags); returns the positionals.
  absl::StatusOr<std::vector<std::string>> Parse(const std::vector<std::string>& args);

  std::string GetString(const std::string& name) const;
  int64_t GetInt(const std::string& name) const;
  double GetDouble(const std::string& name) const;
  bool GetBool(const std::string& name) const;
  bool WasSet(const std::string& name) const;

  // "  --name=<default>  help" lines.
  std::string Help() const;

 private:
  enum class Type { kString, kInt, kDouble, kBool };
  struct Flag {
    Type type;
    std::string value;  // textual, validated on Parse
    std::string help;
    bool set = false;
  };
  absl::Status Set(const std::string& name, Flag& flag, const std::string& value);
  const Flag& Get(const std::string& name, Type type) const;

  std::map<std::string, Flag> flags_;
  std::vector<std::string> order_;
};

}  // namespace kvc::ctl

#endif  // KVC_CLIENT_KVCCTL_FLAGS_H_

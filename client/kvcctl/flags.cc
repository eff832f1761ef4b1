#include "flags.h"

#include <cstdlib>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/types/optional.h"
#include "kvc/policy.h"

namespace kvc::ctl {
namespace {

// A programming error in kvcctl itself (an undefined flag, a getter of the wrong type), never
// user input.
[[noreturn]] void Bug() { std::abort(); }

template <typename T>
T Value(const absl::CommandLineFlag& flag) {
  absl::optional<T> v = flag.TryGet<T>();
  if (!v.has_value()) Bug();
  return *std::move(v);
}

}  // namespace

absl::CommandLineFlag& FlagSet::Flag(const std::string& name) const {
  absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
  if (flag == nullptr) Bug();
  return *flag;
}

void FlagSet::Use(const std::string& name) {
  Flag(name);
  if (accepted_.insert(name).second) order_.push_back(name);
}

absl::StatusOr<std::vector<std::string>> FlagSet::Parse(const std::vector<std::string>& args) {
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      positional.insert(positional.end(), args.begin() + i + 1, args.end());
      break;
    }
    if (a == "--help" || a == "-h") {
      help_ = true;
      continue;
    }
    if (a.size() < 3 || a[0] != '-' || a[1] != '-') {
      if (a.size() > 1 && a[0] == '-') {
        return absl::InvalidArgumentError(absl::StrCat("unknown flag '", a, "' (flags use --)"));
      }
      positional.push_back(a);
      continue;
    }
    std::string name = a.substr(2);
    std::string value;
    bool has_value = false;
    if (const size_t eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
      has_value = true;
    }
    if (!accepted_.count(name) && !has_value && name.rfind("no", 0) == 0 &&
        accepted_.count(name.substr(2)) && Flag(name.substr(2)).IsOfType<bool>()) {
      name = name.substr(2);
      value = "false";
      has_value = true;
    }
    if (!accepted_.count(name)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    }
    absl::CommandLineFlag& flag = Flag(name);
    if (!has_value) {
      if (flag.IsOfType<bool>()) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
      }
    }
    std::string error;
    if (!flag.ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", error));
    }
    set_.insert(name);
  }
  return positional;
}

std::string FlagSet::GetString(const std::string& name) const {
  return Value<std::string>(Flag(name));
}
int64_t FlagSet::GetInt(const std::string& name) const { return Value<int64_t>(Flag(name)); }
double FlagSet::GetDouble(const std::string& name) const { return Value<double>(Flag(name)); }
bool FlagSet::GetBool(const std::string& name) const {
  if (name == "help") return help_;
  return Value<bool>(Flag(name));
}
bool FlagSet::WasSet(const std::string& name) const { return set_.count(name) > 0; }

std::string FlagSet::Help() const {
  std::string out;
  for (const std::string& name : order_) {
    const absl::CommandLineFlag& f = Flag(name);
    const std::string def = f.DefaultValue();
    std::string left = absl::StrCat("  --", name, "=", def.empty() ? "\"\"" : def);
    if (left.size() < 30) left.resize(30, ' ');
    absl::StrAppend(&out, left, " ", f.Help(), "\n");
  }
  absl::StrAppend(&out, "  --help                       show this help\n");
  if (accepted_.count("policy") > 0) {
    std::vector<std::string> names;
    for (const PolicyInfo& row : kPolicies) names.emplace_back(row.name);
    absl::StrAppend(&out, "eviction policies (--policy): ", absl::StrJoin(names, ", "), "\n");
  }
  return out;
}

}  // namespace kvc::ctl

#include "flags.h"

#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace kvc::ctl {

void FlagSet::AddString(const std::string& name, const std::string& def, const std::string& help) {
  flags_[name] = Flag{Type::kString, def, help};
  order_.push_back(name);
}
void FlagSet::AddInt(const std::string& name, int64_t def, const std::string& help) {
  flags_[name] = Flag{Type::kInt, std::to_string(def), help};
  order_.push_back(name);
}
void FlagSet::AddDouble(const std::string& name, double def, const std::string& help) {
  flags_[name] = Flag{Type::kDouble, absl::StrCat(def), help};
  order_.push_back(name);
}
void FlagSet::AddBool(const std::string& name, bool def, const std::string& help) {
  flags_[name] = Flag{Type::kBool, def ? "true" : "false", help};
  order_.push_back(name);
}

absl::Status FlagSet::Set(const std::string& name, Flag& flag, const std::string& value) {
  switch (flag.type) {
    case Type::kString:
      break;
    case Type::kInt: {
      int64_t v;
      if (!absl::SimpleAtoi(value, &v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": '", value, "' is not an integer"));
      }
      break;
    }
    case Type::kDouble: {
      double v;
      if (!absl::SimpleAtod(value, &v)) {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": '", value, "' is not a number"));
      }
      break;
    }
    case Type::kBool:
      if (value != "true" && value != "false") {
        return absl::InvalidArgumentError(
            absl::StrCat("--", name, ": '", value, "' is not true or false"));
      }
      break;
  }
  flag.value = value;
  flag.set = true;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> FlagSet::Parse(const std::vector<std::string>& args) {
  std::vector<std::string> positional;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--") {
      positional.insert(positional.end(), args.begin() + i + 1, args.end());
      break;
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
    auto it = flags_.find(name);
    if (it == flags_.end() && !has_value && name.rfind("no", 0) == 0) {
      auto neg = flags_.find(name.substr(2));
      if (neg != flags_.end() && neg->second.type == Type::kBool) {
        neg->second.value = "false";
        neg->second.set = true;
        continue;
      }
    }
    if (it == flags_.end())
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name));
    if (!has_value) {
      if (it->second.type == Type::kBool) {
        value = "true";
      } else if (i + 1 < args.size()) {
        value = args[++i];
      } else {
        return absl::InvalidArgumentError(absl::StrCat("--", name, ": missing value"));
      }
    }
    if (absl::Status s = Set(name, it->second, value); !s.ok()) return s;
  }
  return positional;
}

const FlagSet::Flag& FlagSet::Get(const std::string& name, Type type) const {
  auto it = flags_.find(name);
  if (it == flags_.end() || it->second.type != type) {
    // A programming error in kvcctl itself, never user input.
    std::abort();
  }
  return it->second;
}

std::string FlagSet::GetString(const std::string& name) const {
  return Get(name, Type::kString).value;
}
int64_t FlagSet::GetInt(const std::string& name) const {
  int64_t v = 0;
  (void)absl::SimpleAtoi(Get(name, Type::kInt).value, &v);
  return v;
}
double FlagSet::GetDouble(const std::string& name) const {
  double v = 0;
  (void)absl::SimpleAtod(Get(name, Type::kDouble).value, &v);
  return v;
}
bool FlagSet::GetBool(const std::string& name) const {
  return Get(name, Type::kBool).value == "true";
}
bool FlagSet::WasSet(const std::string& name) const {
  auto it = flags_.find(name);
  return it != flags_.end() && it->second.set;
}

std::string FlagSet::Help() const {
  std::string out;
  for (const std::string& name : order_) {
    const Flag& f = flags_.at(name);
    std::string left = absl::StrCat("  --", name, "=", f.value.empty() ? "\"\"" : f.value);
    if (left.size() < 30) left.resize(30, ' ');
    absl::StrAppend(&out, left, " ", f.help, "\n");
  }
  return out;
}

}  // namespace kvc::ctl

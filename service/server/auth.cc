#include "server/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvc::server {
namespace {

bool ValidTenant(const std::string& t) {
  if (t.empty() || t.size() > 64) return false;
  for (char c : t) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') {
      return false;
    }
  }
  return true;
}

bool ValidToken(const std::string& t) {
  if (t.size() < 8 || t.size() > 512) return false;
  for (char c : t) {
    if (!absl::ascii_isgraph(static_cast<unsigned char>(c))) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::Load(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth_tokens_file: cannot read ", path));
  std::stringstream buf;
  buf << in.rdbuf();
  return Parse(buf.str());
}

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::Parse(const std::string& contents) {
  std::unique_ptr<TokenAuth> auth(new TokenAuth());
  int line_no = 0;
  for (absl::string_view raw : absl::StrSplit(contents, '\n')) {
    ++line_no;
    const std::string line(absl::StripAsciiWhitespace(raw));
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> fields = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    // Never echo a token into an error message.
    if (fields.size() != 2) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_tokens_file: line ", line_no, ": expected 'TOKEN TENANT'"));
    }
    if (!ValidToken(fields[0])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--auth_tokens_file: line ", line_no, ": token must be 8..512 printable characters"));
    }
    if (!ValidTenant(fields[1])) {
      return absl::InvalidArgumentError(absl::StrCat("--auth_tokens_file: line ", line_no,
                                                     ": tenant '", fields[1],
                                                     "' is not 1..64 bytes of [A-Za-z0-9._-]"));
    }
    if (!auth->tenants_.emplace(fields[0], fields[1]).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("--auth_tokens_file: line ", line_no, ": duplicate token"));
    }
  }
  if (auth->tenants_.empty()) {
    return absl::InvalidArgumentError("--auth_tokens_file: no tokens");
  }
  return auth;
}

absl::StatusOr<std::string> TokenAuth::Authenticate(const grpc::ServerContextBase& context) const {
  const auto& md = context.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return absl::UnauthenticatedError("authorization: missing 'Bearer TOKEN' metadata");
  }
  const std::string value(it->second.data(), it->second.size());
  constexpr absl::string_view kBearer = "Bearer ";
  if (value.size() <= kBearer.size() || value.compare(0, kBearer.size(), kBearer.data()) != 0) {
    return absl::UnauthenticatedError("authorization: expected 'Bearer TOKEN'");
  }
  auto tenant = tenants_.find(value.substr(kBearer.size()));
  if (tenant == tenants_.end()) return absl::UnauthenticatedError("authorization: unknown token");
  return absl::StrCat(tenant->second, "/");
}

}  // namespace kvc::server

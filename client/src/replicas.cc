#include "kvc/replicas.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <xxhash.h>

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace kvc {
namespace {

std::vector<std::string> SortedUnique(std::vector<std::string> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

absl::StatusOr<std::vector<std::string>> ResolveDns(const std::string& name_port) {
  // "host:port" or "[v6]:port"; the port is required so every replica address is complete.
  std::string host, port;
  if (!name_port.empty() && name_port[0] == '[') {
    const size_t close = name_port.find(']');
    if (close == std::string::npos || close + 1 >= name_port.size() ||
        name_port[close + 1] != ':') {
      return absl::InvalidArgumentError(absl::StrCat("target: bad address '", name_port, "'"));
    }
    host = name_port.substr(1, close - 1);
    port = name_port.substr(close + 2);
  } else {
    const size_t colon = name_port.rfind(':');
    if (colon == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("target: '", name_port, "' needs a port (dns:///name:port)"));
    }
    host = name_port.substr(0, colon);
    port = name_port.substr(colon + 1);
  }
  if (host.empty() || port.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("target: bad address '", name_port, "'"));
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const int rc = getaddrinfo(host.c_str(), port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("target: cannot resolve '", host, "': ", gai_strerror(rc)));
  }
  std::vector<std::string> out;
  for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
      out.push_back(absl::StrCat(ip, ":", port));
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip, sizeof(ip));
      out.push_back(absl::StrCat("[", ip, "]:", port));
    }
  }
  freeaddrinfo(res);
  if (out.empty()) {
    return absl::UnavailableError(absl::StrCat("target: '", host, "' has no addresses"));
  }
  return SortedUnique(std::move(out));
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ResolveTarget(const std::string& target) {
  const std::string t(absl::StripAsciiWhitespace(target));
  if (t.empty()) return absl::InvalidArgumentError("target: empty");
  if (absl::StartsWith(t, "dns:///")) return ResolveDns(t.substr(7));
  if (absl::StartsWith(t, "dns://")) {
    return absl::InvalidArgumentError(
        absl::StrCat("target: '", t, "': a DNS authority is not supported, use dns:///name:port"));
  }
  if (t.find(',') == std::string::npos) return std::vector<std::string>{t};
  std::vector<std::string> out;
  for (absl::string_view part : absl::StrSplit(t, ',')) {
    const absl::string_view entry = absl::StripAsciiWhitespace(part);
    if (entry.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("target: empty entry in list '", t, "'"));
    }
    out.emplace_back(entry);
  }
  return SortedUnique(std::move(out));
}

uint64_t RendezvousWeight(absl::string_view cache_id, absl::string_view replica) {
  // Hashing the address first (instead of concatenating) keeps the per-replica seed independent
  // of the id length, so no (id, replica) pair can collide with another by shifting bytes.
  const uint64_t seed = XXH3_64bits(replica.data(), replica.size());
  return XXH3_64bits_withSeed(cache_id.data(), cache_id.size(), seed);
}

size_t RendezvousOwner(absl::string_view cache_id, absl::Span<const std::string> replicas) {
  size_t best = 0;
  uint64_t best_weight = 0;
  for (size_t i = 0; i < replicas.size(); ++i) {
    const uint64_t w = RendezvousWeight(cache_id, replicas[i]);
    if (i == 0 || w > best_weight || (w == best_weight && replicas[i] < replicas[best])) {
      best = i;
      best_weight = w;
    }
  }
  return best;
}

}  // namespace kvc

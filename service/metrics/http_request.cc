#include "metrics/http_request.h"

#include "absl/strings/str_cat.h"

namespace kvc {
namespace {

// RFC 9110 tchar.
bool IsTokenChar(char c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return c != '\0' && std::string_view("!#$%&'*+-.^_`|~").find(c) != std::string_view::npos;
}

bool IsToken(std::string_view s) {
  if (s.empty()) return false;
  for (char c : s) {
    if (!IsTokenChar(c)) return false;
  }
  return true;
}

// Visible ASCII: what a request target may hold (no spaces, controls or non-ASCII bytes).
bool IsVisible(char c) { return c > 0x20 && c < 0x7f; }

// Field values: visible ASCII, space, tab and obs-text (bytes >= 0x80); no other controls.
bool IsFieldValueChar(char c) {
  const auto u = static_cast<unsigned char>(c);
  return u == '\t' || (u >= 0x20 && u != 0x7f);
}

absl::Status Bad(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("http request: ", std::string(what)));
}

// Splits off the next line of `rest` (without its CRLF or LF); false when no line end is left.
bool NextLine(std::string_view& rest, std::string_view& line) {
  const size_t lf = rest.find('\n');
  if (lf == std::string_view::npos) return false;
  line = rest.substr(0, lf);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  rest.remove_prefix(lf + 1);
  return true;
}

}  // namespace

size_t HttpHeadLength(std::string_view data) {
  // The head ends at the first empty line: "\n\n" or "\n\r\n" (CRLF or bare LF line ends).
  for (size_t i = data.find('\n'); i != std::string_view::npos; i = data.find('\n', i + 1)) {
    if (i + 1 < data.size() && data[i + 1] == '\n') return i + 2;
    if (i + 2 < data.size() && data[i + 1] == '\r' && data[i + 2] == '\n') return i + 3;
  }
  return std::string_view::npos;
}

absl::StatusOr<HttpRequest> ParseHttpRequest(std::string_view head) {
  const size_t length = HttpHeadLength(head);
  if (length == std::string_view::npos) return Bad("the head does not end with an empty line");
  if (length > kMaxHttpRequestHeadBytes) {
    return Bad(absl::StrCat("the head is ", length, " bytes, over ", kMaxHttpRequestHeadBytes));
  }
  std::string_view rest = head.substr(0, length);
  std::string_view line;
  NextLine(rest, line);
  // RFC 9112 2.2: a server should ignore empty lines before the request line.
  while (line.empty()) {
    if (!NextLine(rest, line)) return Bad("no request line");
  }

  const size_t sp1 = line.find(' ');
  const size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != std::string_view::npos) {
    return Bad("the request line is not METHOD SP target SP version");
  }
  const std::string_view method = line.substr(0, sp1);
  const std::string_view target = line.substr(sp1 + 1, sp2 - sp1 - 1);
  const std::string_view version = line.substr(sp2 + 1);
  if (!IsToken(method)) return Bad("the method is not a token");
  if (target.empty() || target.front() != '/') return Bad("the target does not start with '/'");
  for (char c : target) {
    if (!IsVisible(c)) return Bad("the target holds a space, control or non-ASCII byte");
  }
  HttpRequest r;
  if (version == "HTTP/1.1") {
    r.minor_version = 1;
  } else if (version == "HTTP/1.0") {
    r.minor_version = 0;
  } else {
    return Bad("the version is not HTTP/1.0 or HTTP/1.1");
  }
  r.method = std::string(method);
  r.path = std::string(target.substr(0, target.find('?')));

  while (NextLine(rest, line) && !line.empty()) {
    if (line.front() == ' ' || line.front() == '\t') return Bad("obsolete line folding");
    const size_t colon = line.find(':');
    if (colon == std::string_view::npos) return Bad("a header line has no colon");
    if (!IsToken(line.substr(0, colon))) return Bad("a header name is not a token");
    for (char c : line.substr(colon + 1)) {
      if (!IsFieldValueChar(c)) return Bad("a header value holds a control character");
    }
  }
  return r;
}

}  // namespace kvc

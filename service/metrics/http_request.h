// The request parser of kvcd's metrics endpoint (metrics/http_exposer.h), a pure function so it
// can be unit-tested and fuzzed apart from the sockets.
//
// Accepts the head of an HTTP/1.0 or HTTP/1.1 request (RFC 9112): a request line
// "METHOD SP request-target SP HTTP/1.x", then header fields "name: value", each line ended by
// CRLF (a bare LF is tolerated), then an empty line. Anything after the empty line is ignored
// (a scrape has no body). Thread-safe (no state).
#ifndef KVC_SERVICE_METRICS_HTTP_REQUEST_H_
#define KVC_SERVICE_METRICS_HTTP_REQUEST_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"

namespace kvc {

inline constexpr size_t kMaxHttpRequestHeadBytes = 16 * 1024;

struct HttpRequest {
  std::string method;     // e.g. "GET"
  std::string path;       // the request target without its query, e.g. "/metrics"
  int minor_version = 1;  // HTTP/1.<minor_version>
};

// The length of the request head in `data` (through its empty line), or std::string_view::npos
// while the empty line has not arrived.
size_t HttpHeadLength(std::string_view data);

// Parses a request head (HttpHeadLength bytes, or more: the rest is ignored). INVALID_ARGUMENT
// saying what is wrong for an incomplete head, a malformed request line (method not a token,
// target not origin-form "/...", version not HTTP/1.0 or 1.1), a malformed header line (no
// colon, a name that is not a token, a control character in a value, an obsolete folded line)
// or a head longer than kMaxHttpRequestHeadBytes.
absl::StatusOr<HttpRequest> ParseHttpRequest(std::string_view head);

}  // namespace kvc

#endif  // KVC_SERVICE_METRICS_HTTP_REQUEST_H_

// libFuzzer harness for the metrics endpoint's request parser (service/metrics/http_request.h).
// It checks the parser's own invariants besides memory safety: a head it accepts is complete, no
// longer than the limit, and yields a token method and an origin-form path.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "metrics/http_request.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t head = kvc::HttpHeadLength(input);
  if (head != std::string_view::npos && head > size) std::abort();
  absl::StatusOr<kvc::HttpRequest> r = kvc::ParseHttpRequest(input);
  if (!r.ok()) return 0;
  if (head == std::string_view::npos || head > kvc::kMaxHttpRequestHeadBytes) std::abort();
  if (r->method.empty() || r->path.empty() || r->path.front() != '/') std::abort();
  if (r->path.find('?') != std::string::npos) std::abort();
  if (r->minor_version != 0 && r->minor_version != 1) std::abort();
  // Parsing only the head gives the same answer as parsing it with whatever followed.
  absl::StatusOr<kvc::HttpRequest> again = kvc::ParseHttpRequest(input.substr(0, head));
  if (!again.ok() || again->method != r->method || again->path != r->path) std::abort();
  return 0;
}

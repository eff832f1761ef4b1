#include "server/convert.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace kvc::server {

grpc::Status ToGrpc(const absl::Status& s, absl::string_view ns) {
  if (s.ok() || ns.empty()) return ToGrpc(s);
  return ToGrpcStatus(
      absl::Status(s.code(), absl::StrReplaceAll(s.message(), {{absl::StrCat("'", ns), "'"}})));
}

}  // namespace kvc::server

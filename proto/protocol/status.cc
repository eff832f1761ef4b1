#include "kvc/protocol/status.h"

#include <string>

namespace kvc {
namespace {

// absl::StatusCode and grpc::StatusCode share their values 0 (OK) to 16 (UNAUTHENTICATED).
constexpr int kLastCode = 16;

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  const int code = static_cast<int>(status.code());
  return grpc::Status(
      static_cast<grpc::StatusCode>(code >= 0 && code <= kLastCode ? code : grpc::UNKNOWN),
      std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  const int code = static_cast<int>(status.error_code());
  return absl::Status(
      static_cast<absl::StatusCode>(
          code >= 0 && code <= kLastCode ? code : static_cast<int>(absl::StatusCode::kUnknown)),
      status.error_message());
}

}  // namespace kvc

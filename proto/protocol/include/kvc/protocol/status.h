// The one conversion between absl::Status (everything inside kvc) and grpc::Status (the RPC
// boundary). The codes have the same numbers in both; a code outside them becomes UNKNOWN.
//
// Thread-safety: pure functions.
#ifndef KVC_PROTOCOL_STATUS_H_
#define KVC_PROTOCOL_STATUS_H_

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace kvc {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace kvc

#endif  // KVC_PROTOCOL_STATUS_H_

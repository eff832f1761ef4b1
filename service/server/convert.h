// The proto <-> engine mapping shared with the clients (kvc/protocol/convert.h) and the engine's
// size arithmetic, re-exported under the names kvcd's handlers and tests use, and the status
// conversion at the RPC boundary with tenant ids hidden.
#ifndef KVC_SERVICE_SERVER_CONVERT_H_
#define KVC_SERVICE_SERVER_CONVERT_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"
#include "kvc/compact.h"
#include "kvc/layer.h"
#include "kvc/protocol/convert.h"
#include "kvc/protocol/status.h"

namespace kvc::server {

// The mapping (kvc/protocol/convert.h) and the engine's size arithmetic (kvc/layer.h,
// kvc/compact.h), as kvcd's handlers and tests name them.
using ::kvc::EstimateStoredBytes;
using ::kvc::FromProto;
using ::kvc::kMaxCacheIdBytes;
using ::kvc::LayerBytes;
using ::kvc::LayerTensorBytes;
using ::kvc::ShapeFromProto;
using ::kvc::SpecFromProto;
using ::kvc::ToProto;
using ::kvc::UploadBytes;
using ::kvc::ValidateCacheId;

// absl -> grpc (kvc::ToGrpcStatus).
inline grpc::Status ToGrpc(const absl::Status& status) { return ToGrpcStatus(status); }
// ToGrpc for a caller whose store ids carry the tenant prefix `ns` (ServiceState::Namespace):
// the store quotes ids as 'ID', and the caller is shown its own id, never the store's
// tenant-qualified form ('ns' + ID becomes 'ID'). With an empty `ns` it is ToGrpc(status).
grpc::Status ToGrpc(const absl::Status& status, absl::string_view ns);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_CONVERT_H_

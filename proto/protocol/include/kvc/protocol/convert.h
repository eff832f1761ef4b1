// Conversions between the wire contract (kvcache.v1) and the engine's types, with validation.
// Every error is INVALID_ARGUMENT and names the proto field, e.g. "header.shape.head_dim: ...".
#ifndef KVC_SERVICE_SERVER_CONVERT_H_
#define KVC_SERVICE_SERVER_CONVERT_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/status.h"
#include "kvc/dtype.h"
#include "kvc/layer.h"
#include "kvc/spec.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc::server {

inline constexpr size_t kMaxCacheIdBytes = 256;

// 1..256 bytes of [A-Za-z0-9._:/-].
absl::Status ValidateCacheId(const std::string& field, const std::string& id);

absl::StatusOr<DType> FromProto(kvcache::v1::DType dtype);
kvcache::v1::DType ToProto(DType dtype);
absl::StatusOr<Layout> FromProto(kvcache::v1::Layout layout);

// The per-layer shape; num_layers is checked separately. Runs kvc::ValidateShape.
absl::StatusOr<LayerShape> ShapeFromProto(const kvcache::v1::ModelShape& shape);

// Maps the proto config onto kvc::CompressionSpec, unset optional fields keeping the engine's
// defaults, then runs kvc::ValidateSpec for every layer of `shape`.
absl::StatusOr<CompressionSpec> SpecFromProto(const kvcache::v1::CompressionConfig& config,
                                              const LayerShape& shape, int num_layers);

// Byte sizes of one layer's tensors. Overflow-checked (kvc/checked_math.h): INVALID_ARGUMENT
// naming the product when a size does not fit in 64 bits (never for a shape ShapeFromProto
// accepted).
// q_stats: the TENSOR_Q_STATS bytes (float32 [Hq, D + D * D]) when `query_stats`, else 0.
struct LayerBytes {
  uint64_t k = 0, v = 0, q_obs = 0, q_stats = 0;
};
absl::StatusOr<LayerBytes> LayerTensorBytes(const LayerShape& shape, DType dtype,
                                            bool query_stats = false);

// K + V + Q_obs (+ Q_stats) bytes of all `num_layers` layers, overflow-checked like
// LayerTensorBytes.
absl::StatusOr<uint64_t> UploadBytes(const LayerShape& shape, DType dtype, int num_layers,
                                     bool query_stats = false);

// Lower bound on the compact size of the whole cache (blob headers, kept tokens, kept channels,
// quantized sizes; scales ignored): used only to reject uploads that can never fit. Computed in
// checked integer arithmetic: INVALID_ARGUMENT naming the product when it does not fit in 64 bits
// (never for a shape ShapeFromProto accepted with num_layers <= 4096).
absl::StatusOr<uint64_t> EstimateStoredBytes(const LayerShape& shape, DType dtype,
                                             const CompressionSpec& spec, int num_layers);

grpc::Status ToGrpc(const absl::Status& status);
// ToGrpc for a caller whose store ids carry the tenant prefix `ns` (ServiceState::Namespace):
// the store quotes ids as 'ID', and the caller is shown its own id, never the store's
// tenant-qualified form ('ns' + ID becomes 'ID'). With an empty `ns` it is ToGrpc(status).
grpc::Status ToGrpc(const absl::Status& status, absl::string_view ns);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_CONVERT_H_

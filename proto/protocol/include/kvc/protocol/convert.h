// The one mapping between the wire contract (kvcache.v1) and the engine's types, used by kvcd, the
// C++ client, kvcctl and kvcfidelity. Errors are INVALID_ARGUMENT and name the proto field as kvcd
// reports it for a PutCache header, e.g. "header.shape.head_dim: ...".
//
// Thread-safety: pure functions.
#ifndef KVC_PROTOCOL_CONVERT_H_
#define KVC_PROTOCOL_CONVERT_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvc/dtype.h"
#include "kvc/layer.h"
#include "kvc/rope.h"
#include "kvc/spec.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc {

inline constexpr size_t kMaxCacheIdBytes = 256;
inline constexpr int kMaxLayers = 4096;

// 1..256 bytes of [A-Za-z0-9._:/-] (PutCacheHeader.cache_id); the error names `field`.
absl::Status ValidateCacheId(const std::string& field, const std::string& id);

// A PutCacheHeader in the engine's types, every field checked by the engine: what kvcd works
// from once the header is accepted.
struct UploadHeader {
  int num_layers = 0;
  LayerShape shape;  // ValidateShape passed
  DType dtype = DType::kF16;
  Layout layout = Layout::kHND;
  CompressionSpec spec;            // ValidateSpec passed for every layer
  std::optional<RopeParams> rope;  // header.rope when set (ValidateRope passed)
};
// Checks and maps, in this order: cache_id, shape.num_layers in [1, kMaxLayers], the shape,
// dtype, layout, compression (SpecFromProto against the shape) and rope (RopeFromProto; required
// by a policy that reads query statistics). INVALID_ARGUMENT naming the field ("header.shape...",
// "header.rope.style...").
absl::StatusOr<UploadHeader> HeaderFromProto(const kvcache::v1::PutCacheHeader& header);

absl::StatusOr<DType> FromProto(kvcache::v1::DType dtype);
kvcache::v1::DType ToProto(DType dtype);
absl::StatusOr<Layout> FromProto(kvcache::v1::Layout layout);  // unspecified = HND
kvcache::v1::Layout ToProto(Layout layout);

// The per-layer shape; num_layers is checked separately. Runs kvc::ValidateShape (obs_window may
// exceed seq_len only with `rows_after_context`: the kvzip policy).
absl::StatusOr<LayerShape> ShapeFromProto(const kvcache::v1::ModelShape& shape,
                                          bool rows_after_context = false);
kvcache::v1::ModelShape ShapeToProto(const LayerShape& shape, int num_layers);

// Maps the proto config onto kvc::CompressionSpec, unset optional fields keeping the engine's
// defaults. Checks only what the engine's types cannot hold (an unknown name, an integer above
// 2^30), naming the field after `field_prefix` (e.g. "header.compression."); ValidateSpec
// checks the rest against a shape.
absl::StatusOr<CompressionSpec> SpecFromProto(const kvcache::v1::CompressionConfig& config,
                                              absl::string_view field_prefix);
// The mapping, then kvc::ValidateSpec for every layer of `shape`, errors named
// "header.compression.<field>"; more layer_budgets than layers, or more pass_rows than seq_len,
// are refused before anything is copied.
absl::StatusOr<CompressionSpec> SpecFromProto(const kvcache::v1::CompressionConfig& config,
                                              const LayerShape& shape, int num_layers);
// Every field set explicitly, except recent_fraction when it is negative (the policy's default),
// which is left absent. SpecFromProto(SpecToProto(s)) == s for every spec ValidateSpec accepts.
kvcache::v1::CompressionConfig SpecToProto(const CompressionSpec& spec);

// What a request's RoPE is for; the messages say what it is needed for.
enum class RopeUse {
  kPutHeader,   // PutCacheHeader.rope: expected attention's query statistics
  kContiguous,  // GetCacheRequest.rope: FORMAT_DENSE_CONTIGUOUS
};
// The RoPE a request declares (PutCache's header.rope, GetCache's rope for DENSE_CONTIGUOUS).
// INVALID_ARGUMENT names a missing or bad field ("rope.style: ..."), or the ValidateRope error;
// values are quoted as sent (no narrowing: a rotary_dims of 4294967294 is quoted as that).
// DYNAMIC_NTK (frequencies that depend on the sequence length) cannot be rotated exactly to other
// positions: FAILED_PRECONDITION for kContiguous (fetch FORMAT_DENSE instead), INVALID_ARGUMENT
// for kPutHeader (send NONE or LINEAR scaling).
absl::StatusOr<RopeParams> RopeFromProto(const kvcache::v1::RopeSpec& rope, int head_dim,
                                         RopeUse use);
kvcache::v1::RopeSpec RopeToProto(const RopeParams& rope);

}  // namespace kvc

#endif  // KVC_PROTOCOL_CONVERT_H_

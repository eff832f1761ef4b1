#include "server/convert.h"

#include <algorithm>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "kvc/checked_math.h"
#include "kvc/compact.h"
#include "kvc/status_macros.h"

namespace kvc::server {
namespace {

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// Prefixes an engine error with the proto message path.
absl::Status Qualify(const absl::Status& s, const std::string& prefix) {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(prefix, std::string(s.message())));
}

}  // namespace

absl::Status ValidateCacheId(const std::string& field, const std::string& id) {
  if (id.empty() || id.size() > kMaxCacheIdBytes) {
    return Invalid(field,
                   absl::StrCat("length ", id.size(), " is outside [1, ", kMaxCacheIdBytes, "]"));
  }
  for (char c : id) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '.' || c == '_' || c == ':' || c == '/' || c == '-';
    if (!ok) {
      return Invalid(field, absl::StrCat("character 0x", absl::Hex(static_cast<uint8_t>(c)),
                                         " is not in [A-Za-z0-9._:/-]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DType> FromProto(kvcache::v1::DType dtype) {
  switch (dtype) {
    case kvcache::v1::DTYPE_F32:
      return DType::kF32;
    case kvcache::v1::DTYPE_F16:
      return DType::kF16;
    case kvcache::v1::DTYPE_BF16:
      return DType::kBF16;
    default:
      return Invalid("header.dtype",
                     absl::StrCat("value ", static_cast<int>(dtype), " is not F32, F16 or BF16"));
  }
}

kvcache::v1::DType ToProto(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return kvcache::v1::DTYPE_F32;
    case DType::kF16:
      return kvcache::v1::DTYPE_F16;
    case DType::kBF16:
      return kvcache::v1::DTYPE_BF16;
  }
  return kvcache::v1::DTYPE_UNSPECIFIED;
}

absl::StatusOr<Layout> FromProto(kvcache::v1::Layout layout) {
  switch (layout) {
    case kvcache::v1::LAYOUT_UNSPECIFIED:
    case kvcache::v1::LAYOUT_HND:
      return Layout::kHND;
    case kvcache::v1::LAYOUT_NHD:
      return Layout::kNHD;
    default:
      return Invalid("header.layout",
                     absl::StrCat("value ", static_cast<int>(layout), " is not HND or NHD"));
  }
}

absl::StatusOr<LayerShape> ShapeFromProto(const kvcache::v1::ModelShape& p) {
  // Values above INT32_MAX would wrap in the engine's int fields.
  const uint32_t fields[] = {p.num_kv_heads(), p.num_q_heads(), p.head_dim(), p.seq_len(),
                             p.obs_window()};
  const char* names[] = {"num_kv_heads", "num_q_heads", "head_dim", "seq_len", "obs_window"};
  for (int i = 0; i < 5; ++i) {
    if (fields[i] > (1u << 30)) {
      return Invalid(absl::StrCat("header.shape.", names[i]),
                     absl::StrCat(fields[i], " is too large"));
    }
  }
  LayerShape s;
  s.num_kv_heads = static_cast<int>(p.num_kv_heads());
  s.num_q_heads = static_cast<int>(p.num_q_heads());
  s.head_dim = static_cast<int>(p.head_dim());
  s.seq_len = static_cast<int>(p.seq_len());
  s.obs_window = static_cast<int>(p.obs_window());
  RETURN_IF_ERROR(Qualify(ValidateShape(s), "header."));
  return s;
}

absl::StatusOr<CompressionSpec> SpecFromProto(const kvcache::v1::CompressionConfig& c,
                                              const LayerShape& shape, int num_layers) {
  CompressionSpec spec;
  const auto& e = c.eviction();
  auto policy = ParseEvictionPolicy(e.policy().empty() ? "none" : e.policy());
  if (!policy.ok()) {
    return Invalid("header.compression.eviction.policy",
                   absl::StrCat("unknown '", e.policy(), "'"));
  }
  spec.eviction.policy = *policy;
  if (e.budget() > (1u << 30)) return Invalid("header.compression.eviction.budget", "too large");
  spec.eviction.budget = static_cast<int>(e.budget());
  if (e.has_keep_ratio()) spec.eviction.keep_ratio = e.keep_ratio();
  if (e.layer_budgets_size() > num_layers) {
    return Invalid("header.compression.eviction.layer_budgets",
                   absl::StrCat(e.layer_budgets_size(), " entries for ", num_layers, " layers"));
  }
  for (uint32_t b : e.layer_budgets()) {
    if (b > (1u << 30)) return Invalid("header.compression.eviction.layer_budgets", "too large");
    spec.eviction.layer_budgets.push_back(static_cast<int>(b));
  }
  switch (e.granularity()) {
    case kvcache::v1::GRANULARITY_UNSPECIFIED:
    case kvcache::v1::GRANULARITY_PER_HEAD:
      spec.eviction.granularity = Granularity::kPerHead;
      break;
    case kvcache::v1::GRANULARITY_PER_LAYER:
      spec.eviction.granularity = Granularity::kPerLayer;
      break;
    default:
      return Invalid("header.compression.eviction.granularity", "unknown value");
  }
  if (e.has_sink_tokens()) {
    spec.eviction.sink_tokens = static_cast<int>(std::min(e.sink_tokens(), 1u << 30));
  }
  if (e.has_recent_fraction()) spec.eviction.recent_fraction = e.recent_fraction();
  if (e.has_pool_kernel()) {
    spec.eviction.pool_kernel = static_cast<int>(std::min(e.pool_kernel(), 1u << 30));
  }
  if (e.pool().empty() || e.pool() == "max") {
    spec.eviction.pool = PoolKind::kMax;
  } else if (e.pool() == "avg") {
    spec.eviction.pool = PoolKind::kAvg;
  } else {
    return Invalid("header.compression.eviction.pool",
                   absl::StrCat("'", e.pool(), "' is not max or avg"));
  }
  if (e.has_tau()) spec.eviction.tau = e.tau();
  spec.eviction.seed = e.seed();
  spec.eviction.adaptive = e.adaptive();
  if (e.has_adaptive_floor()) spec.eviction.adaptive_floor = e.adaptive_floor();
  auto value_weight = ParseValueWeight(e.value_weight());
  if (!value_weight.ok()) {
    return Invalid("header.compression.eviction.value_weight",
                   absl::StrCat("'", e.value_weight(), "' is not auto, off, mul or add"));
  }
  spec.eviction.value_weight = *value_weight;
  if (e.has_value_eps()) spec.eviction.value_eps = e.value_eps();
  if (e.has_horizon()) {
    if (e.horizon() > (1u << 30))
      return Invalid("header.compression.eviction.horizon", "too large");
    spec.eviction.horizon = static_cast<int>(e.horizon());
  }
  spec.eviction.query_stats = e.query_stats();

  const auto& ch = c.channels();
  auto key_policy = ParseChannelPolicy(ch.key_policy().empty() ? "none" : ch.key_policy());
  if (!key_policy.ok()) {
    return Invalid("header.compression.channels.key_policy",
                   absl::StrCat("unknown '", ch.key_policy(), "'"));
  }
  spec.channels.key_policy = *key_policy;
  spec.channels.key_lambda = ch.key_lambda();
  spec.channels.prune_values = ch.prune_values();
  spec.channels.value_lambda = ch.value_lambda();

  if (c.quant().bits() > 64) return Invalid("header.compression.quant.bits", "too large");
  spec.quant.bits = static_cast<int>(c.quant().bits());
  if (c.quant().has_group_size()) {
    spec.quant.group_size = static_cast<int>(std::min(c.quant().group_size(), 1u << 30));
  }
  if (c.has_recent_tokens()) {
    spec.recent_tokens = static_cast<int>(std::min(c.recent_tokens(), 1u << 30));
  }
  for (int l = 0; l < num_layers; ++l) {
    RETURN_IF_ERROR(Qualify(ValidateSpec(spec, shape, l), "header.compression."));
    // Layers without a per-layer budget share one validation result.
    if (l >= static_cast<int>(spec.eviction.layer_budgets.size())) break;
  }
  return spec;
}

absl::StatusOr<LayerBytes> LayerTensorBytes(const LayerShape& s, DType dtype, bool query_stats) {
  const uint64_t es = DTypeSize(dtype);
  LayerBytes b;
  ASSIGN_OR_RETURN(
      b.k, CheckedProduct("header.shape", {{"num_kv_heads", static_cast<uint64_t>(s.num_kv_heads)},
                                           {"seq_len", static_cast<uint64_t>(s.seq_len)},
                                           {"head_dim", static_cast<uint64_t>(s.head_dim)},
                                           {"dtype_bytes", es}}));
  b.v = b.k;
  ASSIGN_OR_RETURN(b.q_obs, CheckedProduct("header.shape",
                                           {{"num_q_heads", static_cast<uint64_t>(s.num_q_heads)},
                                            {"obs_window", static_cast<uint64_t>(s.obs_window)},
                                            {"head_dim", static_cast<uint64_t>(s.head_dim)},
                                            {"dtype_bytes", es}}));
  if (query_stats) {
    const uint64_t d = static_cast<uint64_t>(s.head_dim);
    ASSIGN_OR_RETURN(
        b.q_stats,
        CheckedProduct("header.shape", {{"num_q_heads", static_cast<uint64_t>(s.num_q_heads)},
                                        {"head_dim+head_dim^2", d + d * d},
                                        {"float_bytes", 4}}));
  }
  return b;
}

absl::StatusOr<uint64_t> UploadBytes(const LayerShape& s, DType dtype, int num_layers,
                                     bool query_stats) {
  ASSIGN_OR_RETURN(const LayerBytes lb, LayerTensorBytes(s, dtype, query_stats));
  const std::optional<uint64_t> kv = CheckedAdd(lb.k, lb.v);
  const std::optional<uint64_t> kvq = kv ? CheckedAdd(*kv, lb.q_obs) : std::nullopt;
  const std::optional<uint64_t> layer = kvq ? CheckedAdd(*kvq, lb.q_stats) : std::nullopt;
  if (!layer) {
    return Invalid("header.shape",
                   absl::StrCat("K + V + Q_obs + Q_stats = ", lb.k, " + ", lb.v, " + ", lb.q_obs,
                                " + ", lb.q_stats, " bytes overflows 64 bits"));
  }
  return CheckedProduct(
      "header.shape", {{"layer_bytes", *layer}, {"num_layers", static_cast<uint64_t>(num_layers)}});
}

absl::StatusOr<uint64_t> EstimateStoredBytes(const LayerShape& s, DType dtype,
                                             const CompressionSpec& spec, int num_layers) {
  const uint64_t es = DTypeSize(dtype);
  const bool pruning = spec.channels.key_policy != ChannelPolicy::kNone;
  const int tk = pruning ? KeptChannels(spec.channels.key_lambda, s.head_dim) : s.head_dim;
  const int tv = spec.channels.prune_values ? KeptChannels(spec.channels.value_lambda, s.head_dim)
                                            : s.head_dim;
  // Quantized elements cost bits/8 bytes, otherwise the dtype size; counted in bits and rounded
  // down per head, and scales are not counted, so this stays a lower bound.
  const uint64_t elem_bits = spec.quant.bits > 0 ? static_cast<uint64_t>(spec.quant.bits) : 8 * es;
  const uint64_t heads = static_cast<uint64_t>(s.num_kv_heads);
  uint64_t total = 0;
  for (int l = 0; l < num_layers; ++l) {
    const uint64_t kept = static_cast<uint64_t>(EffectiveBudget(spec.eviction, l, s.seq_len));
    ASSIGN_OR_RETURN(
        const uint64_t data_bits,
        CheckedProduct("header.shape", {{"kept_tokens", kept},
                                        {"kept_channels", static_cast<uint64_t>(tk + tv)},
                                        {"element_bits", elem_bits}}));
    // Per head: its descriptor, the kept data and one int32 position per kept token. With
    // head-adaptive budgets the heads keep different counts, but H * kept in all, each head at
    // least its count times these per-token bytes: H times a per-head floor stays below that.
    uint64_t per_head = sizeof(HeadDesc) + data_bits / 8;
    uint64_t layer = sizeof(LayerHeader);
    if (!CheckedMulAdd(kept, 4, &per_head) || !CheckedMulAdd(heads, per_head, &layer) ||
        !CheckedMulAdd(1, layer, &total)) {
      return ProductOverflowError("header.shape",
                                  {{"num_kv_heads", heads},
                                   {"stored_bytes_per_head", per_head},
                                   {"num_layers", static_cast<uint64_t>(num_layers)}});
    }
  }
  return total;
}

grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), std::string(s.message()));
}

grpc::Status ToGrpc(const absl::Status& s, absl::string_view ns) {
  if (s.ok() || ns.empty()) return ToGrpc(s);
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()),
                      absl::StrReplaceAll(s.message(), {{absl::StrCat("'", ns), "'"}}));
}

}  // namespace kvc::server

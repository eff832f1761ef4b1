// The proto <-> engine mapping (kvc/protocol/convert.h).
#include "kvc/protocol/convert.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvc/status_macros.h"

namespace kvc {
namespace {

absl::Status Invalid(const std::string& field, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", what));
}

// Counts past this would wrap in the engine's int fields (and exceed any shape).
constexpr uint32_t kMaxCount = 1u << 30;

absl::Status TooLarge(const std::string& field, uint32_t value) {
  return Invalid(field, absl::StrCat(value, " is too large (at most ", kMaxCount, ")"));
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

absl::StatusOr<UploadHeader> HeaderFromProto(const kvcache::v1::PutCacheHeader& h) {
  RETURN_IF_ERROR(ValidateCacheId("header.cache_id", h.cache_id()));
  if (h.shape().num_layers() < 1 || h.shape().num_layers() > kMaxLayers) {
    return Invalid("header.shape.num_layers",
                   absl::StrCat(h.shape().num_layers(), " is outside [1, ", kMaxLayers, "]"));
  }
  UploadHeader out;
  out.num_layers = static_cast<int>(h.shape().num_layers());
  // kvzip's rows come from a reconstruction pass after the prompt: they may outnumber its tokens.
  const auto policy = ParseEvictionPolicy(h.compression().eviction().policy());
  ASSIGN_OR_RETURN(out.shape,
                   ShapeFromProto(h.shape(), policy.ok() && Policy(*policy).rows_after_context));
  ASSIGN_OR_RETURN(out.dtype, FromProto(h.dtype()));
  ASSIGN_OR_RETURN(out.layout, FromProto(h.layout()));
  ASSIGN_OR_RETURN(out.spec, SpecFromProto(h.compression(), out.shape, out.num_layers));
  if (h.has_rope()) {
    absl::StatusOr<RopeParams> rope = RopeFromProto(h.rope(), out.shape.head_dim, RopeUse::kPutHeader);
    if (!rope.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("header.", rope.status().message()));
    }
    out.rope = *rope;
  } else if (Policy(out.spec.eviction.policy).inputs == PolicyInputs::kQueryStatistics) {
    return Invalid("header.rope",
                   absl::StrCat("the ", std::string(PolicyName(out.spec.eviction.policy)),
                                " policy needs the model's RoPE (theta, rotary_dims, "
                                "style)"));
  }
  return out;
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

kvcache::v1::Layout ToProto(Layout layout) {
  return layout == Layout::kNHD ? kvcache::v1::LAYOUT_NHD : kvcache::v1::LAYOUT_HND;
}

absl::StatusOr<LayerShape> ShapeFromProto(const kvcache::v1::ModelShape& p,
                                          bool rows_after_context) {
  // Values above INT32_MAX would wrap in the engine's int fields.
  const uint32_t fields[] = {p.num_kv_heads(), p.num_q_heads(), p.head_dim(), p.seq_len(),
                             p.obs_window()};
  const char* names[] = {"num_kv_heads", "num_q_heads", "head_dim", "seq_len", "obs_window"};
  for (int i = 0; i < 5; ++i) {
    if (fields[i] > kMaxCount) return TooLarge(absl::StrCat("header.shape.", names[i]), fields[i]);
  }
  LayerShape s;
  s.num_kv_heads = static_cast<int>(p.num_kv_heads());
  s.num_q_heads = static_cast<int>(p.num_q_heads());
  s.head_dim = static_cast<int>(p.head_dim());
  s.seq_len = static_cast<int>(p.seq_len());
  s.obs_window = static_cast<int>(p.obs_window());
  RETURN_IF_ERROR(Qualify(ValidateShape(s, rows_after_context), "header."));
  return s;
}

kvcache::v1::ModelShape ShapeToProto(const LayerShape& s, int num_layers) {
  kvcache::v1::ModelShape p;
  p.set_num_layers(static_cast<uint32_t>(num_layers));
  p.set_num_kv_heads(static_cast<uint32_t>(s.num_kv_heads));
  p.set_num_q_heads(static_cast<uint32_t>(s.num_q_heads));
  p.set_head_dim(static_cast<uint32_t>(s.head_dim));
  p.set_seq_len(static_cast<uint32_t>(s.seq_len));
  p.set_obs_window(static_cast<uint32_t>(s.obs_window));
  return p;
}

absl::StatusOr<CompressionSpec> SpecFromProto(const kvcache::v1::CompressionConfig& c,
                                              absl::string_view prefix) {
  auto field = [prefix](absl::string_view name) { return absl::StrCat(prefix, name); };
  CompressionSpec spec;
  const auto& e = c.eviction();
  auto policy = ParseEvictionPolicy(e.policy().empty() ? "none" : e.policy());
  if (!policy.ok()) {
    return Invalid(field("eviction.policy"), absl::StrCat("unknown '", e.policy(), "'"));
  }
  spec.eviction.policy = *policy;
  if (e.budget() > kMaxCount) return TooLarge(field("eviction.budget"), e.budget());
  spec.eviction.budget = static_cast<int>(e.budget());
  if (e.has_keep_ratio()) spec.eviction.keep_ratio = e.keep_ratio();
  for (uint32_t b : e.layer_budgets()) {
    if (b > kMaxCount) return TooLarge(field("eviction.layer_budgets"), b);
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
      return Invalid(field("eviction.granularity"), "unknown value");
  }
  if (e.has_sink_tokens()) {
    spec.eviction.sink_tokens = static_cast<int>(std::min(e.sink_tokens(), 1u << 30));
  }
  if (e.has_recent_fraction()) spec.eviction.recent_fraction = e.recent_fraction();
  if (e.has_pool_kernel()) {
    // Checked before narrowing, so the message quotes the value sent.
    if (e.pool_kernel() > static_cast<uint32_t>(kMaxPoolKernel)) {
      return Invalid(field("eviction.pool_kernel"),
                     absl::StrCat(e.pool_kernel(), " exceeds ", kMaxPoolKernel,
                                  " (pooling costs seq_len * pool_kernel per head)"));
    }
    spec.eviction.pool_kernel = static_cast<int>(e.pool_kernel());
  }
  if (e.pool().empty() || e.pool() == "max") {
    spec.eviction.pool = PoolKind::kMax;
  } else if (e.pool() == "avg") {
    spec.eviction.pool = PoolKind::kAvg;
  } else {
    return Invalid(field("eviction.pool"), absl::StrCat("'", e.pool(), "' is not max or avg"));
  }
  if (e.has_tau()) spec.eviction.tau = e.tau();
  spec.eviction.seed = e.seed();
  spec.eviction.adaptive = e.adaptive();
  if (e.has_adaptive_floor()) spec.eviction.adaptive_floor = e.adaptive_floor();
  spec.eviction.layer_adaptive = e.layer_adaptive();
  auto value_weight = ParseValueWeight(e.value_weight());
  if (!value_weight.ok()) {
    return Invalid(field("eviction.value_weight"),
                   absl::StrCat("'", e.value_weight(), "' is not auto, off, mul or add"));
  }
  spec.eviction.value_weight = *value_weight;
  if (e.has_value_eps()) spec.eviction.value_eps = e.value_eps();
  if (e.has_horizon()) {
    if (e.horizon() > static_cast<uint32_t>(kMaxHorizon)) {
      return Invalid(field("eviction.horizon"),
                     absl::StrCat(e.horizon(), " exceeds ", kMaxHorizon,
                                  " (future positions the statistics are averaged over)"));
    }
    spec.eviction.horizon = static_cast<int>(e.horizon());
  }
  spec.eviction.query_stats = e.query_stats();
  for (uint32_t rows : e.pass_rows()) {
    if (rows > kMaxCount) return TooLarge(field("eviction.pass_rows"), rows);
    spec.eviction.pass_rows.push_back(static_cast<int>(rows));
  }
  if (e.has_pass_tokens()) {
    if (e.pass_tokens() > kMaxCount) {
      return TooLarge(field("eviction.pass_tokens"), e.pass_tokens());
    }
    spec.eviction.pass_tokens = static_cast<int>(e.pass_tokens());
  }
  if (e.has_top_rows()) {
    if (e.top_rows() > kMaxCount) return TooLarge(field("eviction.top_rows"), e.top_rows());
    spec.eviction.top_rows = static_cast<int>(e.top_rows());
  }

  const auto& ch = c.channels();
  auto key_policy = ParseChannelPolicy(ch.key_policy().empty() ? "none" : ch.key_policy());
  if (!key_policy.ok()) {
    return Invalid(field("channels.key_policy"), absl::StrCat("unknown '", ch.key_policy(), "'"));
  }
  spec.channels.key_policy = *key_policy;
  spec.channels.key_lambda = ch.key_lambda();
  spec.channels.prune_values = ch.prune_values();
  spec.channels.value_lambda = ch.value_lambda();

  if (c.quant().bits() > 64) {
    return Invalid(field("quant.bits"), absl::StrCat(c.quant().bits(), " is not one of 0, 2, 4, 8"));
  }
  spec.quant.bits = static_cast<int>(c.quant().bits());
  if (c.quant().value_bits() > 64) {
    return Invalid(field("quant.value_bits"),
                   absl::StrCat(c.quant().value_bits(), " is not one of 0, 2, 4, 8"));
  }
  spec.quant.value_bits = static_cast<int>(c.quant().value_bits());
  if (c.quant().has_group_size()) {
    spec.quant.group_size = static_cast<int>(std::min(c.quant().group_size(), kMaxCount));
  }
  if (c.has_recent_tokens()) {
    spec.recent_tokens = static_cast<int>(std::min(c.recent_tokens(), 1u << 30));
  }
  return spec;
}

absl::StatusOr<CompressionSpec> SpecFromProto(const kvcache::v1::CompressionConfig& c,
                                              const LayerShape& shape, int num_layers) {
  if (c.eviction().layer_budgets_size() > num_layers) {
    return Invalid(
        "header.compression.eviction.layer_budgets",
        absl::StrCat(c.eviction().layer_budgets_size(), " entries for ", num_layers, " layers"));
  }
  // One pass per chunk: never more entries than tokens (checked before they are copied).
  if (c.eviction().pass_rows_size() > shape.seq_len) {
    return Invalid("header.compression.eviction.pass_rows",
                   absl::StrCat(c.eviction().pass_rows_size(), " passes for ", shape.seq_len,
                                " tokens"));
  }
  ASSIGN_OR_RETURN(CompressionSpec spec, SpecFromProto(c, "header.compression."));
  // A group larger than head_dim never divides it; said with the value sent (not narrowed).
  if (spec.quant.bits > 0 && c.quant().has_group_size() &&
      c.quant().group_size() > static_cast<uint32_t>(shape.head_dim)) {
    return Invalid("header.compression.quant.group_size",
                   absl::StrCat(c.quant().group_size(), " does not divide head_dim ",
                                shape.head_dim));
  }
  for (int l = 0; l < num_layers; ++l) {
    RETURN_IF_ERROR(Qualify(ValidateSpec(spec, shape, l), "header.compression."));
    // Layers without a per-layer budget share one validation result.
    if (l >= static_cast<int>(spec.eviction.layer_budgets.size())) break;
  }
  return spec;
}

kvcache::v1::CompressionConfig SpecToProto(const CompressionSpec& spec) {
  kvcache::v1::CompressionConfig c;
  auto* e = c.mutable_eviction();
  e->set_policy(std::string(PolicyName(spec.eviction.policy)));
  e->set_budget(static_cast<uint32_t>(std::max(spec.eviction.budget, 0)));
  e->set_keep_ratio(spec.eviction.keep_ratio);
  for (int b : spec.eviction.layer_budgets) e->add_layer_budgets(static_cast<uint32_t>(b));
  e->set_granularity(spec.eviction.granularity == Granularity::kPerLayer
                         ? kvcache::v1::GRANULARITY_PER_LAYER
                         : kvcache::v1::GRANULARITY_PER_HEAD);
  e->set_sink_tokens(static_cast<uint32_t>(spec.eviction.sink_tokens));
  // Negative means "the policy's default" in both the struct and the server's conversion, which
  // applies it only when the field is present: leave it absent then.
  if (spec.eviction.recent_fraction >= 0) e->set_recent_fraction(spec.eviction.recent_fraction);
  e->set_pool_kernel(static_cast<uint32_t>(spec.eviction.pool_kernel));
  e->set_pool(spec.eviction.pool == PoolKind::kAvg ? "avg" : "max");
  e->set_tau(spec.eviction.tau);
  e->set_seed(spec.eviction.seed);
  e->set_adaptive(spec.eviction.adaptive);
  e->set_adaptive_floor(spec.eviction.adaptive_floor);
  e->set_layer_adaptive(spec.eviction.layer_adaptive);
  e->set_value_weight(std::string(ValueWeightName(spec.eviction.value_weight)));
  e->set_value_eps(spec.eviction.value_eps);
  e->set_horizon(static_cast<uint32_t>(spec.eviction.horizon));
  e->set_query_stats(spec.eviction.query_stats);
  for (int rows : spec.eviction.pass_rows) e->add_pass_rows(static_cast<uint32_t>(rows));
  e->set_pass_tokens(static_cast<uint32_t>(std::max(spec.eviction.pass_tokens, 0)));
  e->set_top_rows(static_cast<uint32_t>(std::max(spec.eviction.top_rows, 0)));
  auto* ch = c.mutable_channels();
  ch->set_key_policy(std::string(PolicyName(spec.channels.key_policy)));
  ch->set_key_lambda(spec.channels.key_lambda);
  ch->set_prune_values(spec.channels.prune_values);
  ch->set_value_lambda(spec.channels.value_lambda);
  c.mutable_quant()->set_bits(static_cast<uint32_t>(spec.quant.bits));
  c.mutable_quant()->set_group_size(static_cast<uint32_t>(spec.quant.group_size));
  c.mutable_quant()->set_value_bits(static_cast<uint32_t>(std::max(spec.quant.value_bits, 0)));
  c.set_recent_tokens(static_cast<uint32_t>(spec.recent_tokens));
  return c;
}

}  // namespace kvc

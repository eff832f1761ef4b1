// Fuzzes shape and compression-spec validation from arbitrary bytes, on both levels:
//   - the wire: the bytes as a PutCacheHeader, checked the way kvcd's upload does it
//     (ShapeFromProto, SpecFromProto, LayerTensorBytes, EstimateStoredBytes);
//   - the engine: the bytes as raw LayerShape and CompressionSpec fields (ValidateShape,
//     ValidateSpec, EffectiveBudget, KeptChannels).
// Properties: no undefined behaviour (signed overflow, bad float-to-int conversions) in the checks
// or the size computations that follow them; what validation accepts keeps every derived count in
// range and every byte count exact.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "google/protobuf/stubs/logging.h"
#include "kvc/layer.h"
#include "kvc/spec.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/convert.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "shape_fuzz: %s\n", what);
    std::abort();
  }
}

// Integers near the interesting edges more often than uniformly at random.
int SomeInt(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      return in.ConsumeIntegralInRange(-2, 300);
    case 1:
      return in.ConsumeIntegralInRange(0, 1 << 20);
    default:
      return in.ConsumeIntegral<int>();
  }
}

double SomeDouble(FuzzedDataProvider& in) {
  return in.ConsumeBool() ? in.ConsumeProbability<double>() : in.ConsumeFloatingPoint<double>();
}

void CheckDerived(const kvc::CompressionSpec& spec, const kvc::LayerShape& shape, int layer) {
  const int budget = kvc::EffectiveBudget(spec.eviction, layer, shape.seq_len);
  Check(budget >= 1 && budget <= shape.seq_len, "EffectiveBudget outside [1, seq_len]");
  const int tk = kvc::KeptChannels(spec.channels.key_lambda, shape.head_dim);
  const int tv = kvc::KeptChannels(spec.channels.value_lambda, shape.head_dim);
  Check(tk >= 1 && tk <= shape.head_dim && tv >= 1 && tv <= shape.head_dim,
        "KeptChannels outside [1, head_dim]");
}

void EngineLevel(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  kvc::LayerShape shape;
  shape.num_kv_heads = SomeInt(in);
  shape.num_q_heads = SomeInt(in);
  shape.seq_len = SomeInt(in);
  shape.head_dim = SomeInt(in);
  shape.obs_window = SomeInt(in);
  // As the engine checks it: the shape alone (W may exceed S), then the spec decides.
  if (!kvc::ValidateShape(shape, /*rows_after_context=*/true).ok()) return;
  const unsigned __int128 k = static_cast<unsigned __int128>(shape.num_kv_heads) *
                              static_cast<unsigned>(shape.seq_len) *
                              static_cast<unsigned>(shape.head_dim);
  Check(k <= kvc::kMaxLayerElements, "ValidateShape accepted more than kMaxLayerElements");

  kvc::CompressionSpec spec;
  spec.eviction.policy = static_cast<kvc::EvictionPolicy>(
      in.ConsumeIntegralInRange(0, static_cast<int>(kvc::kNumPolicies) - 1));
  spec.eviction.budget = SomeInt(in);
  spec.eviction.keep_ratio = SomeDouble(in);
  const int n_budgets = in.ConsumeIntegralInRange(0, 4);
  for (int i = 0; i < n_budgets; ++i) spec.eviction.layer_budgets.push_back(SomeInt(in));
  spec.eviction.granularity = static_cast<kvc::Granularity>(in.ConsumeIntegralInRange(0, 2));
  spec.eviction.sink_tokens = SomeInt(in);
  spec.eviction.recent_fraction = SomeDouble(in);
  spec.eviction.pool_kernel = SomeInt(in);
  spec.eviction.pool = static_cast<kvc::PoolKind>(in.ConsumeIntegralInRange(0, 2));
  spec.eviction.tau = SomeDouble(in);
  spec.eviction.adaptive = in.ConsumeBool();
  spec.eviction.adaptive_floor = SomeDouble(in);
  spec.eviction.layer_adaptive = in.ConsumeBool();
  const int n_passes = in.ConsumeIntegralInRange(0, 3);
  for (int i = 0; i < n_passes; ++i) spec.eviction.pass_rows.push_back(SomeInt(in));
  if (n_passes > 0) spec.eviction.pass_tokens = SomeInt(in);
  if (in.ConsumeBool()) spec.eviction.top_rows = SomeInt(in);
  spec.channels.key_policy = static_cast<kvc::ChannelPolicy>(in.ConsumeIntegralInRange(0, 4));
  spec.channels.key_lambda = SomeDouble(in);
  spec.channels.prune_values = in.ConsumeBool();
  spec.channels.value_lambda = SomeDouble(in);
  spec.quant.bits = SomeInt(in);
  spec.quant.group_size = SomeInt(in);
  spec.recent_tokens = SomeInt(in);
  const int layer = in.ConsumeIntegralInRange(-1, 5);
  if (!kvc::ValidateSpec(spec, shape, layer).ok()) return;
  Check(shape.obs_window <= shape.seq_len || spec.eviction.policy == kvc::EvictionPolicy::kKVzip,
        "ValidateSpec accepted W > S for a policy other than kvzip");
  if (!spec.eviction.pass_rows.empty()) {
    int64_t rows = 0;
    for (int r : spec.eviction.pass_rows) rows += r;
    Check(rows == shape.obs_window && spec.eviction.pass_tokens >= 1,
          "ValidateSpec accepted passes whose rows do not add up to obs_window");
  }
  Check(spec.eviction.top_rows >= 1 && spec.eviction.top_rows <= kvc::kMaxTopRows,
        "ValidateSpec accepted a top_rows outside [1, kMaxTopRows]");
  CheckDerived(spec, shape, layer);
}

void WireLevel(const uint8_t* data, size_t size) {
  kvcache::v1::PutCacheHeader h;
  if (!h.ParseFromArray(data, static_cast<int>(size))) return;
  // As the upload checks it (service/server/ingest.cc).
  if (h.shape().num_layers() < 1 || h.shape().num_layers() > 4096) return;
  absl::StatusOr<kvc::UploadHeader> header = kvc::HeaderFromProto(h);
  absl::StatusOr<kvc::LayerShape> shape =
      header.ok() ? absl::StatusOr<kvc::LayerShape>(header->shape)
                  : kvc::server::ShapeFromProto(h.shape());
  if (!shape.ok()) return;
  absl::StatusOr<kvc::DType> dtype = kvc::server::FromProto(h.dtype());
  if (!dtype.ok()) return;
  const int num_layers = static_cast<int>(h.shape().num_layers());
  absl::StatusOr<kvc::CompressionSpec> spec =
      kvc::server::SpecFromProto(h.compression(), *shape, num_layers);
  if (!spec.ok()) return;
  // A shape that passed ShapeFromProto has byte counts that fit 64 bits.
  const absl::StatusOr<kvc::server::LayerBytes> lb =
      kvc::server::LayerTensorBytes(*shape, *dtype);
  Check(lb.ok(), "LayerTensorBytes fails on a shape ShapeFromProto accepted");
  const unsigned __int128 k = static_cast<unsigned __int128>(shape->num_kv_heads) *
                              static_cast<unsigned>(shape->seq_len) *
                              static_cast<unsigned>(shape->head_dim) * kvc::DTypeSize(*dtype);
  Check(lb->k == k && lb->v == k, "LayerTensorBytes is not Hkv * S * D * dtype size");
  (void)kvc::server::EstimateStoredBytes(*shape, *dtype, *spec, num_layers);
  for (int l = 0; l < num_layers; ++l) CheckDerived(*spec, *shape, l);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // no line per rejected non-UTF-8 string
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  EngineLevel(data, size);
  WireLevel(data, size);
  return 0;
}

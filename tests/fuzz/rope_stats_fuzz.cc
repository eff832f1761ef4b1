// Fuzzes the ingest of expected attention's inputs from arbitrary bytes: the PutCacheHeader's
// RoPE (RopeFromProto, as kvcd reads it), the horizon, and a layer whose Q_obs, K, V and Q_stats
// are raw bit patterns (NaN, infinities, denormals included), compressed by the CPU engine with
// the expected policy; plus the mean rotation alone at extreme positions and horizons, and the
// cost model of the same spec.
// Properties: no undefined behaviour or crash; what validation accepts compresses to a layer that
// parses, keeps the budget in every head, with positions ascending and in range; mean rotations
// stay within the unit disc; the cost model never wraps (saturated values only grow).
#include <fuzzer/FuzzedDataProvider.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/score_extra.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/cost.h"
#include "kvc/spec.h"
#include "kvcache/v1/kvcache.pb.h"
#include "kvc/protocol/convert.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "rope_stats_fuzz: %s\n", what);
    std::abort();
  }
}

kvc::Backend* Cpu() {
  static kvc::Backend* const backend = [] {
    kvc::BackendOptions o;
    o.num_threads = 1;
    return kvc::CreateCpuBackend(o)->release();
  }();
  return backend;
}

double SomeDouble(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange(0, 3)) {
    case 0:
      return in.ConsumeFloatingPointInRange(1.0, 1e7);  // a plausible theta or factor
    case 1:
      return in.ConsumeProbability<double>() * 4;
    default:
      return in.ConsumeFloatingPoint<double>();
  }
}

// The rotation alone: extreme first positions, horizons and frequencies.
void MeanRotationLevel(FuzzedDataProvider& in) {
  kvc::RopeParams rope;
  rope.theta = SomeDouble(in);
  rope.linear_factor = in.ConsumeBool() ? 1.0 : SomeDouble(in);
  const int d = 2 * in.ConsumeIntegralInRange(4, 128);
  rope.rotary_dims = in.ConsumeBool() ? 0 : 2 * in.ConsumeIntegralInRange(0, d / 2);
  rope.half_split = in.ConsumeBool();
  if (!kvc::ValidateRope(rope, d).ok()) return;
  const int first = in.ConsumeIntegralInRange(0, 1 << 30);
  const int count = in.ConsumeBool() ? in.ConsumeIntegralInRange(1, 64)
                                     : in.ConsumeIntegralInRange(1, kvc::kMaxHorizon);
  const kvc::cpu::MeanRotation r = kvc::cpu::MeanRotationOf(rope, d, first, count);
  for (size_t p = 0; p < r.c.size(); ++p) {
    const double norm = r.c[p] * r.c[p] + r.s[p] * r.s[p];
    Check(std::isfinite(norm) && norm <= 1.0 + 1e-6, "mean rotation outside the unit disc");
  }
}

void EngineLevel(FuzzedDataProvider& in) {
  // The header's RoPE as a client sends it.
  kvcache::v1::RopeSpec spec_rope;
  spec_rope.set_theta(SomeDouble(in));
  spec_rope.set_rotary_dims(in.ConsumeBool() ? in.ConsumeIntegral<uint32_t>()
                                             : 2 * in.ConsumeIntegralInRange<uint32_t>(0, 16));
  spec_rope.set_style(static_cast<kvcache::v1::RopeStyle>(in.ConsumeIntegralInRange(0, 3)));
  spec_rope.set_scaling(static_cast<kvcache::v1::RopeScaling>(in.ConsumeIntegralInRange(0, 4)));
  spec_rope.set_scaling_factor(SomeDouble(in));

  kvc::LayerShape shape;
  shape.num_kv_heads = in.ConsumeIntegralInRange(1, 2);
  shape.num_q_heads = shape.num_kv_heads * in.ConsumeIntegralInRange(1, 4);
  shape.head_dim = 8 * in.ConsumeIntegralInRange(1, 4);
  shape.seq_len = in.ConsumeIntegralInRange(1, 64);
  shape.obs_window = in.ConsumeIntegralInRange(0, shape.seq_len);
  const auto dtype = static_cast<kvc::DType>(in.ConsumeIntegralInRange(0, 2));

  absl::StatusOr<kvc::RopeParams> rope =
      kvc::RopeFromProto(spec_rope, shape.head_dim, kvc::RopeUse::kPutHeader);
  if (!rope.ok()) return;

  kvc::CompressionSpec spec;
  spec.eviction.policy = kvc::EvictionPolicy::kExpectedAttention;
  spec.eviction.keep_ratio = in.ConsumeFloatingPointInRange(0.01, 1.0);
  spec.eviction.horizon = in.ConsumeBool() ? in.ConsumeIntegralInRange(1, 64)
                                           : in.ConsumeIntegralInRange(0, kvc::kMaxHorizon + 1);
  spec.eviction.query_stats = shape.obs_window == 0 || in.ConsumeBool();
  spec.eviction.value_weight = static_cast<kvc::ValueWeight>(in.ConsumeIntegralInRange(0, 3));
  if (!kvc::ValidateShape(shape).ok() || !kvc::ValidateSpec(spec, shape, 0).ok()) return;

  // Cost of the spec: saturating, and more layers never cost less.
  const kvc::WorkCost one = kvc::CompressCost(shape, dtype, spec, 1, {});
  const kvc::WorkCost many = kvc::CompressCost(shape, dtype, spec, 4096, {});
  Check(many.flops >= one.flops, "the cost of more layers wrapped");

  // The tensors' bits, straight from the input (what arrives on the wire).
  const size_t es = kvc::DTypeSize(dtype);
  const size_t kv_bytes =
      static_cast<size_t>(shape.num_kv_heads) * shape.seq_len * shape.head_dim * es;
  const size_t q_bytes =
      static_cast<size_t>(shape.num_q_heads) * shape.obs_window * shape.head_dim * es;
  std::vector<uint8_t> k(kv_bytes), v(kv_bytes), q(q_bytes);
  std::vector<float> stats(kvc::QueryStatsFloats(shape));
  for (auto* buf : {&k, &v, &q}) {
    const std::vector<uint8_t> bytes = in.ConsumeBytes<uint8_t>(buf->size());
    if (!bytes.empty()) std::memcpy(buf->data(), bytes.data(), bytes.size());
  }
  const std::vector<uint8_t> stat_bytes = in.ConsumeRemainingBytes<uint8_t>();
  const size_t stat_copy = std::min(stat_bytes.size(), stats.size() * sizeof(float));
  if (stat_copy > 0) std::memcpy(stats.data(), stat_bytes.data(), stat_copy);
  // kvcd refuses non-finite statistics before compressing (ingest.cc): do the same.
  if (spec.eviction.query_stats) {
    for (float x : stats) {
      if (!std::isfinite(x)) return;
    }
  }

  kvc::LayerInput layer;
  layer.shape = shape;
  layer.dtype = dtype;
  layer.k = k.data();
  layer.v = v.data();
  layer.q_obs = shape.obs_window > 0 ? q.data() : nullptr;
  layer.rope = &*rope;
  layer.q_stats = spec.eviction.query_stats ? stats.data() : nullptr;
  absl::StatusOr<kvc::CompactLayer> out = Cpu()->Compress(layer, spec, nullptr);
  Check(out.ok(), "a valid expected-attention layer failed to compress");
  absl::StatusOr<kvc::CompactLayerView> view = kvc::CompactLayerView::Parse(out->bytes);
  Check(view.ok(), "the compressed layer does not parse");
  const int budget = kvc::EffectiveBudget(spec.eviction, 0, shape.seq_len);
  for (int h = 0; h < view->num_kv_heads(); ++h) {
    const kvc::CompactHead head = view->head(h);
    Check(head.n_kept == budget, "a head does not keep the budget");
    for (int i = 0; i < head.n_kept; ++i) {
      Check(head.positions[i] >= 0 && head.positions[i] < shape.seq_len &&
                (i == 0 || head.positions[i] > head.positions[i - 1]),
            "kept positions not ascending within [0, seq_len)");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    MeanRotationLevel(in);
  } else {
    EngineLevel(in);
  }
  return 0;
}

// The size computations kvcd makes from a PutCacheHeader (server/convert.h) over random huge
// shapes: each is exact or an INVALID_ARGUMENT naming the product that overflows 64 bits, never a
// wrapped value; EstimateStoredBytes is integer arithmetic (no double to uint64 conversion out of
// range, which is undefined behaviour) and matches the real-valued formula.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/spec.h"
#include "server/convert.h"
#include "testing/kvc_rpc.h"

namespace kvc::server {
namespace {

using ::testing::HasSubstr;
using u128 = unsigned __int128;

constexpr u128 kU64Max = std::numeric_limits<uint64_t>::max();

uint32_t RandomDim(std::mt19937_64& rng, int bits) {
  switch (rng() % 4) {
    case 0:
      return 1u << (rng() % (bits + 1));
    case 1:
      return static_cast<uint32_t>(rng() % (uint64_t{1} << bits)) + 1;
    default: {
      const int b = static_cast<int>(rng() % (bits + 1));
      return static_cast<uint32_t>(rng() & ((uint64_t{1} << b) - 1)) + 1;
    }
  }
}

CompressionSpec RandomSpec(std::mt19937_64& rng) {
  CompressionSpec spec;
  const EvictionPolicy policies[] = {EvictionPolicy::kNone, EvictionPolicy::kStreaming,
                                     EvictionPolicy::kRandom};
  spec.eviction.policy = policies[rng() % 3];
  spec.eviction.keep_ratio = 0.01 + 0.99 * static_cast<double>(rng() % 1000) / 1000;
  spec.quant.bits = static_cast<int>(rng() % 2) * 8;
  spec.quant.group_size = 8;
  spec.quant.value_bits = spec.quant.bits > 0 ? std::vector<int>{0, 2, 4}[rng() % 3] : 0;
  return spec;
}

// The real-valued formula EstimateStoredBytes implements, as it was computed in double before.
long double ReferenceEstimate(const LayerShape& s, DType dtype, const CompressionSpec& spec,
                              int num_layers) {
  const long double key = spec.quant.bits > 0 ? spec.quant.bits / 8.0L : DTypeSize(dtype);
  const long double value = ValueBits(spec.quant) > 0 ? ValueBits(spec.quant) / 8.0L : key;
  long double total = 0;
  for (int l = 0; l < num_layers; ++l) {
    const long double kept = EffectiveBudget(spec.eviction, l, s.seq_len);
    const long double per_head = kept * s.head_dim * (key + value) + kept * 4.0L;
    total += sizeof(LayerHeader) + s.num_kv_heads * (sizeof(HeadDesc) + per_head);
  }
  return total;
}

TEST(ServerConvertTest, TheIssueHeaderIsInvalidNamingTheProduct) {
  const kvcache::v1::ModelShape p = testing::Shape(1, 901467965, 901467965, 96, 213156309, 0);
  absl::StatusOr<LayerShape> shape = ShapeFromProto(p);
  ASSERT_FALSE(shape.ok());
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(shape.status().message(),
            "header.shape: num_kv_heads*seq_len*head_dim = 901467965*213156309*96 overflows 64 "
            "bits");
  // The sizes themselves refuse the unvalidated shape instead of wrapping to 2144 elements.
  const LayerShape raw = {.num_kv_heads = 901467965,
                          .num_q_heads = 901467965,
                          .seq_len = 213156309,
                          .head_dim = 96,
                          .obs_window = 0};
  absl::StatusOr<LayerBytes> bytes = LayerTensorBytes(raw, DType::kF16);
  ASSERT_FALSE(bytes.ok());
  EXPECT_THAT(std::string(bytes.status().message()),
              HasSubstr("num_kv_heads*seq_len*head_dim*dtype_bytes = 901467965*213156309*96*2 "
                        "overflows 64 bits"));
  EXPECT_FALSE(UploadBytes(raw, DType::kF16, 1).ok());
  for (int bits : {0, 8}) {
    CompressionSpec spec;
    spec.eviction.policy = EvictionPolicy::kStreaming;
    spec.quant.bits = bits;
    absl::StatusOr<uint64_t> estimate = EstimateStoredBytes(raw, DType::kF16, spec, 1);
    ASSERT_FALSE(estimate.ok()) << *estimate;
    EXPECT_EQ(estimate.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(estimate.status().message()), HasSubstr("overflows 64 bits"));
  }
}

// Headers with every dimension up to 2^30 and up to 4096 layers: ShapeFromProto rejects the shape
// or every size computed from it is exact and representable.
TEST(ServerConvertTest, RandomHugeHeadersAreRejectedOrSizedExactly) {
  std::mt19937_64 rng(1201);
  int accepted = 0;
  for (int i = 0; i < 20000; ++i) {
    const uint32_t heads = RandomDim(rng, 30), group = RandomDim(rng, 4), seq = RandomDim(rng, 30);
    const uint32_t head_dim = 8 * (1 + static_cast<uint32_t>(rng() % 32));
    const uint32_t window = static_cast<uint32_t>(rng() % (uint64_t{seq} + 1));
    const uint32_t q_heads = uint64_t{heads} * group <= (1u << 30) ? heads * group : heads;
    const uint32_t layers = 1 + static_cast<uint32_t>(rng() % 4096);
    const DType dtype = rng() % 2 ? DType::kF32 : DType::kF16;
    const uint64_t es = DTypeSize(dtype);
    absl::StatusOr<LayerShape> shape =
        ShapeFromProto(testing::Shape(layers, heads, q_heads, head_dim, seq, window));
    const u128 kv = static_cast<u128>(heads) * seq * head_dim;
    const u128 q = static_cast<u128>(q_heads) * window * head_dim;
    ASSERT_EQ(shape.ok(), kv <= kMaxLayerElements && q <= kMaxLayerElements)
        << shape.status() << " " << heads << " " << q_heads << " " << seq << " " << head_dim;
    if (kv > kU64Max) {
      ASSERT_THAT(std::string(shape.status().message()), HasSubstr("overflows 64 bits"));
    }
    if (!shape.ok()) continue;
    ++accepted;
    absl::StatusOr<LayerBytes> lb = LayerTensorBytes(*shape, dtype);
    ASSERT_TRUE(lb.ok()) << lb.status();
    ASSERT_EQ(lb->k, static_cast<uint64_t>(kv * es));
    ASSERT_EQ(lb->q_obs, static_cast<uint64_t>(q * es));
    absl::StatusOr<uint64_t> upload = UploadBytes(*shape, dtype, static_cast<int>(layers));
    ASSERT_TRUE(upload.ok()) << upload.status();
    ASSERT_EQ(*upload, static_cast<uint64_t>((2 * kv + q) * es * layers));
    const CompressionSpec spec = RandomSpec(rng);
    absl::StatusOr<uint64_t> estimate =
        EstimateStoredBytes(*shape, dtype, spec, static_cast<int>(layers));
    ASSERT_TRUE(estimate.ok()) << estimate.status();
    const long double want = ReferenceEstimate(*shape, dtype, spec, static_cast<int>(layers));
    // Rounded down per head: a lower bound of the real-valued formula, off by less than a byte
    // per head and layer.
    ASSERT_LE(static_cast<long double>(*estimate), want * (1 + 1e-15L) + 1);
    ASSERT_GE(static_cast<long double>(*estimate),
              want * (1 - 1e-15L) - static_cast<long double>(heads) * layers - 1);
  }
  EXPECT_GT(accepted, 1000);
}

// The same computations on shapes nobody validated (every int up to INT32_MAX): exact where the
// result fits in 64 bits, INVALID_ARGUMENT otherwise; no wrap, no undefined behaviour.
TEST(ServerConvertTest, UnvalidatedShapesNeverWrap) {
  std::mt19937_64 rng(77);
  int overflowed = 0;
  for (int i = 0; i < 20000; ++i) {
    LayerShape s;
    s.num_kv_heads = static_cast<int>(std::min<uint32_t>(RandomDim(rng, 31), INT32_MAX));
    s.num_q_heads = s.num_kv_heads;
    s.seq_len = static_cast<int>(std::min<uint32_t>(RandomDim(rng, 31), INT32_MAX));
    s.head_dim = 8 * (1 + static_cast<int>(rng() % 32));
    s.obs_window = static_cast<int>(rng() % (static_cast<uint64_t>(s.seq_len) + 1));
    const int layers = 1 + static_cast<int>(rng() % 4096);
    const DType dtype = rng() % 2 ? DType::kF32 : DType::kF16;
    const u128 es = DTypeSize(dtype);
    const u128 k = static_cast<u128>(s.num_kv_heads) * s.seq_len * s.head_dim * es;
    const u128 q = static_cast<u128>(s.num_q_heads) * s.obs_window * s.head_dim * es;
    absl::StatusOr<LayerBytes> lb = LayerTensorBytes(s, dtype);
    ASSERT_EQ(lb.ok(), k <= kU64Max && q <= kU64Max);
    if (lb.ok()) {
      ASSERT_EQ(lb->k, static_cast<uint64_t>(k));
      ASSERT_EQ(lb->q_obs, static_cast<uint64_t>(q));
    } else {
      ++overflowed;
      ASSERT_EQ(lb.status().code(), absl::StatusCode::kInvalidArgument);
      ASSERT_THAT(std::string(lb.status().message()), HasSubstr("overflows 64 bits"));
    }
    const u128 all = (2 * k + q) * layers;  // k, q < 2^72, so this fits in 128 bits
    absl::StatusOr<uint64_t> upload = UploadBytes(s, dtype, layers);
    ASSERT_EQ(upload.ok(), k <= kU64Max && q <= kU64Max && all <= kU64Max);
    if (upload.ok()) {
      ASSERT_EQ(*upload, static_cast<uint64_t>(all));
    }

    const CompressionSpec spec = RandomSpec(rng);
    absl::StatusOr<uint64_t> estimate = EstimateStoredBytes(s, dtype, spec, layers);
    const long double want = ReferenceEstimate(s, dtype, spec, layers);
    const long double slack = static_cast<long double>(s.num_kv_heads) * layers + 1;
    if (estimate.ok()) {
      ASSERT_LE(static_cast<long double>(*estimate), want * (1 + 1e-15L) + 1);
      ASSERT_GE(static_cast<long double>(*estimate), want * (1 - 1e-15L) - slack);
    } else {
      ASSERT_EQ(estimate.status().code(), absl::StatusCode::kInvalidArgument);
      ASSERT_THAT(std::string(estimate.status().message()), HasSubstr("overflows 64 bits"));
      // Only when the real value really is past (or within rounding of) 2^64.
      ASSERT_GE(want * (1 + 1e-15L) + slack, static_cast<long double>(kU64Max));
    }
  }
  EXPECT_GT(overflowed, 100);
}

// Head-adaptive budgets leave heads with different counts (H * B in all): the admission estimate
// stays below what the engine really stores, quantized, pruned or not.
TEST(ServerConvertTest, EstimateStaysALowerBoundForHeadAdaptiveCaches) {
  std::mt19937_64 rng(77);
  auto cpu = CreateCpuBackend({});
  ASSERT_TRUE(cpu.ok());
  int ragged = 0;
  for (int i = 0; i < 60; ++i) {
    const LayerShape s{1 + static_cast<int>(rng() % 4), 0, 16 + static_cast<int>(rng() % 100), 8,
                       4};
    LayerShape shape = s;
    shape.num_q_heads = shape.num_kv_heads * 2;
    CompressionSpec spec;
    spec.eviction.policy = rng() % 2 ? EvictionPolicy::kH2O : EvictionPolicy::kKNorm;
    spec.eviction.keep_ratio = 0.05 + 0.9 * static_cast<double>(rng() % 100) / 100;
    spec.eviction.adaptive = true;
    spec.eviction.adaptive_floor = static_cast<double>(rng() % 3) / 4;
    spec.quant.bits = std::vector<int>{0, 2, 4, 8}[rng() % 4];
    spec.quant.group_size = 8;
    if (spec.quant.bits > 0) spec.quant.value_bits = std::vector<int>{0, 2, 8}[rng() % 3];
    if (rng() % 2) {
      spec.channels.key_policy = ChannelPolicy::kL2;
      spec.channels.key_lambda = 0.375;
    }
    spec.recent_tokens = static_cast<int>(rng() % 8);
    const size_t n = static_cast<size_t>(shape.num_kv_heads) * shape.seq_len * 8;
    std::vector<float> k(n), v(n), q(static_cast<size_t>(shape.num_q_heads) * 4 * 8);
    std::normal_distribution<float> nd;
    for (auto* t : {&k, &v, &q}) {
      for (float& x : *t) x = nd(rng);
    }
    const LayerInput in{shape, DType::kF32, Layout::kHND, 0, k.data(), v.data(), q.data()};
    auto blob = (*cpu)->Compress(in, spec, nullptr);
    ASSERT_TRUE(blob.ok()) << blob.status();
    auto view = CompactLayerView::Parse(blob->bytes);
    ASSERT_TRUE(view.ok());
    ragged += view->max_kept() != view->desc(0).n_kept;
    absl::StatusOr<uint64_t> estimate = EstimateStoredBytes(shape, DType::kF32, spec, 1);
    ASSERT_TRUE(estimate.ok());
    EXPECT_LE(*estimate, blob->bytes.size()) << i;
  }
  EXPECT_GT(ragged, 10);
}

}  // namespace
}  // namespace kvc::server

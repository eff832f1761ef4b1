#include "kvc/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/pack_util.h"
#include "kvc/dtype.h"
#include "kvc/selection.h"

namespace kvc {
namespace {

constexpr PackedAttentionOptions::Math kExact = PackedAttentionOptions::Math::kExact;
constexpr PackedAttentionOptions::Math kInteger = PackedAttentionOptions::Math::kInteger;

using ::testing::HasSubstr;
using testing_pack::ConcatHeads;
using testing_pack::ExpectedHeadRows;
using testing_pack::MakePackLayer;
using testing_pack::PackLayerData;
using testing_pack::RandomChannels;
using testing_pack::RandomTokens;
using testing_pack::ReferenceAttention;
using testing_pack::UniformFloats;

struct PackedCase {
  PackLayerData layer;
  TokenSelection tokens;
  ChannelSelection channels;
  CompressionSpec spec;
  CompactLayer packed;
  int n_recent = 0;
};

PackedCase MakePackedCase(int hkv, int s, int d, int budget, int tk, int tv, int bits, int recent,
                          DType dt, Layout layout, std::mt19937* rng, int value_bits = 0) {
  PackedCase st;
  st.layer = MakePackLayer(hkv, s, d, dt, layout, (*rng)());
  st.tokens = RandomTokens(hkv, s, budget, rng);
  st.channels = RandomChannels(hkv, d, tk, tv, rng);
  st.spec.quant.bits = bits;
  st.spec.quant.value_bits = value_bits;
  st.spec.quant.group_size = 8;
  st.spec.recent_tokens = recent;
  absl::StatusOr<CompactLayer> p = PackLayer(st.layer.input(), st.tokens, st.channels, st.spec);
  EXPECT_TRUE(p.ok()) << p.status();
  if (p.ok()) st.packed = *std::move(p);
  const bool reduced = tk < d || tv < d || bits > 0;
  st.n_recent = reduced ? std::min(recent, budget) : 0;
  return st;
}

struct Queries {
  int hq = 0, n_q = 0, n_new = 0;
  std::vector<float> q, k_new, v_new;
  DecodeQuery query() const {
    DecodeQuery dq;
    dq.num_q_heads = hq;
    dq.n_q = n_q;
    dq.q = q.data();
    dq.n_new = n_new;
    dq.k_new = n_new > 0 ? k_new.data() : nullptr;
    dq.v_new = n_new > 0 ? v_new.data() : nullptr;
    return dq;
  }
};

Queries MakeQueries(int hkv, int hq, int d, int n_q, int n_new, std::mt19937* rng) {
  Queries q;
  q.hq = hq;
  q.n_q = n_q;
  q.n_new = n_new;
  q.q = UniformFloats(static_cast<size_t>(hq) * n_q * d, 1.5f, rng);
  q.k_new = UniformFloats(static_cast<size_t>(hkv) * n_new * d, 2.0f, rng);
  q.v_new = UniformFloats(static_cast<size_t>(hkv) * n_new * d, 2.0f, rng);
  return q;
}

// Without quantization, attention on the packed bytes equals dense attention over the kept rows
// with pruned channels zero-filled (the same math), across dtypes, layouts, GQA and pruning.
TEST(PackedAttentionTest, MatchesDenseReferenceUnquantized) {
  std::mt19937 rng(123);
  int cases = 0;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (Layout lay : {Layout::kHND, Layout::kNHD}) {
      for (int g : {1, 2, 4}) {
        for (bool prune : {false, true}) {
          const int hkv = 1 + static_cast<int>(rng() % 3);
          const int d = 8 * (1 + static_cast<int>(rng() % 8));
          const int s = 5 + static_cast<int>(rng() % 80);
          const int budget = 1 + static_cast<int>(rng() % s);
          const int tk = prune ? 1 + static_cast<int>(rng() % d) : d;
          const int tv = prune ? 1 + static_cast<int>(rng() % d) : d;
          const int n_q = 1 + static_cast<int>(rng() % 3);
          const int n_new = n_q + static_cast<int>(rng() % 3);
          SCOPED_TRACE(::testing::Message() << DTypeName(dt) << " " << LayoutName(lay) << " g " << g
                                            << " prune " << prune << " D " << d << " B " << budget
                                            << " n_q " << n_q << " n_new " << n_new);
          PackedCase st = MakePackedCase(hkv, s, d, budget, tk, tv, 0, 4, dt, lay, &rng);
          absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(st.packed.bytes);
          ASSERT_TRUE(view.ok()) << view.status();
          const Queries q = MakeQueries(hkv, hkv * g, d, n_q, n_new, &rng);
          std::vector<float> out(q.q.size(), -7.0f);
          ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), out.data()).ok());
          std::vector<std::vector<float>> keys(hkv), values(hkv);
          for (int h = 0; h < hkv; ++h) {
            ExpectedHeadRows(st.layer, st.tokens, st.channels, h, st.n_recent, &keys[h],
                             &values[h]);
          }
          const std::vector<float> ref =
              ReferenceAttention(keys, values, d, hkv * g, n_q, q.q, n_new, q.k_new, q.v_new);
          for (size_t i = 0; i < out.size(); ++i) {
            ASSERT_NEAR(out[i], ref[i], 1e-4f * (1.0f + std::fabs(ref[i]))) << i;
          }
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 36);
}

// With quantization the exact (fp32) packed result equals the reference over the dequantized
// rows (same math again), and both it and the integer path (at every width) differ from the
// unquantized reference by at most the bound derived from the stored scales: a key error |dk_c| <=
// s_c / 2 moves score j by at most delta = sum_c |q_c| s_c / 2 / sqrt(D); then every softmax weight
// changes by a factor within [e^-2delta, e^2delta], so ||dp||_1 <= e^(2 delta) - 1, and the output
// moves by at most (e^(2 delta) - 1) * max|v| + max value step / 2.
// Keys and values at the same bits, and at their own (values at fewer or more bits than keys).
TEST(PackedAttentionTest, QuantizedWithinDerivedBound) {
  std::mt19937 rng(77);
  const std::pair<int, int> widths[] = {{2, 2}, {4, 4}, {8, 8}, {8, 4}, {8, 2}, {4, 8}};
  for (const auto& [bits, vbits] : widths) {
    for (int g : {1, 4}) {
      SCOPED_TRACE(::testing::Message() << "bits " << bits << "/" << vbits << " g " << g);
      const int hkv = 2, d = 32, s = 120, budget = 70, recent = 6;
      PackedCase st = MakePackedCase(hkv, s, d, budget, 20, 24, bits, recent, DType::kF16,
                                     Layout::kHND, &rng, vbits);
      ASSERT_EQ(CompactLayerView::Parse(st.packed.bytes)->value_bits(), vbits);
      absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(st.packed.bytes);
      ASSERT_TRUE(view.ok()) << view.status();
      const int n_q = 2, n_new = 3;
      const Queries q = MakeQueries(hkv, hkv * g, d, n_q, n_new, &rng);
      std::vector<float> out(q.q.size()), out_int(q.q.size());
      ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), out.data(), nullptr, {.math = kExact}).ok());
      ASSERT_TRUE(
          PackedAttentionCpu(*view, q.query(), out_int.data(), nullptr, {.math = kInteger}).ok());

      std::vector<std::vector<float>> dk(hkv), dv(hkv), ek(hkv), ev(hkv);
      for (int h = 0; h < hkv; ++h) {
        dk[h].resize(budget * d);
        dv[h].resize(budget * d);
        UnpackHeadToFloat(*view, h, dk[h].data(), dv[h].data());
        ExpectedHeadRows(st.layer, st.tokens, st.channels, h, st.n_recent, &ek[h], &ev[h]);
      }
      const std::vector<float> deq_ref =
          ReferenceAttention(dk, dv, d, hkv * g, n_q, q.q, n_new, q.k_new, q.v_new);
      const std::vector<float> exact_ref =
          ReferenceAttention(ek, ev, d, hkv * g, n_q, q.q, n_new, q.k_new, q.v_new);
      for (size_t i = 0; i < out.size(); ++i) {
        ASSERT_NEAR(out[i], deq_ref[i], 1e-4f * (1.0f + std::fabs(deq_ref[i]))) << i;
      }
      const int m = budget - st.n_recent;
      double max_err_seen = 0;
      for (int qh = 0; qh < hkv * g; ++qh) {
        const int h = qh / g;
        const CompactHead hd = view->head(h);
        double max_vstep = 0;
        for (int i = 0; i < m * ((hd.value_channels + 7) / 8); ++i) {
          max_vstep = std::max(max_vstep, double{hd.value_scale[i]});
        }
        double vmax = 2.0;  // |v| <= amp for cached and new values
        for (int i = 0; i < n_q; ++i) {
          const float* qv = q.q.data() + (static_cast<size_t>(qh) * n_q + i) * d;
          double delta = 0;
          for (int gi = 0; gi < (m + 7) / 8; ++gi) {
            double dg = 0;
            for (int c = 0; c < hd.key_channels; ++c) {
              dg += std::fabs(qv[hd.key_idx[c]]) * hd.key_scale[gi * hd.key_channels + c] / 2;
            }
            delta = std::max(delta, dg / std::sqrt(double{d}));
          }
          const double bound = (std::exp(2 * delta) - 1) * vmax + max_vstep / 2 + 1e-4;
          for (int c = 0; c < d; ++c) {
            const size_t idx = (static_cast<size_t>(qh) * n_q + i) * d + c;
            const double err = std::fabs(out[idx] - exact_ref[idx]);
            max_err_seen = std::max(max_err_seen, err);
            ASSERT_LE(err, bound) << "qh " << qh << " i " << i << " c " << c;
            ASSERT_LE(std::fabs(out_int[idx] - exact_ref[idx]), bound)
                << "integer path, qh " << qh << " i " << i << " c " << c;
          }
        }
      }
      // The comparison is not vacuous: quantization does move the output.
      EXPECT_GT(max_err_seen, 0.0);
    }
  }
}

// Query i sees new tokens [0, n_new - n_q + i] only: changing a later new token leaves it alone.
TEST(PackedAttentionTest, CausalNewTokens) {
  std::mt19937 rng(5);
  PackedCase st = MakePackedCase(2, 30, 16, 10, 16, 16, 0, 0, DType::kF32, Layout::kHND, &rng);
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(st.packed.bytes);
  ASSERT_TRUE(view.ok());
  Queries q = MakeQueries(2, 4, 16, 3, 5, &rng);
  std::vector<float> a(q.q.size()), b(q.q.size());
  ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), a.data()).ok());
  // Change new token 4 (seen only by query 2) of KV head 1 (query heads 2 and 3).
  for (int c = 0; c < 16; ++c) {
    q.k_new[(1 * 5 + 4) * 16 + c] += 1.0f;
    q.v_new[(1 * 5 + 4) * 16 + c] += 1.0f;
  }
  ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), b.data()).ok());
  for (int qh = 0; qh < 4; ++qh) {
    for (int i = 0; i < 3; ++i) {
      const bool sees = qh >= 2 && i == 2;
      float diff = 0;
      for (int c = 0; c < 16; ++c) {
        const size_t idx = (static_cast<size_t>(qh) * 3 + i) * 16 + c;
        diff = std::max(diff, std::fabs(a[idx] - b[idx]));
      }
      if (sees) {
        EXPECT_GT(diff, 1e-4f) << qh << " " << i;
      } else {
        EXPECT_EQ(diff, 0.0f) << qh << " " << i;
      }
    }
  }
}

// With no new tokens beyond the queries and one kept token, the math is checkable by hand:
// weights softmax(q.k/sqrt(D)) over {cached token, the query's own new token}.
TEST(PackedAttentionTest, TwoTokenHandCase) {
  PackLayerData layer = MakePackLayer(1, 2, 8, DType::kF32, Layout::kHND, 1);
  float* k = reinterpret_cast<float*>(layer.k.data());
  float* v = reinterpret_cast<float*>(layer.v.data());
  for (int c = 0; c < 16; ++c) {
    k[c] = 0.0f;
    v[c] = 0.0f;
  }
  k[8 + 0] = std::sqrt(8.0f) * std::log(3.0f);  // token 1: score ln 3 for q = e0
  v[8 + 1] = 1.0f;
  TokenSelection tokens{1, 1, {1}, {}};
  ChannelSelection channels{8, 8, {}, {}};
  absl::StatusOr<CompactLayer> p = PackLayer(layer.input(), tokens, channels, CompressionSpec{});
  ASSERT_TRUE(p.ok());
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(p->bytes);
  ASSERT_TRUE(view.ok());
  std::vector<float> q(8, 0.0f), kn(8, 0.0f), vn(8, 0.0f), out(8);
  q[0] = 1.0f;
  vn[2] = 1.0f;  // new token: score 0, value e2
  DecodeQuery dq{1, 1, q.data(), 1, kn.data(), vn.data()};
  ASSERT_TRUE(PackedAttentionCpu(*view, dq, out.data()).ok());
  EXPECT_NEAR(out[1], 0.75f, 1e-6);
  EXPECT_NEAR(out[2], 0.25f, 1e-6);
  EXPECT_EQ(out[0], 0.0f);
}

// Heads that keep different counts (as head-adaptive budgets produce): attention
// handles each head with its own counts, and DENSE export pads to the largest count.
TEST(PackedAttentionTest, HeadsWithDifferentCounts) {
  std::mt19937 rng(31);
  const int d = 16;
  std::vector<std::vector<uint8_t>> singles;
  std::vector<std::vector<float>> keys, values;
  const int budgets[] = {5, 12, 1};
  for (int h = 0; h < 3; ++h) {
    PackedCase st =
        MakePackedCase(1, 20, d, budgets[h], 8, 16, 0, 2, DType::kF16, Layout::kHND, &rng);
    singles.emplace_back(st.packed.bytes.begin(), st.packed.bytes.end());
    absl::StatusOr<CompactLayerView> one = CompactLayerView::Parse(st.packed.bytes);
    ASSERT_TRUE(one.ok());
    std::vector<float> k(budgets[h] * d), v(budgets[h] * d);
    UnpackHeadToFloat(*one, 0, k.data(), v.data());
    keys.push_back(k);
    values.push_back(v);
  }
  const std::vector<uint8_t> merged = ConcatHeads(singles);
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(merged);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->desc(0).n_kept, 5);
  EXPECT_EQ(view->desc(1).n_kept, 12);
  EXPECT_EQ(view->desc(2).n_kept, 1);
  EXPECT_EQ(view->desc(2).n_recent, 1);  // m = 0: the whole head is the recent block
  const Queries q = MakeQueries(3, 6, d, 2, 2, &rng);
  std::vector<float> out(q.q.size());
  ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), out.data()).ok());
  const std::vector<float> ref =
      ReferenceAttention(keys, values, d, 6, 2, q.q, 2, q.k_new, q.v_new);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-4f) << i;
  // DENSE pads every head to the largest count: zero rows, position -1.
  absl::StatusOr<DenseLayer> dense = ExportDense(*view);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ(dense->n_kept, 12);
  EXPECT_EQ(dense->counts, (std::vector<int>{5, 12, 1}));
  for (int h = 0; h < 3; ++h) {
    for (int j = 0; j < 12; ++j) {
      const int32_t p = dense->positions[h * 12 + j];
      EXPECT_EQ(p < 0, j >= budgets[h]) << h << " " << j;
      if (p < 0) {
        EXPECT_EQ(p, -1);
      }
      for (int c = 0; c < d && j >= budgets[h]; ++c) {
        EXPECT_EQ(LoadAsFloat(dense->k.data(), dense->dtype, (h * 12 + j) * d + c), 0.0f);
      }
    }
  }
}

// The largest group size (one group spans every old row) packs, parses and attends without
// integer overflow in the group arithmetic.
TEST(PackedAttentionTest, HugeQuantGroup) {
  std::mt19937 rng(8);
  const PackLayerData layer = MakePackLayer(2, 50, 16, DType::kF16, Layout::kHND, 3);
  const TokenSelection tokens = RandomTokens(2, 50, 40, &rng);
  const ChannelSelection channels = RandomChannels(2, 16, 8, 16, &rng);
  CompressionSpec spec;
  spec.quant.bits = 4;
  spec.quant.group_size = std::numeric_limits<int32_t>::max();
  spec.recent_tokens = 4;
  absl::StatusOr<CompactLayer> p = PackLayer(layer.input(), tokens, channels, spec);
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(p->bytes);
  ASSERT_TRUE(view.ok()) << view.status();
  EXPECT_EQ(view->header().quant_group, std::numeric_limits<int32_t>::max());
  std::vector<std::vector<float>> keys(2), values(2);
  for (int h = 0; h < 2; ++h) {
    keys[h].resize(40 * 16);
    values[h].resize(40 * 16);
    UnpackHeadToFloat(*view, h, keys[h].data(), values[h].data());
  }
  const Queries q = MakeQueries(2, 2, 16, 1, 1, &rng);
  std::vector<float> out(q.q.size());
  ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), out.data(), nullptr, {.math = kExact}).ok());
  const std::vector<float> ref =
      ReferenceAttention(keys, values, 16, 2, 1, q.q, 1, q.k_new, q.v_new);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-4f) << i;
  // The integer path groups the same way (one group of tokens) and stays close.
  std::vector<float> out_int(q.q.size());
  ASSERT_TRUE(
      PackedAttentionCpu(*view, q.query(), out_int.data(), nullptr, {.math = kInteger}).ok());
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out_int[i], ref[i], 0.05f) << i;
}

TEST(PackedAttentionTest, RejectsBadQueries) {
  std::mt19937 rng(9);
  PackedCase st = MakePackedCase(2, 20, 16, 8, 8, 16, 0, 2, DType::kF16, Layout::kHND, &rng);
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(st.packed.bytes);
  ASSERT_TRUE(view.ok());
  const Queries q = MakeQueries(2, 4, 16, 2, 3, &rng);
  std::vector<float> out(q.q.size());
  auto err = [&](DecodeQuery dq, float* o) {
    absl::Status s = PackedAttentionCpu(*view, dq, o);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    return std::string(s.message());
  };
  ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), out.data()).ok());
  DecodeQuery dq = q.query();
  dq.num_q_heads = 3;
  EXPECT_THAT(err(dq, out.data()), HasSubstr("query.num_q_heads: 3"));
  dq.num_q_heads = 0;
  EXPECT_THAT(err(dq, out.data()), HasSubstr("query.num_q_heads: 0"));
  dq = q.query();
  dq.n_new = 1;
  EXPECT_THAT(err(dq, out.data()), HasSubstr("query.n_new: 1"));
  dq = q.query();
  dq.n_q = -1;
  EXPECT_THAT(err(dq, out.data()), HasSubstr("query.n_q: -1"));
  dq = q.query();
  dq.q = nullptr;
  EXPECT_THAT(err(dq, out.data()), HasSubstr("query.q: null"));
  dq = q.query();
  dq.k_new = nullptr;
  EXPECT_THAT(err(dq, out.data()), HasSubstr("query.k_new: null"));
  dq = q.query();
  dq.v_new = nullptr;
  EXPECT_THAT(err(dq, out.data()), HasSubstr("query.v_new: null"));
  EXPECT_THAT(err(q.query(), nullptr), HasSubstr("out: null"));
  EXPECT_THAT(err(q.query(), nullptr), HasSubstr("out"));
  CompactLayerView empty;
  EXPECT_EQ(PackedAttentionCpu(empty, q.query(), out.data()).code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvc

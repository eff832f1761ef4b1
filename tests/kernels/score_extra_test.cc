// KeyDiff, expected attention and value-aware scores against straightforward double-precision
// reference code written here, the RoPE helpers (round trip, both pair styles), obs_window 0 for
// the query-agnostic policies, and the errors of every new field.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/select_util.h"
#include "kvc/backend.h"
#include "kvc/protocol/spec_string.h"
#include "kvc/rope.h"
#include "kvc/selection.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing::RandomLayer;
using testing::RandomValues;
using testing::ReferenceAttentionScores;
using testing::TestLayer;

// Element (h, s, c) of a layer tensor, as the engine sees it (dtype-rounded).
double At(const TestLayer& l, const std::vector<uint8_t>& buf, int heads, int tokens, int h, int s,
          int c) {
  return LoadAsFloat(buf.data(), l.dtype,
                     ElementOffset(l.layout, heads, tokens, l.shape.head_dim, h, s, c));
}
std::vector<double> Row(const TestLayer& l, const std::vector<uint8_t>& buf, int heads, int tokens,
                        int h, int s) {
  std::vector<double> r(l.shape.head_dim);
  for (int c = 0; c < l.shape.head_dim; ++c) r[c] = At(l, buf, heads, tokens, h, s, c);
  return r;
}
double Dot(const std::vector<double>& a, const std::vector<double>& b) {
  return std::inner_product(a.begin(), a.end(), b.begin(), 0.0);
}

// RoPE written out: pair p of the first rd channels turns by pos / factor * theta^(-2p/rd).
void RefRotate(const RopeParams& r, double pos, std::vector<double>& x) {
  const int d = static_cast<int>(x.size()), rd = r.rotary_dims == 0 ? d : r.rotary_dims;
  for (int p = 0; p < rd / 2; ++p) {
    const int i0 = r.half_split ? p : 2 * p, i1 = r.half_split ? p + rd / 2 : 2 * p + 1;
    const double a = pos / r.linear_factor * std::pow(r.theta, -2.0 * p / rd);
    const double x0 = x[i0], x1 = x[i1];
    x[i0] = x0 * std::cos(a) - x1 * std::sin(a);
    x[i1] = x0 * std::sin(a) + x1 * std::cos(a);
  }
}

// Mean over positions [first, first + n) of RoPE(pos) x.
std::vector<double> RefMeanRotate(const RopeParams& r, int first, int n, std::vector<double> x) {
  std::vector<double> acc(x.size(), 0.0);
  for (int i = 0; i < n; ++i) {
    std::vector<double> y = x;
    RefRotate(r, first + i, y);
    for (size_t c = 0; c < x.size(); ++c) acc[c] += y[c] / n;
  }
  return acc;
}

std::vector<double> ValueNorms(const TestLayer& l, int h) {
  const int S = l.shape.seq_len;
  std::vector<double> n(S);
  for (int j = 0; j < S; ++j) {
    const auto v = Row(l, l.v, l.shape.num_kv_heads, S, h, j);
    n[j] = std::sqrt(Dot(v, v));
  }
  return n;
}

void RefValueWeight(const TestLayer& l, ValueWeight w, double eps, std::vector<double>& s) {
  const int S = l.shape.seq_len;
  for (int h = 0; h < l.shape.num_kv_heads; ++h) {
    const std::vector<double> n = ValueNorms(l, h);
    double* sh = s.data() + static_cast<size_t>(h) * S;
    const double mn = std::accumulate(n.begin(), n.end(), 0.0) / S;
    const double ms = std::accumulate(sh, sh + S, 0.0) / S;
    for (int j = 0; j < S; ++j) {
      sh[j] = w == ValueWeight::kMul ? sh[j] * (n[j] + eps * mn) : (sh[j] + eps * ms) * n[j];
    }
  }
}

std::vector<double> RefKeyDiff(const TestLayer& l) {
  const int H = l.shape.num_kv_heads, S = l.shape.seq_len, D = l.shape.head_dim;
  std::vector<double> out(static_cast<size_t>(H) * S);
  for (int h = 0; h < H; ++h) {
    std::vector<double> m(D, 0.0);
    for (int j = 0; j < S; ++j) {
      const auto k = Row(l, l.k, H, S, h, j);
      const double n = std::sqrt(Dot(k, k));
      for (int c = 0; c < D; ++c) m[c] += k[c] / n / S;
    }
    for (int j = 0; j < S; ++j) {
      const auto k = Row(l, l.k, H, S, h, j);
      out[static_cast<size_t>(h) * S + j] = -Dot(k, m) / std::sqrt(Dot(k, k) * Dot(m, m));
    }
  }
  return out;
}

// Statistics [Hq] of mean [D] and covariance [D][D], from Q_obs un-rotated, or given.
struct RefStats {
  std::vector<std::vector<double>> mean;
  std::vector<std::vector<std::vector<double>>> cov;
};

RefStats StatsFromQobs(const TestLayer& l, const RopeParams& rope) {
  const int Hq = l.shape.num_q_heads, W = l.shape.obs_window, D = l.shape.head_dim;
  const int S = l.shape.seq_len;
  RefStats st;
  for (int qh = 0; qh < Hq; ++qh) {
    std::vector<std::vector<double>> rows;
    for (int t = 0; t < W; ++t) {
      auto q = Row(l, l.q, Hq, W, qh, t);
      RefRotate(rope, -(S - W + t), q);
      rows.push_back(q);
    }
    std::vector<double> mu(D, 0.0);
    for (const auto& q : rows) {
      for (int c = 0; c < D; ++c) mu[c] += q[c] / W;
    }
    std::vector<std::vector<double>> cov(D, std::vector<double>(D, 0.0));
    for (const auto& q : rows) {
      for (int a = 0; a < D; ++a) {
        for (int b = 0; b < D; ++b) cov[a][b] += (q[a] - mu[a]) * (q[b] - mu[b]) / W;
      }
    }
    st.mean.push_back(mu);
    st.cov.push_back(cov);
  }
  return st;
}

std::vector<double> RefExpected(const TestLayer& l, const RopeParams& rope, RefStats st,
                                int horizon) {
  const int H = l.shape.num_kv_heads, S = l.shape.seq_len, D = l.shape.head_dim;
  const int g = l.shape.group_size();
  std::vector<double> out(static_cast<size_t>(H) * S, 0.0);
  for (int qh = 0; qh < l.shape.num_q_heads; ++qh) {
    // R mu and R Sigma R^T, R the mean rotation (a linear map: apply it to columns, then rows).
    const std::vector<double> mu = RefMeanRotate(rope, S, horizon, st.mean[qh]);
    std::vector<std::vector<double>> c = st.cov[qh];
    for (int r = 0; r < D; ++r) c[r] = RefMeanRotate(rope, S, horizon, c[r]);
    for (int j = 0; j < D; ++j) {
      std::vector<double> col(D);
      for (int r = 0; r < D; ++r) col[r] = c[r][j];
      col = RefMeanRotate(rope, S, horizon, col);
      for (int r = 0; r < D; ++r) c[r][j] = col[r];
    }
    const int h = qh / g;
    std::vector<double> z(S);
    for (int j = 0; j < S; ++j) {
      const auto k = Row(l, l.k, H, S, h, j);
      double quad = 0;
      for (int a = 0; a < D; ++a) quad += k[a] * Dot(c[a], k);
      z[j] = Dot(k, mu) / std::sqrt(D) + quad / (2.0 * D);
    }
    const double m = *std::max_element(z.begin(), z.end());
    double sum = 0;
    for (double& x : z) sum += (x = std::exp(x - m));
    for (int j = 0; j < S; ++j) out[static_cast<size_t>(h) * S + j] += z[j] / sum / g;
  }
  return out;
}

void ExpectClose(const std::vector<float>& got, const std::vector<double>& want, double rel,
                 const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double scale = 0;
  for (double w : want) scale = std::max(scale, std::abs(w));
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], rel * scale + 1e-7) << what << " index " << i;
  }
}

RopeParams Llama(bool half_split, int rotary_dims = 0) {
  RopeParams r;
  r.theta = 10000.0;
  r.half_split = half_split;
  r.rotary_dims = rotary_dims;
  return r;
}

TEST(RopeTest, RotateVectorMatchesReferenceAndRoundTrips) {
  for (bool half : {false, true}) {
    for (int rd : {0, 16}) {
      RopeParams r = Llama(half, rd);
      r.linear_factor = rd == 0 ? 1.0 : 2.0;
      const std::vector<float> x0 = RandomValues(32, 5 + rd);
      std::vector<float> x = x0;
      std::vector<double> want(x0.begin(), x0.end());
      RotateVector(r, 32, 1234, x.data());
      RefRotate(r, 1234, want);
      for (int c = 0; c < 32; ++c) ASSERT_NEAR(x[c], want[c], 1e-5) << c;
      RotateVector(r, 32, -1234, x.data());  // and back: the un-rotation expected attention uses
      for (int c = 0; c < 32; ++c) ASSERT_NEAR(x[c], x0[c], 1e-5) << c;
    }
  }
}

TEST(ScoreExtraTest, KeyDiffMatchesReference) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    for (Layout lay : {Layout::kHND, Layout::kNHD}) {
      const TestLayer l = RandomLayer(LayerShape{3, 6, 1500, 16, 0}, 7, t, lay);
      EvictionSpec spec;
      spec.policy = EvictionPolicy::kKeyDiff;
      absl::StatusOr<std::vector<float>> got = ScoreTokens(l.input(), spec);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectClose(*got, RefKeyDiff(l), 1e-5, "keydiff");
    }
  }
}

TEST(ScoreExtraTest, ValueWeightedAttentionScoresMatchReference) {
  const TestLayer l = RandomLayer(LayerShape{2, 4, 90, 16, 6}, 9);
  for (EvictionPolicy p : {EvictionPolicy::kH2O, EvictionPolicy::kKeyformer}) {
    for (ValueWeight w : {ValueWeight::kMul, ValueWeight::kAdd}) {
      EvictionSpec spec;
      spec.policy = p;
      spec.seed = 3;
      spec.value_weight = w;
      spec.value_eps = 0.1;
      std::vector<double> want = ReferenceAttentionScores(l, spec);
      RefValueWeight(l, w, 0.1, want);
      absl::StatusOr<std::vector<float>> got = ScoreTokens(l.input(), spec);
      ASSERT_TRUE(got.ok()) << got.status();
      ExpectClose(*got, want, 1e-5, "value weighted");
    }
  }
}

TEST(ScoreExtraTest, ExpectedFromObservationQueriesMatchesReference) {
  for (bool half : {false, true}) {
    for (DType t : {DType::kF32, DType::kF16}) {
      const TestLayer l = RandomLayer(LayerShape{2, 4, 70, 16, 9}, 21, t);
      const RopeParams rope = Llama(half, half ? 8 : 0);
      LayerInput in = l.input();
      in.rope = &rope;
      EvictionSpec spec;
      spec.policy = EvictionPolicy::kExpectedAttention;
      spec.horizon = 17;
      spec.value_weight = ValueWeight::kOff;
      absl::StatusOr<std::vector<float>> got = ScoreTokens(in, spec);
      ASSERT_TRUE(got.ok()) << got.status();
      const std::vector<double> want = RefExpected(l, rope, StatsFromQobs(l, rope), 17);
      ExpectClose(*got, want, 2e-5, "expected");
      // The default weights by the value norm.
      spec.value_weight = ValueWeight::kAuto;
      got = ScoreTokens(in, spec);
      ASSERT_TRUE(got.ok()) << got.status();
      std::vector<double> weighted = want;
      RefValueWeight(l, ValueWeight::kMul, spec.value_eps, weighted);
      ExpectClose(*got, weighted, 2e-5, "expected * ||v||");
    }
  }
}

TEST(ScoreExtraTest, ExpectedFromClientStatisticsWithoutQueries) {
  const LayerShape shape{2, 4, 60, 8, 0};
  const TestLayer l = RandomLayer(shape, 31);
  const int D = 8;
  // Statistics as an engine would send them: mean, then a symmetric PSD covariance.
  std::vector<float> q_stats(QueryStatsFloats(shape));
  RefStats st;
  for (int qh = 0; qh < 4; ++qh) {
    const std::vector<float> mu = RandomValues(D, 40 + qh);
    const std::vector<float> a = RandomValues(D * D, 50 + qh, 0.3f);
    std::vector<std::vector<double>> cov(D, std::vector<double>(D, 0.0));
    for (int i = 0; i < D; ++i) {
      for (int j = 0; j < D; ++j) {
        for (int k = 0; k < D; ++k) cov[i][j] += a[i * D + k] * a[j * D + k];
      }
    }
    float* dst = q_stats.data() + qh * (D + D * D);
    for (int c = 0; c < D; ++c) dst[c] = mu[c];
    for (int i = 0; i < D; ++i) {
      for (int j = 0; j < D; ++j) dst[D + i * D + j] = static_cast<float>(cov[i][j]);
    }
    st.mean.emplace_back(mu.begin(), mu.end());
    for (auto& row : cov) {
      for (int j = 0; j < D; ++j) row[j] = dst[D + (&row - cov.data()) * D + j];
    }
    st.cov.push_back(cov);
  }
  const RopeParams rope = Llama(false);
  LayerInput in = l.input();
  ASSERT_EQ(in.q_obs, nullptr);
  in.rope = &rope;
  in.q_stats = q_stats.data();
  CompressionSpec spec;
  spec.eviction.policy = EvictionPolicy::kExpectedAttention;
  spec.eviction.query_stats = true;
  spec.eviction.keep_ratio = 0.25;
  absl::StatusOr<std::vector<float>> got = ScoreTokens(in, spec.eviction);
  ASSERT_TRUE(got.ok()) << got.status();
  std::vector<double> want = RefExpected(l, rope, st, spec.eviction.horizon);
  RefValueWeight(l, ValueWeight::kMul, spec.eviction.value_eps, want);
  ExpectClose(*got, want, 2e-5, "expected from q_stats");

  // The kept set is the top quarter of the reference scores (no recent window by default).
  absl::StatusOr<TokenSelection> sel = SelectTokens(in, spec);
  ASSERT_TRUE(sel.ok()) << sel.status();
  for (int h = 0; h < 2; ++h) {
    std::vector<int32_t> order(60);
    std::iota(order.begin(), order.end(), 0);
    const double* s = want.data() + h * 60;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return s[a] > s[b]; });
    order.resize(sel->budget);
    std::sort(order.begin(), order.end());
    EXPECT_EQ(testing::HeadPositions(*sel, h), order) << "head " << h;
  }
}

// obs_window 0 is a first-class request for every policy that does not need queries.
TEST(ScoreExtraTest, QueryAgnosticPoliciesWorkWithoutObservationQueries) {
  const LayerShape shape{2, 4, 64, 16, 0};
  const TestLayer l = RandomLayer(shape, 41);
  std::vector<float> q_stats(QueryStatsFloats(shape), 0.0f);
  for (size_t i = 0; i < q_stats.size(); i += 16 + 256) q_stats[i] = 1.0f;
  const RopeParams rope = Llama(true);
  for (EvictionPolicy p :
       {EvictionPolicy::kKNorm, EvictionPolicy::kStreaming, EvictionPolicy::kRandom,
        EvictionPolicy::kKeyDiff, EvictionPolicy::kExpectedAttention}) {
    CompressionSpec spec;
    spec.eviction.policy = p;
    spec.eviction.keep_ratio = 0.25;
    spec.eviction.query_stats = p == EvictionPolicy::kExpectedAttention;
    spec.quant.bits = 4;
    spec.quant.group_size = 16;
    spec.recent_tokens = 4;
    LayerInput in = l.input();
    in.rope = &rope;
    in.q_stats = q_stats.data();
    absl::StatusOr<TokenSelection> sel = SelectTokens(in, spec);
    ASSERT_TRUE(sel.ok()) << PolicyName(p) << ": " << sel.status();
    EXPECT_EQ(sel->budget, 16);
    absl::StatusOr<std::unique_ptr<Backend>> cpu = CreateCpuBackend(BackendOptions{});
    ASSERT_TRUE(cpu.ok());
    absl::StatusOr<CompactLayer> out = (*cpu)->Compress(in, spec, nullptr);
    ASSERT_TRUE(out.ok()) << PolicyName(p) << ": " << out.status();
  }
  for (EvictionPolicy p :
       {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV, EvictionPolicy::kKeyformer}) {
    CompressionSpec spec;
    spec.eviction.policy = p;
    absl::Status s = ValidateSpec(spec, shape, 0);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("obs_window"));
  }
}

absl::Status Check(const CompressionSpec& spec, LayerShape shape = {2, 4, 64, 16, 8}) {
  return ValidateSpec(spec, shape, 0);
}

TEST(ScoreExtraTest, RejectsBadFieldsNamingThem) {
  auto expect = [](const absl::Status& s, const char* field) {
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_THAT(s.message(), HasSubstr(field));
  };
  CompressionSpec spec;
  spec.eviction.policy = EvictionPolicy::kH2O;
  spec.eviction.value_eps = -0.1;
  expect(Check(spec), "eviction.value_eps");
  spec.eviction.value_eps = std::nan("");
  expect(Check(spec), "eviction.value_eps");
  spec.eviction.value_eps = INFINITY;
  expect(Check(spec), "eviction.value_eps");
  spec.eviction.value_eps = 0.0;
  EXPECT_TRUE(Check(spec).ok());
  spec.eviction.value_weight = static_cast<ValueWeight>(9);
  expect(Check(spec), "eviction.value_weight");
  spec.eviction.value_weight = ValueWeight::kMul;
  EXPECT_TRUE(Check(spec).ok());
  for (EvictionPolicy p : {EvictionPolicy::kKNorm, EvictionPolicy::kKeyDiff,
                           EvictionPolicy::kStreaming, EvictionPolicy::kRandom}) {
    spec.eviction.policy = p;
    expect(Check(spec), "eviction.value_weight");
  }
  spec = {};
  spec.eviction.policy = EvictionPolicy::kExpectedAttention;
  spec.eviction.horizon = 0;
  expect(Check(spec), "eviction.horizon");
  spec.eviction.horizon = 1;
  EXPECT_TRUE(Check(spec).ok());
  expect(Check(spec, {2, 4, 64, 16, 0}), "eviction.query_stats");  // no queries, no statistics
  spec.eviction.policy = EvictionPolicy::kH2O;
  spec.eviction.query_stats = true;
  expect(Check(spec), "eviction.query_stats");
  spec.eviction.policy = static_cast<EvictionPolicy>(kNumPolicies);
  expect(Check(spec), "eviction.policy");

  // Inputs: expected needs the RoPE, query_stats needs the statistics, the RoPE must be valid.
  const TestLayer l = RandomLayer(LayerShape{2, 4, 64, 16, 8}, 3);
  spec = {};
  spec.eviction.policy = EvictionPolicy::kExpectedAttention;
  spec.eviction.keep_ratio = 0.5;
  LayerInput in = l.input();
  expect(SelectTokens(in, spec).status(), "rope");
  RopeParams rope = Llama(false);
  in.rope = &rope;
  EXPECT_TRUE(SelectTokens(in, spec).ok());
  spec.eviction.query_stats = true;
  expect(SelectTokens(in, spec).status(), "q_stats");
  rope.rotary_dims = 7;
  spec.eviction.query_stats = false;
  expect(SelectTokens(in, spec).status(), "rope.rotary_dims");
  rope.rotary_dims = 0;
  rope.theta = -1;
  expect(ScoreTokens(in, spec.eviction).status(), "rope.theta");
}

TEST(ScoreExtraTest, PolicyNamesAndParsing) {
  EXPECT_EQ(PolicyName(EvictionPolicy::kKeyDiff), "keydiff");
  EXPECT_EQ(PolicyName(EvictionPolicy::kExpectedAttention), "expected");
  EXPECT_EQ(*ParseEvictionPolicy("KeyDiff"), EvictionPolicy::kKeyDiff);
  EXPECT_EQ(*ParseEvictionPolicy("expected"), EvictionPolicy::kExpectedAttention);
  EXPECT_EQ(*ParseValueWeight(""), ValueWeight::kAuto);
  EXPECT_EQ(*ParseValueWeight("mul"), ValueWeight::kMul);
  EXPECT_EQ(*ParseValueWeight("ADD"), ValueWeight::kAdd);
  EXPECT_EQ(*ParseValueWeight("off"), ValueWeight::kOff);
  EXPECT_FALSE(ParseValueWeight("times").ok());
  EvictionSpec e;
  e.policy = EvictionPolicy::kExpectedAttention;
  EXPECT_EQ(EffectiveValueWeight(e), ValueWeight::kMul);
  e.policy = EvictionPolicy::kH2O;
  EXPECT_EQ(EffectiveValueWeight(e), ValueWeight::kOff);
}

TEST(ScoreExtraTest, SpecStringKeys) {
  for (const char* text :
       {"keydiff:0.25", "expected:0.5", "expected:0.25,horizon=32,stats=1", "h2o:0.5,value=mul",
        "snapkv:0.25,value=add,veps=0.1", "expected:0.5,value=off", "keyformer:0.5,value=mul+q4"}) {
    absl::StatusOr<CompressionSpec> s = ParseSpecString(text);
    ASSERT_TRUE(s.ok()) << text << ": " << s.status();
    EXPECT_EQ(SpecString(*s), text);
  }
  absl::StatusOr<CompressionSpec> s = ParseSpecString("expected:0.5,value=add,veps=0,horizon=7");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->eviction.policy, EvictionPolicy::kExpectedAttention);
  EXPECT_EQ(s->eviction.value_weight, ValueWeight::kAdd);
  EXPECT_EQ(s->eviction.value_eps, 0.0);
  EXPECT_EQ(s->eviction.horizon, 7);
  for (const char* bad : {"h2o:0.5,value=", "h2o:0.5,value=times", "h2o:0.5,veps=-1",
                          "h2o:0.5,veps=inf", "expected:0.5,horizon=0", "expected:0.5,stats=2"}) {
    EXPECT_FALSE(ParseSpecString(bad).ok()) << bad;
  }
}

}  // namespace
}  // namespace kvc

// Head-adaptive budgets (EvictionSpec::adaptive): the engine's selection against a plain-loop
// reference over random layers, edge cases (alpha 0 and 1, B = S, tiny B), validation, and the
// ragged selection through SelectChannels, PackLayer / PackedSize and the DENSE exports.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/pack_util.h"
#include "kernels/select_util.h"
#include "kvc/compact.h"
#include "kvc/contiguous_export.h"
#include "kvc/protocol/spec_string.h"
#include "kvc/selection.h"
#include "kvc/spec.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing::HeadPositions;
using testing::RandomLayer;
using testing::TestLayer;

// The protected tokens of kvc/selection.h, written out again: {sinks, recent}.
std::pair<int, int> RefProtected(const EvictionSpec& e, int w, int b) {
  const double rf = e.recent_fraction >= 0 ? e.recent_fraction
                                           : (e.policy == EvictionPolicy::kKeyformer ? 0.3 : 0.5);
  switch (e.policy) {
    case EvictionPolicy::kH2O:
    case EvictionPolicy::kKeyformer:
      return {0, std::min(b, static_cast<int>(rf * b))};
    case EvictionPolicy::kSnapKV:
      return {0, std::min(w, b)};
    default:
      return {0, 0};
  }
}

bool Before(float sa, float sb) {  // higher first, NaN last; false when equal
  const bool na = std::isnan(sa), nb = std::isnan(sb);
  if (na != nb) return nb;
  return !na && sa > sb;
}

// Straightforward AdaKV: compare heads by raw score (softmax per head for knorm), keep per
// head the protected tokens and its top `own` candidates, then the best normalised candidates of
// all heads until the layer holds H * B.
std::vector<std::vector<int32_t>> RefAdaptive(const std::vector<float>& scores, int H, int S, int B,
                                              int W, const EvictionSpec& e) {
  const auto [sinks, recent] = RefProtected(e, W, B);
  const int prot = sinks + recent;
  std::vector<float> norm(scores.size());
  for (int h = 0; h < H; ++h) {
    const float* x = &scores[static_cast<size_t>(h) * S];
    float* y = &norm[static_cast<size_t>(h) * S];
    if (e.policy == EvictionPolicy::kKNorm) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int j = 0; j < S; ++j) mx = std::max(mx, x[j]);
      double sum = 0;
      for (int j = 0; j < S; ++j) sum += std::exp(static_cast<double>(x[j]) - mx);
      for (int j = 0; j < S; ++j) {
        y[j] = static_cast<float>(std::exp(static_cast<double>(x[j]) - mx) / sum);
      }
    } else {
      for (int j = 0; j < S; ++j) y[j] = x[j];
    }
  }
  int own = static_cast<int>(std::floor(e.adaptive_floor * B));
  if (prot == 0 && own < 1) own = 1;
  own = std::min(own, B - prot);
  std::vector<std::vector<int32_t>> kept(H);
  struct C {
    float s;
    int h, j;
  };
  std::vector<C> rest;
  for (int h = 0; h < H; ++h) {
    std::vector<int32_t> cand;
    for (int j = sinks; j < S - recent; ++j) cand.push_back(j);
    const float* x = &scores[static_cast<size_t>(h) * S];
    std::sort(cand.begin(), cand.end(), [x](int a, int b) {
      if (Before(x[a], x[b])) return true;
      if (Before(x[b], x[a])) return false;
      return a < b;
    });
    for (int i = 0; i < static_cast<int>(cand.size()); ++i) {
      if (i < own) {
        kept[h].push_back(cand[i]);
      } else {
        rest.push_back({norm[static_cast<size_t>(h) * S + cand[i]], h, cand[i]});
      }
    }
    for (int j = 0; j < sinks; ++j) kept[h].push_back(j);
    for (int j = S - recent; j < S; ++j) kept[h].push_back(j);
  }
  std::sort(rest.begin(), rest.end(), [](const C& a, const C& b) {
    if (Before(a.s, b.s)) return true;
    if (Before(b.s, a.s)) return false;
    return a.h != b.h ? a.h < b.h : a.j < b.j;
  });
  const size_t extra = static_cast<size_t>(H) * (B - prot - own);
  for (size_t i = 0; i < extra && i < rest.size(); ++i) kept[rest[i].h].push_back(rest[i].j);
  for (auto& k : kept) std::sort(k.begin(), k.end());
  return kept;
}

CompressionSpec Adaptive(EvictionPolicy p, int budget, double alpha) {
  CompressionSpec s;
  s.eviction.policy = p;
  s.eviction.budget = budget;
  s.eviction.adaptive = true;
  s.eviction.adaptive_floor = alpha;
  s.eviction.seed = 7;
  return s;
}

void ExpectWellFormed(const TokenSelection& sel, int H, int S, int B) {
  ASSERT_EQ(sel.num_kv_heads, H);
  size_t sum = 0;
  int mx = 0;
  for (int h = 0; h < H; ++h) {
    const int n = sel.count(h);
    EXPECT_GE(n, 1) << "head " << h;
    EXPECT_LE(n, S) << "head " << h;
    sum += static_cast<size_t>(n);
    mx = std::max(mx, n);
    const std::vector<int32_t> p = HeadPositions(sel, h);
    for (size_t i = 1; i < p.size(); ++i) ASSERT_LT(p[i - 1], p[i]);
  }
  EXPECT_EQ(sum, static_cast<size_t>(H) * B) << "the layer keeps H * B tokens in all";
  EXPECT_EQ(sel.positions.size(), sum);
  EXPECT_EQ(sel.budget, mx);
}

TEST(AdaptiveSelectTest, MatchesReferenceOnRandomLayers) {
  const EvictionPolicy policies[] = {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV,
                                     EvictionPolicy::kKeyformer, EvictionPolicy::kKNorm,
                                     EvictionPolicy::kRandom};
  int ragged_cases = 0;
  uint64_t seed = 1;
  for (const LayerShape& shape : {LayerShape{4, 8, 17, 16, 4}, LayerShape{4, 4, 64, 16, 8},
                                  LayerShape{3, 6, 150, 32, 16}, LayerShape{1, 2, 40, 16, 8}}) {
    const TestLayer layer = RandomLayer(shape, seed++, DType::kF32);
    const int S = shape.seq_len, H = shape.num_kv_heads;
    for (EvictionPolicy pol : policies) {
      for (double alpha : {0.0, 0.2, 0.5, 1.0}) {
        for (int B : {1, 2, 3, S / 4, S / 2, S - 1, S}) {
          if (B < 1) continue;
          SCOPED_TRACE(::testing::Message() << "H " << H << " S " << S << " policy "
                                            << PolicyName(pol) << " alpha " << alpha << " B " << B);
          const CompressionSpec spec = Adaptive(pol, B, alpha);
          absl::StatusOr<std::vector<float>> scores = ScoreTokens(layer.input(), spec.eviction);
          ASSERT_TRUE(scores.ok()) << scores.status();
          absl::StatusOr<TokenSelection> sel = SelectTokens(layer.input(), spec);
          ASSERT_TRUE(sel.ok()) << sel.status();
          ExpectWellFormed(*sel, H, S, B);
          const auto ref = RefAdaptive(*scores, H, S, B, shape.obs_window, spec.eviction);
          for (int h = 0; h < H; ++h) {
            ASSERT_EQ(HeadPositions(*sel, h), ref[h]) << "head " << h;
          }
          if (sel->ragged()) ++ragged_cases;
        }
      }
    }
  }
  EXPECT_GT(ragged_cases, 50);  // the grid really exercises unequal counts
}

TEST(AdaptiveSelectTest, FloorOneIsTheUniformSelection) {
  const LayerShape shape{4, 8, 90, 16, 8};
  const TestLayer layer = RandomLayer(shape, 11, DType::kF16);
  for (EvictionPolicy pol : {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV,
                             EvictionPolicy::kKeyformer, EvictionPolicy::kKNorm}) {
    for (int B : {1, 5, 30, 90}) {
      CompressionSpec ada = Adaptive(pol, B, 1.0);
      CompressionSpec uni = ada;
      uni.eviction.adaptive = false;
      absl::StatusOr<TokenSelection> a = SelectTokens(layer.input(), ada);
      absl::StatusOr<TokenSelection> u = SelectTokens(layer.input(), uni);
      ASSERT_TRUE(a.ok() && u.ok());
      for (int h = 0; h < 4; ++h) {
        EXPECT_EQ(HeadPositions(*a, h), HeadPositions(*u, h)) << PolicyName(pol) << " " << B;
      }
    }
  }
}

// With one KV head there is nothing to trade: adaptive keeps exactly the uniform set (why it
// cannot help on a model like passkey4L, one KV head per layer).
TEST(AdaptiveSelectTest, OneKvHeadIsUniform) {
  const LayerShape shape{1, 4, 120, 16, 8};
  const TestLayer layer = RandomLayer(shape, 12, DType::kF32);
  for (EvictionPolicy pol :
       {EvictionPolicy::kH2O, EvictionPolicy::kSnapKV, EvictionPolicy::kKeyformer}) {
    for (double alpha : {0.0, 0.2}) {
      CompressionSpec ada = Adaptive(pol, 30, alpha);
      CompressionSpec uni = ada;
      uni.eviction.adaptive = false;
      absl::StatusOr<TokenSelection> a = SelectTokens(layer.input(), ada);
      absl::StatusOr<TokenSelection> u = SelectTokens(layer.input(), uni);
      ASSERT_TRUE(a.ok() && u.ok());
      EXPECT_EQ(HeadPositions(*a, 0), HeadPositions(*u, 0)) << PolicyName(pol) << " " << alpha;
    }
  }
}

// Head 0 attends to one key, head 1 spreads its attention evenly: at alpha 0 the shared budget
// goes to head 1, whose tokens carry more of its attention mass.
TEST(AdaptiveSelectTest, BudgetMovesToTheDiffuseHead) {
  const int S = 40, D = 8, W = 4;
  const LayerShape shape{2, 2, S, D, W};
  std::vector<float> k(2 * S * D, 0.0f), q(2 * W * D, 0.0f);
  k[(0 * S + 10) * D] = 40.0f;  // head 0: key 10 dominates
  for (int r = 0; r < 2 * W; ++r) q[r * D] = 1.0f;
  const TestLayer layer = testing::MakeLayer(shape, k, k, q);
  CompressionSpec spec = Adaptive(EvictionPolicy::kSnapKV, 10, 0.0);
  spec.eviction.pool_kernel = 1;
  absl::StatusOr<TokenSelection> sel = SelectTokens(layer.input(), spec);
  ASSERT_TRUE(sel.ok()) << sel.status();
  ASSERT_TRUE(sel->ragged());
  // Both keep the window (4); of the 12 shared slots head 0 takes key 10, head 1 the other 11.
  EXPECT_EQ(sel->counts, (std::vector<int>{5, 15}));
  EXPECT_EQ(HeadPositions(*sel, 0), (std::vector<int32_t>{10, 36, 37, 38, 39}));
}

TEST(AdaptiveSelectTest, TinyBudgetKeepsOneTokenPerHead) {
  const LayerShape shape{4, 4, 33, 16, 4};
  const TestLayer layer = RandomLayer(shape, 5, DType::kF32);
  for (EvictionPolicy pol : {EvictionPolicy::kKNorm, EvictionPolicy::kRandom}) {
    absl::StatusOr<TokenSelection> sel = SelectTokens(layer.input(), Adaptive(pol, 1, 0.0));
    ASSERT_TRUE(sel.ok());
    ExpectWellFormed(*sel, 4, 33, 1);
    for (int h = 0; h < 4; ++h) EXPECT_EQ(sel->count(h), 1);
  }
}

TEST(AdaptiveSelectTest, FullBudgetKeepsEverything) {
  const LayerShape shape{3, 3, 20, 16, 4};
  const TestLayer layer = RandomLayer(shape, 6, DType::kF32);
  absl::StatusOr<TokenSelection> sel =
      SelectTokens(layer.input(), Adaptive(EvictionPolicy::kH2O, 20, 0.0));
  ASSERT_TRUE(sel.ok());
  std::vector<int32_t> all(20);
  std::iota(all.begin(), all.end(), 0);
  for (int h = 0; h < 3; ++h) EXPECT_EQ(HeadPositions(*sel, h), all);
}

TEST(AdaptiveSpecTest, RejectsBadOptions) {
  const LayerShape shape{2, 2, 20, 16, 4};
  auto err = [&](CompressionSpec s) {
    const absl::Status st = ValidateSpec(s, shape, 0);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    return std::string(st.message());
  };
  EXPECT_THAT(err(Adaptive(EvictionPolicy::kH2O, 5, -0.1)),
              HasSubstr("eviction.adaptive_floor: -0.1 is outside [0, 1]"));
  EXPECT_THAT(err(Adaptive(EvictionPolicy::kH2O, 5, 1.5)), HasSubstr("eviction.adaptive_floor"));
  EXPECT_THAT(err(Adaptive(EvictionPolicy::kH2O, 5, std::nan(""))),
              HasSubstr("eviction.adaptive_floor"));
  EXPECT_THAT(err(Adaptive(EvictionPolicy::kStreaming, 5, 0.2)),
              HasSubstr("eviction.adaptive: needs a scoring policy"));
  EXPECT_THAT(err(Adaptive(EvictionPolicy::kNone, 5, 0.2)), HasSubstr("eviction.adaptive"));
  CompressionSpec per_layer = Adaptive(EvictionPolicy::kSnapKV, 5, 0.2);
  per_layer.eviction.granularity = Granularity::kPerLayer;
  EXPECT_THAT(err(per_layer), HasSubstr("per-head granularity"));
  // The floor is not checked while adaptive is off.
  CompressionSpec off = Adaptive(EvictionPolicy::kH2O, 5, 7.0);
  off.eviction.adaptive = false;
  EXPECT_TRUE(ValidateSpec(off, shape, 0).ok());
}

TEST(AdaptiveSpecTest, SpecStringKey) {
  absl::StatusOr<CompressionSpec> s = ParseSpecString("h2o:0.5,ada=0.25+q4");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->eviction.adaptive);
  EXPECT_EQ(s->eviction.adaptive_floor, 0.25);
  EXPECT_EQ(SpecString(*s), "h2o:0.5,ada=0.25+q4");
  absl::StatusOr<CompressionSpec> zero = ParseSpecString("snapkv:0.25,ada=0");
  ASSERT_TRUE(zero.ok());
  EXPECT_EQ(SpecString(*zero), "snapkv:0.25,ada=0");
  EXPECT_FALSE(ParseSpecString("h2o:0.5").value().eviction.adaptive);
  EXPECT_THAT(std::string(ParseSpecString("h2o:0.5,ada=1.5").status().message()),
              HasSubstr("ada 1.5 is outside [0, 1]"));
  EXPECT_FALSE(ParseSpecString("h2o:0.5,ada=x").ok());
}

// Channel selection on a ragged set prunes each head on its own kept tokens: head h's channels
// equal those of a uniform selection in which every head keeps head h's positions.
TEST(AdaptiveChannelsTest, EachHeadPrunesOnItsOwnTokens) {
  const LayerShape shape{4, 8, 80, 16, 8};
  const TestLayer layer = RandomLayer(shape, 9, DType::kF32);
  CompressionSpec spec = Adaptive(EvictionPolicy::kH2O, 20, 0.0);
  spec.channels.key_policy = ChannelPolicy::kThink;
  spec.channels.key_lambda = 0.5;
  spec.channels.prune_values = true;
  spec.channels.value_lambda = 0.25;
  spec.recent_tokens = 3;
  absl::StatusOr<TokenSelection> sel = SelectTokens(layer.input(), spec);
  ASSERT_TRUE(sel.ok());
  ASSERT_TRUE(sel->ragged());
  absl::StatusOr<ChannelSelection> ch = SelectChannels(layer.input(), *sel, spec);
  ASSERT_TRUE(ch.ok()) << ch.status();
  for (int h = 0; h < 4; ++h) {
    TokenSelection uni;
    uni.num_kv_heads = 4;
    uni.budget = sel->count(h);
    for (int i = 0; i < 4; ++i) {
      uni.positions.insert(uni.positions.end(), sel->head(h), sel->head(h) + sel->count(h));
    }
    absl::StatusOr<ChannelSelection> ref = SelectChannels(layer.input(), uni, spec);
    ASSERT_TRUE(ref.ok());
    EXPECT_EQ(testing::HeadKeyChannels(*ch, h), testing::HeadKeyChannels(*ref, h)) << h;
    EXPECT_EQ(testing::HeadValueChannels(*ch, h), testing::HeadValueChannels(*ref, h)) << h;
  }
  TokenSelection bad = *sel;
  bad.counts[0] += 1;
  EXPECT_THAT(std::string(SelectChannels(layer.input(), bad, spec).status().message()),
              HasSubstr("tokens.positions: size"));
  bad.counts[0] = 0;
  EXPECT_THAT(std::string(SelectChannels(layer.input(), bad, spec).status().message()),
              HasSubstr("tokens.counts[0]: 0"));
}

// A ragged selection packs into a blob whose heads hold their own counts, whose size is what
// PackedSize says and clearly below H sections of the largest count, and whose rows are exact.
TEST(AdaptivePackTest, RaggedRoundTrip) {
  std::mt19937 rng(3);
  for (int bits : {0, 4}) {
    for (int tk : {16, 9}) {
      SCOPED_TRACE(::testing::Message() << "bits " << bits << " tk " << tk);
      const int H = 4, S = 96, D = 16;
      const testing_pack::PackLayerData layer =
          testing_pack::MakePackLayer(H, S, D, DType::kF16, Layout::kNHD, 17);
      TokenSelection tokens;
      tokens.num_kv_heads = H;
      tokens.counts = {3, 40, 1, 52};  // sum 96 = H * 24
      for (int h = 0; h < H; ++h) {
        std::vector<int32_t> all(S);
        std::iota(all.begin(), all.end(), 0);
        std::shuffle(all.begin(), all.end(), rng);
        all.resize(tokens.counts[h]);
        std::sort(all.begin(), all.end());
        tokens.positions.insert(tokens.positions.end(), all.begin(), all.end());
      }
      tokens.budget = 52;
      const ChannelSelection channels = testing_pack::RandomChannels(H, D, tk, D, &rng);
      CompressionSpec spec;
      spec.quant.bits = bits;
      spec.quant.group_size = 8;
      spec.recent_tokens = 4;
      absl::StatusOr<CompactLayer> packed = PackLayer(layer.input(), tokens, channels, spec);
      ASSERT_TRUE(packed.ok()) << packed.status();
      EXPECT_EQ(packed->bytes.size(), PackedSize(layer.shape, layer.dtype, tokens, channels, spec));
      TokenSelection padded = tokens;  // H heads of the largest count
      padded.counts.clear();
      padded.positions.resize(static_cast<size_t>(H) * 52);
      EXPECT_LT(packed->bytes.size() * 3,
                PackedSize(layer.shape, layer.dtype, padded, channels, spec) * 2);
      absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
      ASSERT_TRUE(view.ok()) << view.status();
      EXPECT_EQ(view->max_kept(), 52);
      const bool reduced = bits > 0 || tk < D;
      for (int h = 0; h < H; ++h) {
        const int n = tokens.counts[h];
        const int r = reduced ? std::min(4, n) : 0;
        ASSERT_EQ(view->desc(h).n_kept, n);
        ASSERT_EQ(view->desc(h).n_recent, r);
        const CompactHead hd = view->head(h);
        EXPECT_EQ(std::vector<int32_t>(hd.positions, hd.positions + n), HeadPositions(tokens, h));
        std::vector<float> k(static_cast<size_t>(n) * D), v(k.size()), ek, ev;
        UnpackHeadToFloat(*view, h, k.data(), v.data());
        testing_pack::ExpectedHeadRows(layer, tokens, channels, h, r, &ek, &ev);
        const float tol = bits > 0 ? 0.3f : 0.0f;  // 4-bit codes over [-2, 2]
        for (size_t i = 0; i < k.size(); ++i) {
          ASSERT_NEAR(k[i], ek[i], tol) << h << " " << i;
          ASSERT_NEAR(v[i], ev[i], tol) << h << " " << i;
        }
      }
      // DENSE pads to the largest count; the contiguous export refuses ragged heads.
      absl::StatusOr<DenseLayer> dense = ExportDense(*view);
      ASSERT_TRUE(dense.ok()) << dense.status();
      EXPECT_EQ(dense->n_kept, 52);
      EXPECT_EQ(dense->counts, tokens.counts);
      for (int h = 0; h < H; ++h) {
        for (int j = 0; j < 52; ++j) {
          const int32_t want = j < tokens.counts[h] ? tokens.head(h)[j] : -1;
          ASSERT_EQ(dense->positions[static_cast<size_t>(h) * 52 + j], want);
        }
      }
      RopeParams rope;
      absl::StatusOr<DenseLayer> contiguous = ExportDenseContiguous(*view, rope);
      EXPECT_EQ(contiguous.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(std::string(contiguous.status().message()), HasSubstr("head 1 keeps 40"));
    }
  }
}

// End to end in the engine: SelectTokens -> SelectChannels -> PackLayer over real scores.
TEST(AdaptivePackTest, EngineStagesCompose) {
  const LayerShape shape{4, 8, 120, 32, 16};
  const TestLayer layer = RandomLayer(shape, 21, DType::kBF16);
  CompressionSpec spec = Adaptive(EvictionPolicy::kKeyformer, 30, 0.2);
  spec.channels.key_policy = ChannelPolicy::kThink;
  spec.channels.key_lambda = 0.5;
  spec.quant.bits = 8;
  absl::StatusOr<TokenSelection> sel = SelectTokens(layer.input(), spec);
  ASSERT_TRUE(sel.ok());
  ASSERT_TRUE(sel->ragged());
  absl::StatusOr<ChannelSelection> ch = SelectChannels(layer.input(), *sel, spec);
  ASSERT_TRUE(ch.ok());
  absl::StatusOr<CompactLayer> packed = PackLayer(layer.input(), *sel, *ch, spec);
  ASSERT_TRUE(packed.ok()) << packed.status();
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
  ASSERT_TRUE(view.ok());
  int total = 0;
  for (int h = 0; h < 4; ++h) total += view->desc(h).n_kept;
  EXPECT_EQ(total, 4 * 30);
}

}  // namespace
}  // namespace kvc

// CpuBackend: Compress composes SelectTokens -> SelectChannels -> PackLayer; results do not
// depend on thread count, layout or concurrent use; bad input is rejected with the field named.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/isa_util.h"
#include "kernels/select_util.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/selection.h"
// The backend's pool (internal header of the CPU backend).
#include "kvc/thread_pool.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing::RandomLayer;
using testing::TestLayer;

std::unique_ptr<Backend> MakeCpu(int threads) {
  absl::StatusOr<std::unique_ptr<Backend>> b = CreateCpuBackend({.num_threads = threads});
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? std::move(*b) : nullptr;
}

CompressionSpec DefaultSpec() {
  CompressionSpec s;
  s.eviction.policy = EvictionPolicy::kKeyformer;
  s.eviction.keep_ratio = 0.25;
  s.eviction.seed = 3;
  s.channels.key_policy = ChannelPolicy::kThink;
  s.channels.key_lambda = 0.5;
  s.recent_tokens = 8;
  return s;
}

TEST(CpuBackendTest, NameAndDescription) {
  auto b = MakeCpu(3);
  EXPECT_EQ(b->name(), "cpu");
  EXPECT_THAT(b->description(), HasSubstr("3 threads"));
  absl::StatusOr<std::unique_ptr<Backend>> bad = CreateCpuBackend({.num_threads = -1});
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("num_threads"));
}

TEST(CpuBackendTest, CompressPacksTheSelections) {
  const TestLayer layer = RandomLayer({4, 16, 256, 64, 16}, 7, DType::kF16);
  const CompressionSpec spec = DefaultSpec();
  auto b = MakeCpu(2);
  CompressTimings t;
  absl::StatusOr<CompactLayer> blob = b->Compress(layer.input(), spec, &t);
  ASSERT_TRUE(blob.ok()) << blob.status();
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob->bytes);
  ASSERT_TRUE(view.ok()) << view.status();

  absl::StatusOr<TokenSelection> tokens = SelectTokens(layer.input(), spec);
  ASSERT_TRUE(tokens.ok());
  absl::StatusOr<ChannelSelection> channels = SelectChannels(layer.input(), *tokens, spec);
  ASSERT_TRUE(channels.ok());
  EXPECT_EQ(view->num_kv_heads(), 4);
  EXPECT_EQ(view->seq_len(), 256);
  for (int h = 0; h < 4; ++h) {
    const CompactHead head = view->head(h);
    ASSERT_EQ(head.n_kept, 64);
    EXPECT_EQ(head.n_recent, 8);
    ASSERT_EQ(head.key_channels, 32);
    EXPECT_EQ(head.value_channels, 64);
    EXPECT_EQ(std::vector<int32_t>(head.positions, head.positions + 64),
              testing::HeadPositions(*tokens, h));
    EXPECT_EQ(std::vector<int32_t>(head.key_idx, head.key_idx + 32),
              testing::HeadKeyChannels(*channels, h));
  }
  // The packed bytes equal PackLayer on the public stages' output.
  absl::StatusOr<CompactLayer> direct = PackLayer(layer.input(), *tokens, *channels, spec);
  ASSERT_TRUE(direct.ok());
  EXPECT_EQ(direct->bytes, blob->bytes);

  EXPECT_GT(t.score, 0.0);
  EXPECT_GE(t.select, 0.0);
  EXPECT_GT(t.pack, 0.0);
  EXPECT_EQ(t.quantize, 0.0);  // bits == 0: nothing is quantized
  EXPECT_GE(t.total, t.score + t.pack);

  // With quantization the packing stage's wall time is split between pack and quantize.
  CompressionSpec quantized = spec;
  quantized.quant.bits = 4;
  CompressTimings q;
  ASSERT_TRUE(b->Compress(layer.input(), quantized, &q).ok());
  EXPECT_GT(q.pack, 0.0);
  EXPECT_GT(q.quantize, 0.0);
  EXPECT_GE(q.total, q.score + q.pack + q.quantize);
}

TEST(CpuBackendTest, ResultIndependentOfThreadsLayoutAndConcurrency) {
  const LayerShape shape{6, 24, 300, 32, 12};
  CompressionSpec spec = DefaultSpec();
  spec.channels.prune_values = true;
  spec.channels.value_lambda = 0.25;
  spec.quant.bits = 4;
  const TestLayer hnd = RandomLayer(shape, 5, DType::kBF16, Layout::kHND);
  const TestLayer nhd = RandomLayer(shape, 5, DType::kBF16, Layout::kNHD);
  auto one = MakeCpu(1);
  auto many = MakeCpu(4);
  absl::StatusOr<CompactLayer> ref = one->Compress(hnd.input(), spec, nullptr);
  ASSERT_TRUE(ref.ok()) << ref.status();
  absl::StatusOr<CompactLayer> threaded = many->Compress(hnd.input(), spec, nullptr);
  ASSERT_TRUE(threaded.ok());
  EXPECT_EQ(ref->bytes, threaded->bytes);
  absl::StatusOr<CompactLayer> from_nhd = many->Compress(nhd.input(), spec, nullptr);
  ASSERT_TRUE(from_nhd.ok());
  EXPECT_EQ(ref->bytes, from_nhd->bytes);

  std::vector<ByteVector> results(4);
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 3; ++rep) {
        absl::StatusOr<CompactLayer> r = many->Compress((i % 2 ? nhd : hnd).input(), spec, nullptr);
        if (r.ok()) results[i] = std::move(r->bytes);
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const auto& r : results) EXPECT_EQ(r, ref->bytes);
}

TEST(CpuBackendTest, RejectsBadInputNamingTheField) {
  const TestLayer layer = RandomLayer({2, 4, 64, 16, 4}, 1);
  auto b = MakeCpu(2);
  LayerInput in = layer.input();
  in.v = nullptr;
  absl::StatusOr<CompactLayer> r = b->Compress(in, DefaultSpec(), nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("v: null"));
  CompressionSpec spec = DefaultSpec();
  spec.eviction.budget = 65;
  EXPECT_THAT(std::string(b->Compress(layer.input(), spec, nullptr).status().message()),
              HasSubstr("eviction.budget"));
  spec = DefaultSpec();
  spec.quant.bits = 3;
  EXPECT_THAT(std::string(b->Compress(layer.input(), spec, nullptr).status().message()),
              HasSubstr("quant.bits"));
  // Device memory is the CUDA backend's: the CPU reads host memory only, and says so.
  in = layer.input();
  in.memory = MemorySpace::kDevice;
  r = b->Compress(in, DefaultSpec(), nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(r.status().message()), HasSubstr("memory: k, v and q_obs"));
  EXPECT_EQ(ScoreTokens(in, DefaultSpec().eviction).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuBackendTest, AttendIsPackedAttention) {
  const TestLayer layer = RandomLayer({2, 4, 64, 16, 4}, 2, DType::kF16);
  auto b = MakeCpu(2);
  absl::StatusOr<CompactLayer> blob = b->Compress(layer.input(), DefaultSpec(), nullptr);
  ASSERT_TRUE(blob.ok());
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob->bytes);
  ASSERT_TRUE(view.ok());
  const std::vector<float> q = testing::RandomValues(4 * 1 * 16, 9);
  const std::vector<float> kn = testing::RandomValues(2 * 1 * 16, 10);
  const std::vector<float> vn = testing::RandomValues(2 * 1 * 16, 11);
  DecodeQuery query{.num_q_heads = 4,
                    .n_q = 1,
                    .q = q.data(),
                    .n_new = 1,
                    .k_new = kn.data(),
                    .v_new = vn.data()};
  std::vector<float> out(4 * 16), want(4 * 16);
  ASSERT_TRUE(b->Attend(*view, query, out.data()).ok());
  ASSERT_TRUE(PackedAttentionCpu(*view, query, want.data()).ok());
  EXPECT_EQ(out, want);
  for (float x : out) EXPECT_TRUE(std::isfinite(x));
}

// BackendOptions::attention_math reaches Attend: on 4-bit heads of 64 channels each mode gives
// PackedAttentionCpu's result for that mode, and the integer and fp32 paths differ (so the
// option is not ignored).
TEST(CpuBackendTest, AttendUsesTheChosenAttentionMath) {
  const TestLayer layer = RandomLayer({2, 4, 256, 64, 4}, 5, DType::kF16);
  CompressionSpec spec;
  spec.quant.bits = 4;
  spec.quant.group_size = 32;
  auto plain = MakeCpu(1);
  absl::StatusOr<CompactLayer> blob = plain->Compress(layer.input(), spec, nullptr);
  ASSERT_TRUE(blob.ok()) << blob.status();
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob->bytes);
  ASSERT_TRUE(view.ok());
  const std::vector<float> q = testing::RandomValues(4 * 1 * 64, 12);
  const std::vector<float> kn = testing::RandomValues(2 * 1 * 64, 13);
  const std::vector<float> vn = testing::RandomValues(2 * 1 * 64, 14);
  const DecodeQuery query{.num_q_heads = 4,
                          .n_q = 1,
                          .q = q.data(),
                          .n_new = 1,
                          .k_new = kn.data(),
                          .v_new = vn.data()};
  std::vector<std::vector<float>> got;
  for (AttentionMath math :
       {AttentionMath::kAuto, AttentionMath::kExact, AttentionMath::kInteger}) {
    absl::StatusOr<std::unique_ptr<Backend>> b =
        CreateCpuBackend({.num_threads = 1, .attention_math = math});
    ASSERT_TRUE(b.ok()) << b.status();
    std::vector<float> out(4 * 64), want(4 * 64);
    ASSERT_TRUE((*b)->Attend(*view, query, out.data()).ok());
    ASSERT_TRUE(PackedAttentionCpu(*view, query, want.data(), nullptr, {.math = math}).ok());
    EXPECT_EQ(out, want) << static_cast<int>(math);
    got.push_back(out);
  }
  EXPECT_EQ(got[0], got[2]);  // auto: 4-bit heads of >= 32 channels take the integer path
  EXPECT_NE(got[1], got[2]);
  float largest = 0;  // the integer path stays close to fp32
  for (size_t i = 0; i < got[1].size(); ++i) {
    largest = std::max(largest, std::abs(got[1][i] - got[2][i]));
  }
  EXPECT_LT(largest, 0.05f);
}

TEST(CpuBackendTest, ParsesAttentionMathNames) {
  EXPECT_EQ(*ParseAttentionMath("auto"), AttentionMath::kAuto);
  EXPECT_EQ(*ParseAttentionMath("Exact"), AttentionMath::kExact);
  EXPECT_EQ(*ParseAttentionMath("integer"), AttentionMath::kInteger);
  const absl::StatusOr<AttentionMath> bad = ParseAttentionMath("fast");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("attention_math: unknown 'fast' (expected auto, exact or integer)"));
}

// BackendOptions::scoring_math reaches scoring: a backend made with kInteger scores as
// ScoreTokens does with the input's scoring_math set to it (whatever the caller's input says),
// differently from the exact backend, and its description names the int8 kernel (AVX2 or AVX-512
// VNNI). Below avx2, and on AMX (whose tiles kInteger leaves), both backends score alike.
TEST(CpuBackendTest, ScoringUsesTheChosenScoringMath) {
  const TestLayer layer = RandomLayer({2, 8, 700, 64, 16}, 9, DType::kBF16);
  CompressionSpec spec;
  spec.eviction.policy = EvictionPolicy::kSnapKV;
  spec.eviction.keep_ratio = 0.25;
  for (CpuIsa isa : testing_isa::SupportedIsas()) {
    SCOPED_TRACE(std::string(CpuIsaName(isa)));
    const testing_isa::ScopedIsaCap cap(isa);
    const bool int8 = isa != CpuIsa::kPortable && isa != CpuIsa::kAmx;
    const char* kernel = isa >= CpuIsa::kAvx512Vnni ? "avx512-vnni int8 dot products"
                                                    : "avx2 int8 dot products (7-bit queries)";
    std::vector<std::vector<float>> got;
    for (ScoringMath math : {ScoringMath::kExact, ScoringMath::kInteger}) {
      absl::StatusOr<std::unique_ptr<Backend>> b =
          CreateCpuBackend({.num_threads = 1, .scoring_math = math});
      ASSERT_TRUE(b.ok()) << b.status();
      LayerInput in = layer.input();
      in.scoring_math = math == ScoringMath::kExact ? ScoringMath::kInteger : ScoringMath::kExact;
      absl::StatusOr<KeyScores> scores = (*b)->ScoreKeys(in, spec);
      ASSERT_TRUE(scores.ok()) << scores.status();
      in.scoring_math = math;
      absl::StatusOr<std::vector<float>> want = ScoreTokens(in, spec.eviction);
      ASSERT_TRUE(want.ok());
      EXPECT_EQ(scores->scores, *want);
      EXPECT_EQ((*b)->description().find(kernel) != std::string::npos,
                int8 && math == ScoringMath::kInteger)
          << (*b)->description();
      absl::StatusOr<CompactLayer> blob = (*b)->Compress(layer.input(), spec, nullptr);
      ASSERT_TRUE(blob.ok()) << blob.status();
      got.push_back(scores->scores);
    }
    if (int8) {
      EXPECT_NE(got[0], got[1]);
    } else {
      EXPECT_EQ(got[0], got[1]);
    }
  }
}

TEST(CpuBackendTest, ParsesScoringMathNames) {
  EXPECT_EQ(*ParseScoringMath("exact"), ScoringMath::kExact);
  EXPECT_EQ(*ParseScoringMath("Integer"), ScoringMath::kInteger);
  const absl::StatusOr<ScoringMath> bad = ParseScoringMath("auto");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()),
              HasSubstr("scoring_math: unknown 'auto' (expected exact or integer)"));
}

TEST(ThreadPoolTest, RunsEveryIndexOnceUnderConcurrentAndNestedCalls) {
  ThreadPool pool(3);
  EXPECT_EQ(pool.num_threads(), 3);
  constexpr int kCallers = 4, kOuter = 7, kInner = 5;
  std::vector<std::vector<std::atomic<int>>> hits(kCallers);
  for (auto& h : hits) h = std::vector<std::atomic<int>>(kOuter * kInner);
  std::vector<std::thread> callers;
  for (int c = 0; c < kCallers; ++c) {
    callers.emplace_back([&, c] {
      pool.ParallelFor(kOuter, [&](int i) {
        // Nested: a worker running a job starts another one on the same pool.
        pool.ParallelFor(kInner, [&](int j) { hits[c][i * kInner + j].fetch_add(1); });
      });
    });
  }
  for (std::thread& t : callers) t.join();
  for (const auto& h : hits) {
    for (const auto& x : h) EXPECT_EQ(x.load(), 1);
  }
  int ran = 0;
  pool.ParallelFor(0, [&](int) { ++ran; });
  EXPECT_EQ(ran, 0);
  ThreadPool single(1);  // no workers: runs inline
  single.ParallelFor(3, [&](int) { ++ran; });
  EXPECT_EQ(ran, 3);
}

}  // namespace
}  // namespace kvc

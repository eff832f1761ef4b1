// The cost model (kvc/cost.h): every policy has its row, realistic requests of every policy fit
// kvcd's default budget (8192 flops and 4 bytes of scratch per uploaded byte, plus 1e9 flops and
// 64 MiB), the hostile shapes of the hardening review do not, arithmetic saturates instead of
// wrapping, and the scratch estimate bounds what the CPU engine really takes.
#include "kvc/cost.h"

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "cpu/engine.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/protocol/spec_string.h"
#include "kvc/spec.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

constexpr double kFlopsPerByte = 8192, kBaseFlops = 1e9;
constexpr double kScratchPerByte = 4, kBaseScratch = 64.0 * (1 << 20);

LayerShape Shape(int hkv, int hq, int s, int d, int w) {
  LayerShape sh;
  sh.num_kv_heads = hkv;
  sh.num_q_heads = hq;
  sh.seq_len = s;
  sh.head_dim = d;
  sh.obs_window = w;
  return sh;
}

// K + V + Q_obs (+ Q_stats) bytes of an upload.
double UploadBytesOf(const LayerShape& sh, DType dtype, int layers, bool stats) {
  const double es = DTypeSize(dtype);
  double per = 2.0 * sh.num_kv_heads * sh.seq_len * sh.head_dim * es +
               1.0 * sh.num_q_heads * sh.obs_window * sh.head_dim * es;
  if (stats) per += 4.0 * sh.num_q_heads * (sh.head_dim + 1.0 * sh.head_dim * sh.head_dim);
  return per * layers;
}

CompressionSpec Spec(const std::string& text) {
  absl::StatusOr<CompressionSpec> s = ParseSpecString(text);
  EXPECT_TRUE(s.ok()) << text << ": " << s.status();
  return s.ok() ? *s : CompressionSpec{};
}

// A 16-thread kvcd: 16 layer-job callers at most plus 15 backend workers; Llama's 8 KV heads
// let two layers run at once.
CostConcurrency Kvcd16() {
  CostConcurrency c;
  c.concurrent_layers = 2;
  c.parallel_tasks = 15 + 2;
  return c;
}

struct Case {
  std::string spec;
  LayerShape shape;
  int layers;
  bool stats = false;
};

TEST(CostTest, RealisticRequestsOfEveryPolicyFitTheDefaultBudget) {
  // Llama-3-8B at 32K tokens with observation windows of 32 and 64, and keyformer with W = S at
  // modest S; fp16.
  std::vector<Case> cases;
  for (int w : {32, 64}) {
    const LayerShape llama = Shape(8, 32, 32768, 128, w);
    for (const char* spec :
         {"h2o:0.25", "snapkv:0.25", "snapkv:0.25,kernel=5,pool=avg", "keyformer:0.25",
          "knorm:0.25", "random:0.25", "streaming:0.25", "keydiff:0.25", "expected:0.25",
          "expected:0.25,horizon=128", "snapkv:0.25,ada=0.2", "h2o:0.5,value=mul",
          "snapkv:0.25+think:0.5+q4", "snapkv:0.25+vthink:0.5", "q2", "think:0.5", "full"}) {
      cases.push_back({spec, llama, 32});
    }
  }
  cases.push_back({"expected:0.25,stats=1", Shape(8, 32, 32768, 128, 0), 32, true});
  for (int s : {1024, 2048, 4096}) {
    cases.push_back({"keyformer:0.5", Shape(8, 32, s, 128, s), 32});
    cases.push_back({"h2o:0.5", Shape(8, 32, s, 128, s), 32});
  }
  cases.push_back({"snapkv:0.25", Shape(4, 4, 512, 8, 32), 5});  // stories260K-like
  for (const Case& c : cases) {
    const WorkCost cost = CompressCost(c.shape, DType::kF16, Spec(c.spec), c.layers, Kvcd16());
    const double bytes = UploadBytesOf(c.shape, DType::kF16, c.layers, c.stats);
    EXPECT_LE(static_cast<double>(cost.flops), kFlopsPerByte * bytes + kBaseFlops)
        << c.spec << " S=" << c.shape.seq_len << " W=" << c.shape.obs_window << ": "
        << cost.flops_term;
    EXPECT_LE(static_cast<double>(cost.scratch_bytes), kScratchPerByte * bytes + kBaseScratch)
        << c.spec << " S=" << c.shape.seq_len << " W=" << c.shape.obs_window << ": "
        << cost.scratch_term;
    EXPECT_GT(cost.flops, 0u) << c.spec;
  }
}

TEST(CostTest, EveryPolicyHasItsOwnScoringRow) {
  const LayerShape sh = Shape(2, 8, 4096, 64, 64);
  const uint64_t none = CompressCost(sh, DType::kF16, Spec("full"), 1, {}).flops;
  const uint64_t streaming = CompressCost(sh, DType::kF16, Spec("streaming:0.5"), 1, {}).flops;
  for (const std::string& name : EvictionPolicyNames()) {
    if (name == "none" || name == "streaming") continue;
    const WorkCost c = CompressCost(sh, DType::kF16, Spec(name + ":0.5"), 1, {});
    EXPECT_GT(c.flops, streaming) << name << " scores nothing?";
  }
  // Scores by policy: attention over all rows is the largest term of h2o, the covariance
  // products of expected, the key passes of keydiff.
  EXPECT_THAT(CompressCost(sh, DType::kF16, Spec("h2o:0.5"), 1, {}).flops_term,
              HasSubstr("attention scores"));
  EXPECT_THAT(CompressCost(sh, DType::kF16, Spec("expected:0.5"), 1, {}).flops_term,
              HasSubstr("expected scores"));
  EXPECT_THAT(CompressCost(sh, DType::kF16, Spec("keydiff:0.5"), 1, {}).flops_term,
              HasSubstr("keydiff"));
  EXPECT_GT(CompressCost(sh, DType::kF16, Spec("snapkv:0.5+vthink:0.5"), 1, {}).flops,
            CompressCost(sh, DType::kF16, Spec("snapkv:0.5"), 1, {}).flops);
  EXPECT_GT(CompressCost(sh, DType::kF16, Spec("snapkv:0.5+q4"), 1, {}).flops,
            CompressCost(sh, DType::kF16, Spec("snapkv:0.5"), 1, {}).flops);
  EXPECT_GT(none, 0u);  // packing
}

TEST(CostTest, FlopsGrowWithLayersAndKeyformerWindow) {
  const LayerShape sh = Shape(2, 8, 2048, 64, 32);
  const CompressionSpec spec = Spec("keyformer:0.5");
  const uint64_t one = CompressCost(sh, DType::kF16, spec, 1, {}).flops;
  EXPECT_EQ(CompressCost(sh, DType::kF16, spec, 7, {}).flops, 7 * one);
  const uint64_t wide = CompressCost(Shape(2, 8, 2048, 64, 2048), DType::kF16, spec, 1, {}).flops;
  EXPECT_GT(wide, 32 * one);
  // Per-layer budgets: distinct layers are costed one by one.
  CompressionSpec lb = Spec("snapkv:0.5+vthink:0.5");
  lb.eviction.layer_budgets = {64, 2048};
  const WorkCost three = CompressCost(sh, DType::kF16, lb, 3, {});
  const uint64_t l0 = LayerCost(sh, DType::kF16, lb, 0, {}).flops;
  const uint64_t l1 = LayerCost(sh, DType::kF16, lb, 1, {}).flops;
  const uint64_t l2 = LayerCost(sh, DType::kF16, lb, 2, {}).flops;
  EXPECT_LT(l0, l1);
  EXPECT_EQ(three.flops, l0 + l1 + l2);
}

// kvzip's reconstruction rows see every key (W * S logits, not the causal count), and
// layer-adaptive budgets price a layer as if it kept all its tokens and hold every layer's scores
// (three copies) until the last layer is scored.
TEST(CostTest, KVzipRowsAndLayerAdaptiveHoldingArePriced) {
  const LayerShape sh = Shape(2, 8, 1024, 64, 1024);
  const WorkCost h2o = CompressCost(sh, DType::kF16, Spec("h2o:0.25"), 1, {});
  const WorkCost kvzip = CompressCost(sh, DType::kF16, Spec("kvzip:0.25"), 1, {});
  const uint64_t full_square = 8ull * 1024 * 1024 * 64 * 2;  // Hq * W * S * D * 2
  // The causal rows skip about half the square (W (W - 1) / 2 keys a query head); kvzip's don't.
  ASSERT_GT(kvzip.flops, h2o.flops);
  EXPECT_GE(kvzip.flops - h2o.flops, full_square / 4);
  const WorkCost ada = CompressCost(sh, DType::kF16, Spec("kvzip:0.25,ada=0"), 30, {});
  const WorkCost xl = CompressCost(sh, DType::kF16, Spec("kvzip:0.25,ada=0,xlayer=1"), 30, {});
  EXPECT_GE(xl.scratch_bytes, ada.scratch_bytes + 3ull * 30 * 2 * 1024 * 4);
  EXPECT_GT(xl.flops, ada.flops);
}

// "kvzip:KEEP,passes=..." for a context of S tokens repeated in chunks of `chunk`, each pass with
// `instruction` rows besides its chunk's (the first pass 9): the spec and the rows' count W.
std::pair<std::string, int> KVzipPassesSpec(const std::string& head, int S, int chunk,
                                            int instruction) {
  std::string passes;
  int w = 0;
  for (int lo = 0; lo < S; lo += chunk) {
    const int rows = std::min(chunk, S - lo) + (lo == 0 ? 9 : instruction);
    if (!passes.empty()) passes += '/';
    passes += std::to_string(rows);
    w += rows;
  }
  return {head + ",passes=" + passes + ",chunk=" + std::to_string(chunk), w};
}

// Every row over all S keys is S^2 logits a query head: at 32K tokens of Llama-3-8B more than
// kvcd's default budget allows. Reconstruction passes price each row at its chunk and the sinks,
// which fits, whatever the context's length.
TEST(CostTest, KVzipPassesPriceEachRowAtItsChunk) {
  for (int S : {32768, 131072}) {
    const auto [spec, w] = KVzipPassesSpec("kvzip:0.25,stats=1", S, 2048, 21);
    const LayerShape sh = Shape(8, 32, S, 128, w);
    const double bytes = UploadBytesOf(sh, DType::kF16, 32, false) + 4.0 * 32 * w * 32;
    const WorkCost chunked = CompressCost(sh, DType::kF16, Spec(spec), 32, Kvcd16());
    const WorkCost whole = CompressCost(sh, DType::kF16, Spec("kvzip:0.25,stats=1"), 32, Kvcd16());
    EXPECT_LE(static_cast<double>(chunked.flops), kFlopsPerByte * bytes + kBaseFlops)
        << S << ": " << chunked.flops_term;
    EXPECT_LE(static_cast<double>(chunked.scratch_bytes), kScratchPerByte * bytes + kBaseScratch)
        << S << ": " << chunked.scratch_term;
    EXPECT_GT(static_cast<double>(whole.flops), kFlopsPerByte * bytes + kBaseFlops) << S;
    // Hq * W * (chunk + sinks) * D * 2 at most for the logits.
    EXPECT_LT(static_cast<double>(chunked.flops), 2.0 * 32 * w * (2048 + 4) * 128 * 2 * 32) << S;
  }
}

// kvzip's mean over the top rows: K planes of S floats per task, and up to K moves per logit
// (the worst case) on top of the same scoring.
TEST(CostTest, KVzipTopRowsPriceTheirPlanesAndMoves) {
  const LayerShape sh = Shape(2, 6, 4096, 64, 4105);
  const WorkCost max = CompressCost(sh, DType::kF16, Spec("kvzip:0.1,stats=1"), 1, {});
  const WorkCost top = CompressCost(sh, DType::kF16, Spec("kvzip:0.1,stats=1,top=8"), 1, {});
  EXPECT_GE(top.scratch_bytes, max.scratch_bytes + 8ull * 4096 * 4);
  EXPECT_EQ(top.flops - max.flops, 6ull * 4105 * 4096 * 8);  // Hq * W * S logits, 8 each
}

TEST(CostTest, TheHostileShapesOfTheReviewAreOverBudget) {
  // Expected attention with 16384 query heads per KV head, S = 16384, D = 8, W = 1, 2 layers:
  // a 1.5 MiB upload asking for about 1e11 flops.
  {
    const LayerShape sh = Shape(1, 16384, 16384, 8, 1);
    const WorkCost c = CompressCost(sh, DType::kF16, Spec("expected:0.5"), 2, Kvcd16());
    const double bytes = UploadBytesOf(sh, DType::kF16, 2, false);
    EXPECT_NEAR(bytes, 1.5 * (1 << 20), 1);
    EXPECT_GT(static_cast<double>(c.flops), kFlopsPerByte * bytes + kBaseFlops);
    EXPECT_THAT(c.flops_term, HasSubstr("expected scores"));
  }
  // 4096 query heads of D = 256 with W = 1: the covariance is Hq * D^2 * 4 = 1 GiB per layer for
  // a 2 MiB upload. The CPU engine holds one head's at a time; the CUDA backend holds them all,
  // which is over the scratch budget.
  {
    const LayerShape sh = Shape(1, 4096, 16, 256, 1);
    CostConcurrency cuda = Kvcd16();
    cuda.whole_layer_statistics = true;
    const double bytes = UploadBytesOf(sh, DType::kF16, 1, false);
    const WorkCost gpu = CompressCost(sh, DType::kF16, Spec("expected:0.5"), 1, cuda);
    EXPECT_GT(static_cast<double>(gpu.scratch_bytes), kScratchPerByte * bytes + kBaseScratch);
    EXPECT_THAT(gpu.scratch_term, HasSubstr("statistics of all query heads"));
    const WorkCost cpu = CompressCost(sh, DType::kF16, Spec("expected:0.5"), 1, Kvcd16());
    EXPECT_LT(cpu.scratch_bytes, uint64_t{16} << 20);
  }
}

TEST(CostTest, ValidationCapsParametersWhoseWorkGrowsWithTheirValue) {
  const LayerShape sh = Shape(1, 1, 64, 8, 8);
  CompressionSpec spec = Spec("expected:0.5");
  spec.eviction.horizon = 1 << 30;
  absl::Status s = ValidateSpec(spec, sh, 0);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "eviction.horizon: 1073741824 exceeds 1048576 (future positions the "
            "statistics are averaged over)");
  spec.eviction.horizon = kMaxHorizon;
  EXPECT_TRUE(ValidateSpec(spec, sh, 0).ok());
  spec = Spec("snapkv:0.5");
  spec.eviction.pool_kernel = kMaxPoolKernel + 2;
  s = ValidateSpec(spec, sh, 0);
  EXPECT_THAT(s.message(), HasSubstr("eviction.pool_kernel: 1025 exceeds 1023"));
  spec.eviction.pool_kernel = kMaxPoolKernel;
  EXPECT_TRUE(ValidateSpec(spec, sh, 0).ok());
  // The horizon's work does not grow with it (closed form): the largest costs what 1 costs.
  spec = Spec("expected:0.5");
  const uint64_t h1 = CompressCost(sh, DType::kF16, spec, 1, {}).flops;
  spec.eviction.horizon = kMaxHorizon;
  EXPECT_EQ(CompressCost(sh, DType::kF16, spec, 1, {}).flops, h1);
}

TEST(CostTest, ProductsPastSixtyFourBitsSaturate) {
  // Valid shape at the element limits: 8 * 2^27 * 2^30 logits of D = 8.
  const LayerShape sh = Shape(1, 8, 1 << 30, 8, 1 << 27);
  ASSERT_TRUE(ValidateShape(sh).ok());
  const WorkCost c = CompressCost(sh, DType::kF16, Spec("h2o:0.5"), 4096, {});
  EXPECT_EQ(c.flops, std::numeric_limits<uint64_t>::max());
}

// The estimate is an upper bound of the large scratch the CPU engine really takes (arrays above
// kScratchKeepBytes, borrowed per task), for every policy over shapes that make them large.
TEST(CostTest, ScratchEstimateBoundsWhatTheEngineTakes) {
  constexpr int kThreads = 3;
  BackendOptions bo;
  bo.num_threads = kThreads;
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCpuBackend(bo);
  ASSERT_TRUE(backend.ok());
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  struct Shaped {
    std::string spec;
    LayerShape shape;
  };
  const std::vector<Shaped> cases = {
      {"h2o:0.25", Shape(2, 8, 8192, 64, 256)},
      {"keyformer:0.5", Shape(2, 4, 3000, 64, 3000)},
      {"snapkv:0.25,kernel=9", Shape(4, 8, 70000, 8, 32)},
      {"expected:0.25", Shape(2, 4, 200000, 32, 300)},
      {"keydiff:0.25", Shape(3, 3, 9000, 256, 0)},
      {"knorm:0.25+vthink:0.5", Shape(2, 4, 6000, 32, 1500)},
      {"snapkv:0.5+think:0.25+q4", Shape(2, 16, 20000, 64, 64)},
      {"random:0.5", Shape(4, 4, 100000, 8, 0)},
      // kvzip's passes: a block sees the sinks and its chunk (1100 keys: two pieces), 3 passes
      {"kvzip:0.25,passes=1109/1109/809,chunk=1100", Shape(2, 6, 3000, 64, 3027)},
  };
  for (const Shaped& c : cases) {
    const LayerShape& sh = c.shape;
    const size_t kv = static_cast<size_t>(sh.num_kv_heads) * sh.seq_len * sh.head_dim;
    const size_t q = static_cast<size_t>(sh.num_q_heads) * sh.obs_window * sh.head_dim;
    std::vector<float> k(kv), v(kv), qo(q);
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    for (float& x : qo) x = normal(rng);
    RopeParams rope;
    LayerInput in;
    in.shape = sh;
    in.dtype = DType::kF32;
    in.k = k.data();
    in.v = v.data();
    in.q_obs = q > 0 ? qo.data() : nullptr;
    in.rope = &rope;
    const CompressionSpec spec = Spec(c.spec);
    cpu::ResetScratchPeak();
    const uint64_t before = cpu::LargeScratchBytes();
    absl::StatusOr<CompactLayer> out = (*backend)->Compress(in, spec, nullptr);
    ASSERT_TRUE(out.ok()) << c.spec << ": " << out.status();
    const uint64_t used = cpu::LargeScratchPeakBytes() - before;
    CostConcurrency cc;
    cc.parallel_tasks = kThreads;
    const WorkCost cost = LayerCost(sh, DType::kF32, spec, 0, cc);
    EXPECT_LE(used, cost.scratch_bytes) << c.spec << ": " << cost.scratch_term;
    EXPECT_GT(used, 0u) << c.spec << ": the case should take large scratch";
    // Large scratch goes back when the tasks end.
    EXPECT_EQ(cpu::LargeScratchBytes(), before) << c.spec;
  }
}

}  // namespace
}  // namespace kvc

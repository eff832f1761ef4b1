// The CUDA backend's KeyDiff, expected attention, KVzip and value-aware scores against the CPU
// backend: over a grid of shapes, dtypes and layouts (including obs_window 0 with client
// statistics; kvzip with reconstruction passes, log-masses and top rows), the kept sets agree up
// to ties of the CPU scores, and identical selections give identical blobs.
// Without a visible CUDA device main() prints the reason and exits 77 (ctest: skipped).
#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu_util.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/protocol/spec_string.h"
#include "kvc/selection.h"

namespace kvc {
namespace {

using gpu_testing::Layer;
using gpu_testing::RandomLayer;

std::unique_ptr<Backend>& Cpu() {
  static auto* b = new std::unique_ptr<Backend>(CreateCpuBackend({}).value());
  return *b;
}
std::unique_ptr<Backend>& Gpu() {
  static auto* b = new std::unique_ptr<Backend>(CreateCudaBackend({}).value());
  return *b;
}

struct Case {
  std::string name;
  LayerShape shape;
  DType dtype;
  Layout layout;
  std::string spec;
};

// Statistics an engine could send: a mean and a random PSD covariance per query head.
std::vector<float> Stats(const LayerShape& s, uint64_t seed) {
  const int d = s.head_dim;
  std::vector<float> out(QueryStatsFloats(s));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return static_cast<float>((x >> 11) * 0x1.0p-53) - 0.5f;
  };
  for (int h = 0; h < s.num_q_heads; ++h) {
    float* p = out.data() + static_cast<size_t>(h) * (d + d * d);
    for (int c = 0; c < d; ++c) p[c] = 2 * next();
    std::vector<float> a(static_cast<size_t>(d) * d);
    for (float& v : a) v = next();
    for (int i = 0; i < d; ++i) {
      for (int j = 0; j < d; ++j) {
        double acc = 0;
        for (int k = 0; k < d; ++k) acc += a[i * d + k] * a[j * d + k];
        p[d + i * d + j] = static_cast<float>(acc / d);
      }
    }
  }
  return out;
}

// kvzip's rows' log-masses over their own reconstruction tokens, [Hq, W]: around log(S), so
// that they weigh in the softmax's denominator about as much as the uploaded keys do.
std::vector<float> LogMasses(const LayerShape& s, uint64_t seed) {
  std::vector<float> out(QueryStatsFloats(s, /*row_log_mass=*/true));
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 7;
  for (float& v : out) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const float u = static_cast<float>((x >> 11) * 0x1.0p-53);  // [0, 1)
    v = std::log(static_cast<float>(s.seq_len)) + 4.0f * (u - 0.5f);
  }
  return out;
}

class GpuScoreExtra : public ::testing::TestWithParam<Case> {};

TEST_P(GpuScoreExtra, KeptSetsMatchTheCpuUpToTies) {
  const Case& c = GetParam();
  const Layer layer = RandomLayer(c.shape, c.dtype, c.layout, 77 + c.shape.seq_len, 1);
  const RopeParams rope{10000.0, 0, c.layout == Layout::kNHD, 1.0};
  absl::StatusOr<CompressionSpec> spec = ParseSpecString(c.spec);
  ASSERT_TRUE(spec.ok()) << spec.status();
  const std::vector<float> stats = spec->eviction.policy == EvictionPolicy::kKVzip
                                       ? LogMasses(c.shape, c.shape.seq_len)
                                       : Stats(c.shape, c.shape.seq_len);
  LayerInput in = layer.input();
  in.rope = &rope;
  in.q_stats = stats.data();
  const absl::StatusOr<std::vector<float>> score = ScoreTokens(in, spec->eviction);
  ASSERT_TRUE(score.ok()) << score.status();
  const absl::StatusOr<CompactLayer> cpu = Cpu()->Compress(in, *spec, nullptr);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const absl::StatusOr<CompactLayer> gpu = Gpu()->Compress(in, *spec, nullptr);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  const absl::StatusOr<CompactLayerView> cv = CompactLayerView::Parse(cpu->bytes);
  const absl::StatusOr<CompactLayerView> gv = CompactLayerView::Parse(gpu->bytes);
  ASSERT_TRUE(cv.ok() && gv.ok());
  const int s = c.shape.seq_len;
  bool identical = true;
  for (int h = 0; h < c.shape.num_kv_heads; ++h) {
    const CompactHead a = cv->head(h), b = gv->head(h);
    ASSERT_EQ(a.n_kept, b.n_kept);
    std::vector<int32_t> pa(a.positions, a.positions + a.n_kept);
    std::vector<int32_t> pb(b.positions, b.positions + b.n_kept);
    if (pa == pb) continue;
    identical = false;
    std::vector<int32_t> only_a, only_b;
    std::set_difference(pa.begin(), pa.end(), pb.begin(), pb.end(), std::back_inserter(only_a));
    std::set_difference(pb.begin(), pb.end(), pa.begin(), pa.end(), std::back_inserter(only_b));
    const float* sc = score->data() + static_cast<size_t>(h) * s;
    float mx = 0;
    for (int j = 0; j < s; ++j) mx = std::max(mx, std::fabs(sc[j]));
    const float tol = 1e-4f * mx + 1e-7f;
    for (int32_t x : only_a) {
      for (int32_t y : only_b) {
        EXPECT_LE(std::fabs(sc[x] - sc[y]), tol)
            << "head " << h << ": cpu keeps " << x << " (" << sc[x] << "), cuda " << y << " ("
            << sc[y] << ")";
      }
    }
  }
  if (identical) {
    EXPECT_EQ(cpu->bytes, gpu->bytes) << "same selections, different blobs";
  }
}

std::vector<Case> Cases() {
  std::vector<Case> out;
  const std::vector<std::string> specs = {"keydiff:0.25",
                                          "keydiff:0.5,recent=0.2",
                                          "expected:0.25",
                                          "expected:0.5,value=off",
                                          "expected:0.25,horizon=16,value=add",
                                          "h2o:0.25,value=mul",
                                          "snapkv:0.25,value=add,veps=0.1",
                                          "keyformer:0.5,value=mul,seed=3",
                                          "expected:0.25,stats=1"};
  const std::vector<LayerShape> shapes = {
      {2, 8, 300, 64, 16}, {4, 8, 1500, 128, 32}, {1, 4, 97, 40, 0}, {8, 32, 2100, 128, 0}};
  // Case n cycles through the dtypes and layouts; its name says its shape and spec.
  int n = 0;
  const auto add = [&](const LayerShape& sh, const std::string& sp) {
    const DType dt = n % 3 == 0 ? DType::kF16 : n % 3 == 1 ? DType::kBF16 : DType::kF32;
    const Layout lay = n % 2 == 0 ? Layout::kHND : Layout::kNHD;
    std::string name = absl::StrCat("c", n++, "_", sh.seq_len, "_", sh.head_dim, "_", sp);
    for (char& ch : name) {
      if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
    }
    out.push_back({name, sh, dt, lay, sp});
  };
  for (const LayerShape& sh : shapes) {
    for (const std::string& sp : specs) {
      const bool needs_q =
          sp.rfind("h2o", 0) == 0 || sp.rfind("snapkv", 0) == 0 || sp.rfind("keyformer", 0) == 0 ||
          (sp.rfind("expected", 0) == 0 && sp.find("stats=1") == std::string::npos);
      if (sh.obs_window == 0 && needs_q) continue;
      add(sh, sp);
    }
  }
  // kvzip: reconstruction rows (W = S + a prompt's rows, or more), with and without the rows'
  // log-masses, the mean of the top rows, passes over chunks, the head-adaptive split, a head_dim
  // of no template (40), and a layer whose rows take several logit blocks (Hq 32, S 2100).
  const std::vector<std::pair<LayerShape, std::vector<std::string>>> kvzip = {
      {{2, 8, 200, 64, 230},
       {"kvzip:0.25", "kvzip:0.25,stats=1", "kvzip:0.1,top=16", "kvzip:0.5,passes=140/90,chunk=128",
        "kvzip:0.25,stats=1,top=4,passes=140/90,chunk=128", "kvzip:0.25,ada=0,stats=1"}},
      {{4, 8, 1000, 128, 1050},
       {"kvzip:0.25,stats=1,top=16", "kvzip:0.25,stats=1,passes=530/520,chunk=512,sink=4"}},
      {{1, 4, 97, 40, 110}, {"kvzip:0.5,top=2"}},
      {{8, 32, 2100, 128, 2200},
       {"kvzip:0.1,stats=1,top=16", "kvzip:0.1,stats=1,top=64,passes=1100/1100,chunk=1050"}}};
  for (const auto& [sh, specs_of] : kvzip) {
    for (const std::string& sp : specs_of) add(sh, sp);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Grid, GpuScoreExtra, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(GpuScoreExtraErrors, MissingRopeOrStatisticsAreInvalidArgument) {
  const Layer layer = RandomLayer({2, 4, 64, 64, 8}, DType::kF16, Layout::kHND, 5);
  LayerInput in = layer.input();
  CompressionSpec spec = *ParseSpecString("expected:0.5");
  EXPECT_EQ(Gpu()->Compress(in, spec, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
  const RopeParams rope;
  in.rope = &rope;
  spec = *ParseSpecString("expected:0.5,stats=1");
  EXPECT_EQ(Gpu()->Compress(in, spec, nullptr).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvc

int main(int argc, char** argv) { return kvc::gpu_testing::RunGpuTests(argc, argv); }

// The CUDA backend's edge cases against the CPU backend: NaN and Inf inputs, the generic
// (non-split) fp16/bf16 decode kernel, concurrent Compress and Attend calls, a device other than
// 0, device-resident inputs (bit-identical to host inputs), run-to-run determinism, invalid input;
// and Llama3At128K, a Llama-3-8B layer at 128K tokens for snapkv, h2o, keyformer and keydiff
// (tests/gpu/run.sh runs it as its own step).
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gpu_compare.h"
#include "gpu_util.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/gpu_memory.h"
#include "kvc/protocol/spec_string.h"
#include "kvc/spec.h"

namespace kvc {
namespace {

using gpu_testing::Cpu;
using gpu_testing::DeviceLayer;
using gpu_testing::Gpu;
using gpu_testing::Layer;
using gpu_testing::RandomLayer;

LayerShape Shape(int hkv, int g, int s, int d, int w) { return {hkv, hkv * g, s, d, w}; }

CompressionSpec Spec(EvictionPolicy p, int budget) {
  CompressionSpec s;
  s.eviction.policy = p;
  s.eviction.budget = budget;
  s.eviction.seed = 7;
  return s;
}

std::vector<int32_t> HeadPositions(const CompactLayerView& v, int h) {
  const CompactHead hd = v.head(h);
  return std::vector<int32_t>(hd.positions, hd.positions + hd.n_kept);
}

TEST(CudaBackend, DescribesDeviceAndArchitecture) {
  EXPECT_EQ(Gpu().name(), "cuda");
  EXPECT_NE(Gpu().description().find("(sm_"), std::string::npos) << Gpu().description();
}

// Every stage is deterministic (integer histograms in top-k, fixed-order sums everywhere): the
// same input and spec give the same bytes, call after call; a different seed changes keyformer's.
TEST(CudaBackend, RepeatedCallsAreBitIdentical) {
  const Layer layer = RandomLayer(Shape(4, 4, 9000, 128, 32), DType::kF16, Layout::kHND, 5);
  std::vector<CompressionSpec> specs = {Spec(EvictionPolicy::kKeyformer, 2000),
                                        Spec(EvictionPolicy::kKeyDiff, 2000),
                                        Spec(EvictionPolicy::kH2O, 2000)};
  specs.push_back(Spec(EvictionPolicy::kSnapKV, 2000));
  specs.back().channels.key_policy = ChannelPolicy::kThink;
  specs.back().channels.key_lambda = 0.5;
  specs.back().quant.bits = 4;
  specs.push_back(Spec(EvictionPolicy::kSnapKV, 2000));
  specs.back().eviction.granularity = Granularity::kPerLayer;
  for (const CompressionSpec& spec : specs) {
    const CompactLayer a = Gpu().Compress(layer.input(), spec, nullptr).value();
    for (int rep = 0; rep < 3; ++rep) {
      EXPECT_EQ(a.bytes, Gpu().Compress(layer.input(), spec, nullptr).value().bytes)
          << PolicyName(spec.eviction.policy) << " repeat " << rep;
    }
  }
  CompressionSpec spec = specs[0];
  const CompactLayer a = Gpu().Compress(layer.input(), spec, nullptr).value();
  spec.eviction.seed = 8;
  EXPECT_NE(a.bytes, Gpu().Compress(layer.input(), spec, nullptr).value().bytes);
}

TEST(CudaBackend, InvalidInputIsRejectedNamingTheField) {
  Layer layer = RandomLayer(Shape(2, 1, 16, 8, 4), DType::kF32, Layout::kHND, 1);
  LayerInput in = layer.input();
  in.shape.head_dim = 300;
  absl::StatusOr<CompactLayer> r = Gpu().Compress(in, Spec(EvictionPolicy::kH2O, 4), nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("shape.head_dim"), std::string::npos) << r.status();
  r = Gpu().Compress(layer.input(), Spec(EvictionPolicy::kH2O, 17), nullptr);
  EXPECT_NE(r.status().message().find("eviction.budget"), std::string::npos) << r.status();
  in = layer.input();
  in.k = nullptr;
  r = Gpu().Compress(in, Spec(EvictionPolicy::kH2O, 4), nullptr);
  EXPECT_NE(r.status().message().find("k:"), std::string::npos) << r.status();
  // Host memory declared as device memory.
  in = layer.input();
  in.memory = MemorySpace::kDevice;
  r = Gpu().Compress(in, Spec(EvictionPolicy::kH2O, 4), nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("k: memory is kDevice"), std::string::npos) << r.status();
  // Device memory given to the CPU backend.
  const DeviceLayer dev(layer);
  ASSERT_TRUE(dev.ok()) << dev.error();
  r = Cpu().Compress(dev.input(), Spec(EvictionPolicy::kH2O, 4), nullptr);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("memory:"), std::string::npos) << r.status();

  const CompactLayer blob =
      Gpu().Compress(layer.input(), Spec(EvictionPolicy::kH2O, 4), nullptr).value();
  const CompactLayerView view = CompactLayerView::Parse(blob.bytes).value();
  std::vector<float> q(3 * 8), out(3 * 8);
  DecodeQuery dq;
  dq.num_q_heads = 3;  // not a multiple of the 2 KV heads
  dq.n_q = 1;
  dq.n_new = 1;
  dq.q = q.data();
  dq.k_new = q.data();
  dq.v_new = q.data();
  absl::Status st = Gpu().Attend(view, dq, out.data());
  EXPECT_NE(st.message().find("num_q_heads"), std::string::npos) << st;
  dq.num_q_heads = 2;
  dq.n_new = 0;
  st = Gpu().Attend(view, dq, out.data());
  EXPECT_NE(st.message().find("n_new"), std::string::npos) << st;
}

TEST(CudaBackend, NaNKeysNeverWinASlotAndMatchTheCpu) {
  Layer layer = RandomLayer(Shape(2, 1, 200, 64, 8), DType::kF32, Layout::kHND, 21);
  float* k = reinterpret_cast<float*>(layer.k.data());
  for (int h = 0; h < 2; ++h) {
    for (int t : {3, 50, 51, 120}) k[(static_cast<size_t>(h) * 200 + t) * 64 + 5] = NAN;
  }
  const CompressionSpec spec = Spec(EvictionPolicy::kKNorm, 100);
  const CompactLayer cpu = Cpu().Compress(layer.input(), spec, nullptr).value();
  const CompactLayer gpu = Gpu().Compress(layer.input(), spec, nullptr).value();
  const CompactLayerView cv = CompactLayerView::Parse(cpu.bytes).value();
  const CompactLayerView gv = CompactLayerView::Parse(gpu.bytes).value();
  for (int h = 0; h < 2; ++h) {
    const std::vector<int32_t> g = HeadPositions(gv, h);
    EXPECT_EQ(HeadPositions(cv, h), g) << "head " << h;
    for (int t : {3, 50, 51, 120}) {
      EXPECT_FALSE(std::binary_search(g.begin(), g.end(), t)) << "NaN key " << t << " kept";
    }
  }
}

// NaN and Inf in K (a NaN key makes every softmax row that sees it NaN, on both devices, so the
// attention policies' scores are all NaN and both keep the lowest positions) or in V (copied
// through as they are), on the CUDA-core (fp32) and tensor-core (fp16) paths.
enum class Corruption { kNaNKeys, kInfKeys, kNaNValues };

struct NanCase {
  std::string name;
  EvictionPolicy policy;
  DType dtype;
  Corruption corruption;
};

class NonFiniteInput : public ::testing::TestWithParam<NanCase> {};

TEST_P(NonFiniteInput, MatchesTheCpu) {
  const NanCase& c = GetParam();
  Layer layer = RandomLayer(Shape(2, 4, 700, 64, 16), c.dtype, Layout::kHND, 31);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<uint8_t>& t = c.corruption == Corruption::kNaNValues ? layer.v : layer.k;
  const int positions[] = {3, 150, 151, 400, 690};
  for (int h = 0; h < 2; ++h) {
    for (int i = 0; i < 5; ++i) {
      const float x = c.corruption == Corruption::kInfKeys ? (i % 2 ? -inf : inf) : nan;
      StoreFromFloat(t.data(), c.dtype,
                     ElementOffset(Layout::kHND, 2, 700, 64, h, positions[i], 7 + h), x);
    }
  }
  gpu_testing::CompareOptions o;
  o.allow_nan = true;
  gpu_testing::CompareCompressed(c.name, layer, layer.input(), Spec(c.policy, 200), o);
}

std::vector<NanCase> NanCases() {
  std::vector<NanCase> out;
  for (EvictionPolicy p :
       {EvictionPolicy::kSnapKV, EvictionPolicy::kH2O, EvictionPolicy::kKeyformer,
        EvictionPolicy::kKNorm, EvictionPolicy::kKeyDiff}) {
    for (DType dt : {DType::kF32, DType::kF16}) {
      for (Corruption cr : {Corruption::kNaNKeys, Corruption::kInfKeys, Corruption::kNaNValues}) {
        const char* what = cr == Corruption::kNaNKeys   ? "nan_keys"
                           : cr == Corruption::kInfKeys ? "inf_keys"
                                                        : "nan_values";
        out.push_back(
            {absl::StrCat(std::string(PolicyName(p)), "_", std::string(DTypeName(dt)), "_", what),
             p, dt, cr});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Grid, NonFiniteInput, ::testing::ValuesIn(NanCases()),
                         [](const ::testing::TestParamInfo<NanCase>& i) { return i.param.name; });

// The generic decode kernel (one block per query row) on fp16/bf16 blobs, where the split kernel
// does not apply: 12 query rows per KV head (g = 4, n_q = 3), head_dim 100 (not a multiple of 8)
// and 256 (above 128); next to the split kernel on the same blobs (n_q = 1).
TEST(CudaBackend, GenericHalfPrecisionDecodeMatchesTheCpu) {
  struct Blob {
    LayerShape shape;
    DType dtype;
    int bits;
    bool think;
  };
  const Blob blobs[] = {{Shape(2, 4, 1500, 128, 32), DType::kF16, 0, false},
                        {Shape(2, 4, 1500, 128, 32), DType::kF16, 4, true},
                        {Shape(2, 4, 1500, 128, 32), DType::kBF16, 2, false},
                        {Shape(2, 4, 900, 100, 32), DType::kF16, 0, false},
                        {Shape(2, 4, 900, 100, 32), DType::kF16, 8, true},
                        {Shape(1, 4, 600, 256, 32), DType::kBF16, 4, false}};
  for (const Blob& b : blobs) {
    SCOPED_TRACE(absl::StrCat("D ", b.shape.head_dim, " dtype ", std::string(DTypeName(b.dtype)),
                              " bits ", b.bits, " think ", b.think));
    const Layer layer = RandomLayer(b.shape, b.dtype, Layout::kHND, 17);
    CompressionSpec spec = Spec(EvictionPolicy::kSnapKV, b.shape.seq_len / 3);
    spec.quant.bits = b.bits;
    spec.quant.group_size = b.shape.head_dim % 16 == 0 ? 16 : 20;  // a divisor of head_dim
    spec.recent_tokens = 40;
    if (b.think) {
      spec.channels.key_policy = ChannelPolicy::kThink;
      spec.channels.key_lambda = 0.25;
    }
    const absl::StatusOr<CompactLayer> blob = Cpu().Compress(layer.input(), spec, nullptr);
    ASSERT_TRUE(blob.ok()) << blob.status();
    const CompactLayerView view = CompactLayerView::Parse(blob->bytes).value();
    for (int n_q : {3, 1}) {
      gpu_testing::CompareOptions o;
      o.attention_n_q = n_q;
      gpu_testing::CompareAttention(view, b.shape.num_q_heads, o);
    }
  }
}

// Concurrent Compress calls with different specs and inputs (host and device memory) and Attend
// calls, from 8 threads on a backend with 4 streams: each result equals its sequential one.
TEST(CudaBackend, ConcurrentCallsMatchSequentialOnes) {
  const Layer layer = RandomLayer(Shape(2, 4, 2048, 128, 32), DType::kF16, Layout::kHND, 11);
  const DeviceLayer dev(layer);
  ASSERT_TRUE(dev.ok()) << dev.error();
  std::vector<CompressionSpec> specs = {
      Spec(EvictionPolicy::kSnapKV, 256), Spec(EvictionPolicy::kKeyformer, 256),
      Spec(EvictionPolicy::kKeyDiff, 256), Spec(EvictionPolicy::kKNorm, 256)};
  specs[0].quant.bits = 4;
  specs[1].channels.key_policy = ChannelPolicy::kThink;
  specs[1].channels.key_lambda = 0.5;
  std::vector<CompactLayer> ref;
  for (const CompressionSpec& s : specs) {
    ref.push_back(Gpu().Compress(layer.input(), s, nullptr).value());
  }
  const CompactLayerView view = CompactLayerView::Parse(ref[0].bytes).value();
  std::vector<float> q(8 * 128, 0.25f), kn(2 * 128, 0.5f), vn(2 * 128, -0.5f);
  DecodeQuery dq{8, 1, q.data(), 1, kn.data(), vn.data()};
  std::vector<float> ref_out(q.size());
  ASSERT_TRUE(Gpu().Attend(view, dq, ref_out.data()).ok());
  std::vector<std::thread> threads;
  std::vector<int> equal(8, 0);
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      for (int rep = 0; rep < 4; ++rep) {
        const int k = (i + rep) % 4;
        const LayerInput in = (i + rep) % 2 ? dev.input() : layer.input();
        const absl::StatusOr<CompactLayer> r = Gpu().Compress(in, specs[k], nullptr);
        std::vector<float> out(q.size());
        const absl::Status a = Gpu().Attend(view, dq, out.data());
        equal[i] += r.ok() && r->bytes == ref[k].bytes && a.ok() && out == ref_out;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < 8; ++i) EXPECT_EQ(equal[i], 4) << "thread " << i;
  EXPECT_GT(GpuMemoryUsedBytes(), 0u);
}

// Device-resident K, V and Q_obs give exactly the bytes host memory gives, for every path
// (expected attention copies Q_obs to the host for its statistics; head-adaptive budgets copy the
// layer for the host pack).
TEST(CudaBackend, DeviceResidentInputMatchesHostInput) {
  const RopeParams rope{10000.0, 0, false, 1.0};
  std::vector<std::string> specs = {"snapkv:0.25",      "keyformer:0.3,tau=2",
                                    "keydiff:0.25",     "expected:0.25",
                                    "h2o:0.25,ada=0.2", "snapkv:0.25,layer=1+think:0.5+q4",
                                    "knorm:0.5"};
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    for (Layout lay : {Layout::kHND, Layout::kNHD}) {
      const Layer layer = RandomLayer(Shape(4, 4, 3000, 128, 32), dt, lay, 13);
      const DeviceLayer dev(layer);
      ASSERT_TRUE(dev.ok()) << dev.error();
      for (const std::string& text : specs) {
        SCOPED_TRACE(
            absl::StrCat(text, " ", std::string(DTypeName(dt)), " ", std::string(LayoutName(lay))));
        const absl::StatusOr<CompressionSpec> parsed = ParseSpecString(text);
        ASSERT_TRUE(parsed.ok()) << parsed.status();
        const CompressionSpec& spec = *parsed;
        LayerInput host = layer.input(), device = dev.input();
        host.rope = device.rope = &rope;
        const absl::StatusOr<CompactLayer> a = Gpu().Compress(host, spec, nullptr);
        const absl::StatusOr<CompactLayer> b = Gpu().Compress(device, spec, nullptr);
        ASSERT_TRUE(a.ok()) << a.status();
        ASSERT_TRUE(b.ok()) << b.status();
        EXPECT_EQ(a->bytes, b->bytes);
      }
    }
  }
}

// A backend on the last visible device (when there are two or more) compresses exactly as the
// one on device 0, accepts device memory of its own device and refuses device 0's.
TEST(CudaBackend, AnotherDeviceMatchesDeviceZero) {
  const int n = gpu_testing::DeviceCount();
  if (n < 2) GTEST_SKIP() << "one CUDA device visible: nothing to compare device 0 with";
  auto other = CreateCudaBackend({.device = n - 1});
  ASSERT_TRUE(other.ok()) << other.status();
  const Layer layer = RandomLayer(Shape(8, 4, 6000, 128, 32), DType::kF16, Layout::kHND, 3);
  CompressionSpec spec = Spec(EvictionPolicy::kSnapKV, 1500);
  spec.quant.bits = 4;
  const CompactLayer a = Gpu().Compress(layer.input(), spec, nullptr).value();
  const absl::StatusOr<CompactLayer> b = (*other)->Compress(layer.input(), spec, nullptr);
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a.bytes, b->bytes);
  const DeviceLayer mine(layer, n - 1), zeros(layer, 0);
  ASSERT_TRUE(mine.ok() && zeros.ok()) << mine.error() << zeros.error();
  const absl::StatusOr<CompactLayer> c = (*other)->Compress(mine.input(), spec, nullptr);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(a.bytes, c->bytes);
  const absl::StatusOr<CompactLayer> d = (*other)->Compress(zeros.input(), spec, nullptr);
  EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << d.status();
  // Attention on that device agrees with the CPU too.
  const CompactLayerView view = CompactLayerView::Parse(a.bytes).value();
  std::vector<float> q(32 * 128, 0.1f), kn(8 * 128, 0.2f), vn(8 * 128, 0.3f);
  const DecodeQuery dq{32, 1, q.data(), 1, kn.data(), vn.data()};
  std::vector<float> want(q.size()), got(q.size());
  ASSERT_TRUE(Cpu().Attend(view, dq, want.data()).ok());
  ASSERT_TRUE((*other)->Attend(view, dq, got.data()).ok());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_NEAR(want[i], got[i], 2e-3f + 2e-3f * std::fabs(want[i])) << i;
  }
}

// ---- A Llama-3-8B layer at 128K tokens (8 KV heads, 32 query heads, D 128, W 32, fp16) ----

const Layer& Llama128K() {
  static const Layer* layer =
      new Layer(RandomLayer(Shape(8, 4, 131072, 128, 32), DType::kF16, Layout::kHND, 128, 5));
  return *layer;
}

class Llama3At128K : public ::testing::TestWithParam<EvictionPolicy> {};

TEST_P(Llama3At128K, CompressMatchesTheCpu) {
  const Layer& layer = Llama128K();
  const CompressionSpec spec = Spec(GetParam(), 32768);
  gpu_testing::CompareCompressed(absl::StrCat(std::string(PolicyName(GetParam())), "_128k"), layer,
                                 layer.input(), spec);
  // The same layer already on the device: no host staging, the same bytes.
  const DeviceLayer dev(layer);
  ASSERT_TRUE(dev.ok()) << dev.error();
  const absl::StatusOr<CompactLayer> a = Gpu().Compress(layer.input(), spec, nullptr);
  const absl::StatusOr<CompactLayer> b = Gpu().Compress(dev.input(), spec, nullptr);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << b.status();
  EXPECT_EQ(a->bytes, b->bytes);
}

INSTANTIATE_TEST_SUITE_P(Policies, Llama3At128K,
                         ::testing::Values(EvictionPolicy::kSnapKV, EvictionPolicy::kH2O,
                                           EvictionPolicy::kKeyformer, EvictionPolicy::kKeyDiff),
                         [](const ::testing::TestParamInfo<EvictionPolicy>& i) {
                           return std::string(PolicyName(i.param));
                         });

}  // namespace
}  // namespace kvc

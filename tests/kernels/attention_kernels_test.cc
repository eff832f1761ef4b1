// The CPU decode-attention kernels path by path, exact (fp32) mode: every instruction-set level
// this CPU has (kvc/cpu_isa.h: portable, AVX2/F16C, AVX-512),
// every storage format (f32, f16, bf16 rows; 2-, 4- and 8-bit codes, value groups that the
// vector path takes and ones it leaves to the portable path), query groups of 1 to 9, heads long
// enough to be split into several chunks (whose partial softmax results are merged), ragged
// per-head counts, the thread pool and the batch entry point, and the dense-cache kernel. Each is
// compared with a double-precision reference over the dequantized rows.
#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "../../kernels/cpu/attention_internal.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/isa_util.h"
#include "kernels/pack_util.h"
#include "kvc/attention.h"
#include "kvc/selection.h"
#include "kvc/thread_pool.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing_isa::ScopedIsaCap;
using testing_isa::SupportedIsas;
using testing_pack::ConcatHeads;
using testing_pack::MakePackLayer;
using testing_pack::PackLayerData;
using testing_pack::RandomChannels;
using testing_pack::RandomTokens;
using testing_pack::ReferenceAttention;
using testing_pack::UniformFloats;

// Relative tolerance against the double reference: fp32 accumulation over up to a few thousand
// rows, and the polynomial exp of the softmax (~1e-7 relative).
constexpr float kTol = 2e-4f;

struct Queries {
  int hq = 0, n_q = 0, n_new = 0;
  std::vector<float> q, k_new, v_new;
  DecodeQuery query() const {
    return DecodeQuery{hq,
                       n_q,
                       q.data(),
                       n_new,
                       n_new > 0 ? k_new.data() : nullptr,
                       n_new > 0 ? v_new.data() : nullptr};
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

// The dequantized rows of every head (what the kernel must attend over, exactly).
void HeadRows(const CompactLayerView& view, std::vector<std::vector<float>>* keys,
              std::vector<std::vector<float>>* values) {
  keys->assign(view.num_kv_heads(), {});
  values->assign(view.num_kv_heads(), {});
  for (int h = 0; h < view.num_kv_heads(); ++h) {
    const size_t n = static_cast<size_t>(view.desc(h).n_kept) * view.head_dim();
    (*keys)[h].resize(n);
    (*values)[h].resize(n);
    UnpackHeadToFloat(view, h, (*keys)[h].data(), (*values)[h].data());
  }
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], kTol * (1.0f + std::fabs(want[i]))) << "element " << i;
  }
}

class AttentionKernelsTest : public ::testing::Test {};

// Quantized caches in fp32 (the integer path has its own test, attention_int_test.cc).
constexpr PackedAttentionOptions kExact{.math = PackedAttentionOptions::Math::kExact};

struct FormatCase {
  DType dtype;
  int bits, group, tk, tv;
};

// Every format on every path, single-threaded and on a pool, with heads of 2500 kept tokens
// (three chunks) and query groups that exercise the 4-query blocks and their remainders.
TEST_F(AttentionKernelsTest, EveryFormatOnBothPathsMatchesReference) {
  const FormatCase formats[] = {
      {DType::kF16, 0, 0, 128, 128}, {DType::kBF16, 0, 0, 64, 128}, {DType::kF32, 0, 0, 40, 24},
      {DType::kF16, 4, 32, 64, 128}, {DType::kF16, 2, 32, 64, 128}, {DType::kF16, 8, 16, 64, 64},
      {DType::kBF16, 4, 8, 56, 120}, {DType::kF16, 4, 12, 64, 96},  // group 12: portable values
      {DType::kF16, 4, 32, 61, 77},                                 // odd counts: portable
  };
  ThreadPool pool(3);
  std::mt19937 rng(2024);
  int checked = 0;
  for (const FormatCase& f : formats) {
    const int hkv = 2, d = 128, s = 3000, budget = 2500;
    const PackLayerData layer = MakePackLayer(hkv, s, d, f.dtype, Layout::kHND, rng());
    const TokenSelection tokens = RandomTokens(hkv, s, budget, &rng);
    const ChannelSelection channels = RandomChannels(hkv, d, f.tk, f.tv, &rng);
    CompressionSpec spec;
    spec.quant.bits = f.bits;
    spec.quant.group_size = f.bits > 0 ? f.group : 32;
    spec.recent_tokens = 24;
    absl::StatusOr<CompactLayer> packed = PackLayer(layer.input(), tokens, channels, spec);
    ASSERT_TRUE(packed.ok()) << packed.status();
    absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
    ASSERT_TRUE(view.ok()) << view.status();
    std::vector<std::vector<float>> keys, values;
    HeadRows(*view, &keys, &values);
    for (int g : {1, 3, 4, 9}) {
      const int n_q = g == 3 ? 2 : 1;
      const Queries q = MakeQueries(hkv, hkv * g, d, n_q, n_q + 1, &rng);
      const std::vector<float> ref =
          ReferenceAttention(keys, values, d, hkv * g, n_q, q.q, q.n_new, q.k_new, q.v_new);
      for (CpuIsa isa : SupportedIsas()) {
        for (ThreadPool* p : {static_cast<ThreadPool*>(nullptr), &pool}) {
          SCOPED_TRACE(::testing::Message()
                       << DTypeName(f.dtype) << " bits " << f.bits << " G " << f.group << " Tk "
                       << f.tk << " Tv " << f.tv << " g " << g << " isa " << CpuIsaName(isa)
                       << " pool " << (p != nullptr));
          const ScopedIsaCap cap(isa);
          std::vector<float> out(q.q.size(), -9.0f);
          ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), out.data(), p, kExact).ok());
          ExpectNear(out, ref);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 9 * 4 * static_cast<int>(SupportedIsas().size()) * 2);
}

// Heads with different kept counts, channel counts and (through the recent block) different
// old/recent splits, quantized and not, on a pool: each head is planned from its own counts.
TEST_F(AttentionKernelsTest, RaggedHeadsQuantizedAndNot) {
  std::mt19937 rng(99);
  ThreadPool pool(2);
  const int d = 64;
  for (int bits : {0, 4, 2}) {
    std::vector<std::vector<uint8_t>> singles;
    const int budgets[] = {1500, 7, 3100, 40};
    const int tks[] = {64, 32, 16, 48};
    const int tvs[] = {64, 56, 64, 8};
    for (int h = 0; h < 4; ++h) {
      const PackLayerData layer = MakePackLayer(1, 3200, d, DType::kF16, Layout::kHND, rng());
      CompressionSpec spec;
      spec.quant.bits = bits;
      spec.quant.group_size = 8;
      spec.recent_tokens = 16;
      absl::StatusOr<CompactLayer> p =
          PackLayer(layer.input(), RandomTokens(1, 3200, budgets[h], &rng),
                    RandomChannels(1, d, tks[h], tvs[h], &rng), spec);
      ASSERT_TRUE(p.ok()) << p.status();
      singles.emplace_back(p->bytes.begin(), p->bytes.end());
    }
    const std::vector<uint8_t> merged = ConcatHeads(singles);
    absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(merged);
    ASSERT_TRUE(view.ok()) << view.status();
    for (int h = 0; h < 4; ++h) ASSERT_EQ(view->desc(h).n_kept, budgets[h]);
    std::vector<std::vector<float>> keys, values;
    HeadRows(*view, &keys, &values);
    const Queries q = MakeQueries(4, 16, d, 1, 1, &rng);
    const std::vector<float> ref =
        ReferenceAttention(keys, values, d, 16, 1, q.q, 1, q.k_new, q.v_new);
    for (CpuIsa isa : SupportedIsas()) {
      SCOPED_TRACE(::testing::Message() << "bits " << bits << " isa " << CpuIsaName(isa));
      const ScopedIsaCap cap(isa);
      std::vector<float> out(q.q.size());
      ASSERT_TRUE(PackedAttentionCpu(*view, q.query(), out.data(), &pool, kExact).ok());
      ExpectNear(out, ref);
    }
  }
}

// A batch gives each sequence exactly what a call of its own gives; a bad item is named and
// nothing is written.
TEST_F(AttentionKernelsTest, BatchEqualsSeparateCalls) {
  std::mt19937 rng(5);
  ThreadPool pool(3);
  std::vector<CompactLayer> layers;
  std::vector<CompactLayerView> views;
  std::vector<Queries> queries;
  for (int i = 0; i < 3; ++i) {
    const int s = 500 + 700 * i;
    const PackLayerData layer = MakePackLayer(2, s, 32, DType::kF16, Layout::kHND, rng());
    CompressionSpec spec;
    spec.quant.bits = i == 1 ? 4 : 0;
    absl::StatusOr<CompactLayer> p = PackLayer(layer.input(), RandomTokens(2, s, s / 2, &rng),
                                               RandomChannels(2, 32, 16 + 8 * i, 32, &rng), spec);
    ASSERT_TRUE(p.ok()) << p.status();
    layers.push_back(*std::move(p));
    queries.push_back(MakeQueries(2, 8, 32, 1, 1, &rng));
  }
  for (const CompactLayer& l : layers) views.push_back(*CompactLayerView::Parse(l.bytes));
  std::vector<std::vector<float>> outs(3), want(3);
  std::vector<PackedAttentionItem> items;
  for (int i = 0; i < 3; ++i) {
    outs[i].assign(queries[i].q.size(), 0.0f);
    want[i].assign(queries[i].q.size(), 0.0f);
    ASSERT_TRUE(PackedAttentionCpu(views[i], queries[i].query(), want[i].data()).ok());
    items.push_back({&views[i], queries[i].query(), outs[i].data()});
  }
  ASSERT_TRUE(PackedAttentionBatchCpu(items, &pool).ok());
  for (int i = 0; i < 3; ++i) ExpectNear(outs[i], want[i]);

  for (auto& o : outs) std::fill(o.begin(), o.end(), -1.0f);
  items[1].query.num_q_heads = 3;
  const absl::Status st = PackedAttentionBatchCpu(items, &pool);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("item 1: query.num_q_heads: 3"));
  for (const auto& o : outs) {
    for (float x : o) ASSERT_EQ(x, -1.0f);
  }
  items[1].cache = nullptr;
  EXPECT_THAT(std::string(PackedAttentionBatchCpu(items, &pool).message()),
              HasSubstr("item 1: cache: empty view"));
}

// The dense-cache kernel (the bench's baseline) equals packed attention over a layer that keeps
// every token and channel, and the reference.
TEST_F(AttentionKernelsTest, DenseKernelMatchesKeepEverythingLayer) {
  std::mt19937 rng(17);
  ThreadPool pool(2);
  for (DType dt : {DType::kF16, DType::kBF16, DType::kF32}) {
    const int hkv = 2, s = 2100, d = 64;
    const PackLayerData layer = MakePackLayer(hkv, s, d, dt, Layout::kHND, rng());
    absl::StatusOr<CompactLayer> p = PackLayer(layer.input(), RandomTokens(hkv, s, s, &rng),
                                               ChannelSelection{d, d, {}, {}}, CompressionSpec{});
    ASSERT_TRUE(p.ok()) << p.status();
    const CompactLayerView view = *CompactLayerView::Parse(p->bytes);
    const Queries q = MakeQueries(hkv, 8, d, 1, 1, &rng);
    std::vector<float> packed(q.q.size()), dense(q.q.size());
    ASSERT_TRUE(PackedAttentionCpu(view, q.query(), packed.data(), &pool).ok());
    const cpu::DenseKv kv{dt, hkv, s, d, layer.k.data(), layer.v.data()};
    const DecodeQuery dq = q.query();
    float* out = dense.data();
    ASSERT_TRUE(cpu::DenseAttentionBatch({kv}, {dq}, {out}, &pool).ok());
    ExpectNear(dense, packed);
    std::vector<std::vector<float>> keys, values;
    HeadRows(view, &keys, &values);
    ExpectNear(dense, ReferenceAttention(keys, values, d, 8, 1, q.q, 1, q.k_new, q.v_new));
  }
}

}  // namespace
}  // namespace kvc

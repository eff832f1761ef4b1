// The parallel compact writer (cpu::PackLayerImpl, used by the CPU backend): the blob is
// byte-identical to the serial PackLayer for any thread count, dtype, layout and quantization; the
// work it reports is consistent; bad input is rejected like PackLayer does.
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../../kernels/core/quantize.h"
#include "../../kernels/cpu/pack.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/pack_util.h"
#include "kvc/compact.h"
#include "kvc/selection.h"
#include "kvc/thread_pool.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing_pack::MakePackLayer;
using testing_pack::PackLayerData;
using testing_pack::RandomChannels;
using testing_pack::RandomTokens;

CompressionSpec Spec(int bits, int group, int recent) {
  CompressionSpec s;
  s.quant.bits = bits;
  s.quant.group_size = group;
  s.recent_tokens = recent;
  return s;
}

TEST(PackParallelTest, BytesEqualSerialPackLayerForAnyThreadCount) {
  std::mt19937 rng(21);
  ThreadPool two(2), four(4), seven(7);
  int cases = 0;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (Layout lay : {Layout::kHND, Layout::kNHD}) {
      for (int bits : {0, 2, 4, 8}) {
        // Odd head counts (more tasks than threads, and not a multiple of them), pruned and
        // unpruned channels, budgets with and without a recent block.
        const int hkv = 1 + static_cast<int>(rng() % 5), s = 40 + static_cast<int>(rng() % 60);
        const int d = (rng() % 2) ? 16 : 40;
        const PackLayerData layer = MakePackLayer(hkv, s, d, dt, lay, rng());
        const int budget = 1 + static_cast<int>(rng() % s);
        const int tk = 1 + static_cast<int>(rng() % d);
        const int tv = (rng() % 2) ? d : 1 + static_cast<int>(rng() % d);
        const TokenSelection tokens = RandomTokens(hkv, s, budget, &rng);
        const ChannelSelection channels = RandomChannels(hkv, d, tk, tv, &rng);
        const CompressionSpec spec =
            Spec(bits, 1 + static_cast<int>(rng() % 9), static_cast<int>(rng() % 7));
        absl::StatusOr<CompactLayer> serial = PackLayer(layer.input(), tokens, channels, spec);
        ASSERT_TRUE(serial.ok()) << serial.status();
        ASSERT_EQ(serial->bytes.size(), PackedSize(layer.shape, dt, tokens, channels, spec));
        for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two, &four, &seven}) {
          absl::StatusOr<CompactLayer> par =
              cpu::PackLayerImpl(layer.input(), tokens, channels, spec, pool, nullptr);
          ASSERT_TRUE(par.ok()) << par.status();
          EXPECT_EQ(par->bytes, serial->bytes)
              << "dtype " << static_cast<int>(dt) << " layout " << static_cast<int>(lay) << " bits "
              << bits << " threads " << (pool ? pool->num_threads() : 0);
        }
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 24);
}

TEST(PackParallelTest, ConcurrentCallsOnOnePoolAgree) {
  const PackLayerData layer = MakePackLayer(6, 120, 32, DType::kF16, Layout::kHND, 3);
  std::mt19937 rng(5);
  const TokenSelection tokens = RandomTokens(6, 120, 50, &rng);
  const ChannelSelection channels = RandomChannels(6, 32, 12, 32, &rng);
  const CompressionSpec spec = Spec(4, 8, 6);
  absl::StatusOr<CompactLayer> ref = PackLayer(layer.input(), tokens, channels, spec);
  ASSERT_TRUE(ref.ok()) << ref.status();
  ThreadPool pool(3);
  std::vector<ByteVector> got(4);
  pool.ParallelFor(4, [&](int i) {
    absl::StatusOr<CompactLayer> p =
        cpu::PackLayerImpl(layer.input(), tokens, channels, spec, &pool, nullptr);
    if (p.ok()) got[i] = std::move(p->bytes);
  });
  for (const ByteVector& g : got) EXPECT_EQ(g, ref->bytes);
}

// The writer converts and quantizes the old block in chunks of rows; the blocks must equal one
// quantization call over the whole block (groups never straddle a chunk).
TEST(PackParallelTest, QuantizedBlocksEqualOneCallOverTheWholeBlock) {
  constexpr int kHeads = 2, kSeq = 900, kDim = 64, kRecent = 7;
  const PackLayerData layer = MakePackLayer(kHeads, kSeq, kDim, DType::kF32, Layout::kNHD, 4);
  std::mt19937 rng(6);
  const TokenSelection tokens = RandomTokens(kHeads, kSeq, 800, &rng);
  const ChannelSelection channels = RandomChannels(kHeads, kDim, 40, 64, &rng);
  for (int bits : {2, 4, 8}) {
    for (int g : {1, 5, 32, 300, 5000}) {
      ThreadPool pool(2);
      absl::StatusOr<CompactLayer> blob = cpu::PackLayerImpl(
          layer.input(), tokens, channels, Spec(bits, g, kRecent), &pool, nullptr);
      ASSERT_TRUE(blob.ok()) << blob.status();
      absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob->bytes);
      ASSERT_TRUE(view.ok()) << view.status();
      for (int h = 0; h < kHeads; ++h) {
        const CompactHead head = view->head(h);
        const int m = head.n_kept - head.n_recent;
        for (bool values : {false, true}) {
          const int t = values ? head.value_channels : head.key_channels;
          const int32_t* idx = values ? head.value_idx : head.key_idx;
          std::vector<float> x(static_cast<size_t>(m) * t);
          for (int i = 0; i < m; ++i) {
            for (int c = 0; c < t; ++c) {
              x[static_cast<size_t>(i) * t + c] = values ? layer.V(h, head.positions[i], idx[c])
                                                         : layer.K(h, head.positions[i], idx[c]);
            }
          }
          const size_t params = values ? static_cast<size_t>(m) * quant::NumGroups(t, g)
                                       : static_cast<size_t>(quant::NumGroups(m, g)) * t;
          std::vector<float> scale(params), zero(params);
          std::vector<uint8_t> codes(static_cast<size_t>(m) * quant::CodeRowBytes(t, bits));
          if (values) {
            quant::QuantizeValues(x.data(), m, t, bits, g, scale.data(), zero.data(), codes.data());
          } else {
            quant::QuantizeKeys(x.data(), m, t, bits, g, scale.data(), zero.data(), codes.data());
          }
          const float* got_scale = values ? head.value_scale : head.key_scale;
          const float* got_zero = values ? head.value_zero : head.key_zero;
          const uint8_t* got_codes = values ? head.value_codes : head.key_codes;
          SCOPED_TRACE(::testing::Message()
                       << "bits " << bits << " g " << g << " head " << h << " values " << values);
          EXPECT_EQ(std::memcmp(got_scale, scale.data(), params * sizeof(float)), 0);
          EXPECT_EQ(std::memcmp(got_zero, zero.data(), params * sizeof(float)), 0);
          EXPECT_EQ(std::memcmp(got_codes, codes.data(), codes.size()), 0);
        }
      }
    }
  }
}

TEST(PackParallelTest, ReportsQuantizeWorkOnlyWhenQuantizing) {
  const PackLayerData layer = MakePackLayer(4, 400, 64, DType::kBF16, Layout::kHND, 8);
  std::mt19937 rng(9);
  const TokenSelection tokens = RandomTokens(4, 400, 300, &rng);
  const ChannelSelection channels = RandomChannels(4, 64, 32, 64, &rng);
  ThreadPool pool(2);

  cpu::PackWork plain;
  ASSERT_TRUE(
      cpu::PackLayerImpl(layer.input(), tokens, channels, Spec(0, 1, 4), &pool, &plain).ok());
  EXPECT_GT(plain.task_seconds, 0.0);
  EXPECT_EQ(plain.quantize_seconds, 0.0);

  cpu::PackWork quant;
  ASSERT_TRUE(
      cpu::PackLayerImpl(layer.input(), tokens, channels, Spec(4, 32, 4), &pool, &quant).ok());
  EXPECT_GT(quant.quantize_seconds, 0.0);
  EXPECT_LE(quant.quantize_seconds, quant.task_seconds);
}

TEST(PackParallelTest, RejectsBadInputLikePackLayer) {
  const PackLayerData layer = MakePackLayer(2, 20, 16, DType::kF16, Layout::kHND, 1);
  std::mt19937 rng(2);
  TokenSelection tokens = RandomTokens(2, 20, 8, &rng);
  const ChannelSelection channels = RandomChannels(2, 16, 8, 16, &rng);
  tokens.positions[3] = tokens.positions[2];  // not strictly ascending
  ThreadPool pool(2);
  cpu::PackWork work{1.0, 1.0};
  absl::StatusOr<CompactLayer> p =
      cpu::PackLayerImpl(layer.input(), tokens, channels, Spec(4, 4, 2), &pool, &work);
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("tokens.positions"));
  EXPECT_EQ(work.task_seconds, 1.0);  // untouched on error
}

}  // namespace
}  // namespace kvc

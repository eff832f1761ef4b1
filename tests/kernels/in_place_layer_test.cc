// InPlaceLayer: a layer stored whole, written chunk by chunk straight into its blob, must equal
// PackLayer's (and the CPU backend's) output byte for byte, whatever the dtype, layout, shape and
// chunking; and it refuses what it cannot build.
#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/selection.h"
#include "pack_util.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing_pack::MakePackLayer;
using testing_pack::PackLayerData;

// Writes `bytes` of one tensor as chunks of random sizes in a random order (as uploads may).
void WriteShuffled(InPlaceLayer* l, bool values, const std::vector<uint8_t>& bytes,
                   size_t max_chunk, std::mt19937* rng) {
  std::vector<std::pair<size_t, size_t>> chunks;
  std::uniform_int_distribution<size_t> size(1, max_chunk);
  for (size_t at = 0; at < bytes.size();) {
    const size_t n = std::min(size(*rng), bytes.size() - at);
    chunks.push_back({at, n});
    at += n;
  }
  std::shuffle(chunks.begin(), chunks.end(), *rng);
  for (auto [at, n] : chunks) l->Write(values, at, bytes.data() + at, n);
}

TEST(InPlaceLayerTest, EqualsPackLayerAndTheCpuBackendForEveryDtypeLayoutAndChunking) {
  auto cpu = CreateCpuBackend({.num_threads = 2});
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  std::mt19937 rng(11);
  struct Shape {
    int hkv, seq, dim;
  };
  for (Shape sh :
       {Shape{1, 1, 8}, Shape{2, 37, 8}, Shape{4, 130, 64}, Shape{8, 64, 128}, Shape{3, 9, 256}}) {
    for (DType dtype : {DType::kF16, DType::kBF16, DType::kF32}) {
      for (Layout layout : {Layout::kHND, Layout::kNHD}) {
        SCOPED_TRACE(::testing::Message()
                     << sh.hkv << "x" << sh.seq << "x" << sh.dim << " dtype "
                     << static_cast<int>(dtype) << " layout " << static_cast<int>(layout));
        const PackLayerData data = MakePackLayer(sh.hkv, sh.seq, sh.dim, dtype, layout, rng());
        LayerInput in = data.input();
        in.layer_index = 3;
        CompressionSpec spec;  // policy none: kept whole
        auto placed = InPlaceLayer::Create(data.shape, dtype, layout, in.layer_index, spec);
        ASSERT_TRUE(placed.ok()) << placed.status();
        ASSERT_EQ(placed->tensor_bytes(), data.k.size());
        // Chunks from 1 byte (splitting elements and rows) up to several heads.
        const size_t max_chunk = 1 + rng() % (2 * data.k.size());
        WriteShuffled(&*placed, false, data.k, max_chunk, &rng);
        WriteShuffled(&*placed, true, data.v, max_chunk, &rng);
        const CompactLayer built = std::move(*placed).Release();

        TokenSelection all_tokens = testing_pack::RandomTokens(sh.hkv, sh.seq, sh.seq, &rng);
        ChannelSelection all_channels =
            testing_pack::RandomChannels(sh.hkv, sh.dim, sh.dim, sh.dim, &rng);
        auto packed = PackLayer(in, all_tokens, all_channels, spec);
        ASSERT_TRUE(packed.ok()) << packed.status();
        EXPECT_TRUE(built.bytes == packed->bytes) << "in-place blob differs from PackLayer's";
        auto compressed = (*cpu)->Compress(in, spec, nullptr);
        ASSERT_TRUE(compressed.ok()) << compressed.status();
        EXPECT_TRUE(built.bytes == compressed->bytes) << "in-place blob differs from Compress";
        EXPECT_TRUE(CompactLayerView::Parse(built.bytes).ok());
      }
    }
  }
}

// Every byte written is reported exactly once, as pieces that hold the bytes just written, point
// at those bytes in the input, and never cross a kPieceBytes boundary of the blob.
TEST(InPlaceLayerTest, ReportsEachPlacedPiece) {
  std::mt19937 rng(5);
  for (Layout layout : {Layout::kHND, Layout::kNHD}) {
    const PackLayerData data = MakePackLayer(8, 300, 128, DType::kF16, layout, 3);
    auto placed = InPlaceLayer::Create(data.shape, DType::kF16, layout, 0, CompressionSpec{});
    ASSERT_TRUE(placed.ok()) << placed.status();
    std::vector<int> seen(placed->blob_bytes(), 0);
    size_t pieces = 0;
    for (bool values : {false, true}) {
      const std::vector<uint8_t>& src = values ? data.v : data.k;
      for (size_t at = 0; at < src.size();) {
        const size_t n = std::min<size_t>(1 + rng() % (700 << 10), src.size() - at);
        const uint8_t* next = src.data() + at;  // pieces come in input order
        placed->Write(values, at, src.data() + at, n,
                      [&](size_t off, const uint8_t* from, size_t len) {
          ++pieces;
          ASSERT_LE(off + len, seen.size());
          EXPECT_EQ(from, next);
          next += len;
          EXPECT_EQ(std::memcmp(placed->blob() + off, from, len), 0);
          EXPECT_EQ(off / InPlaceLayer::kPieceBytes, (off + len - 1) / InPlaceLayer::kPieceBytes);
          for (size_t i = off; i < off + len; ++i) ++seen[i];
        });
        at += n;
      }
    }
    size_t covered = 0;
    for (int c : seen) {
      ASSERT_LE(c, 1);
      covered += c;
    }
    EXPECT_EQ(covered, 2 * placed->tensor_bytes());
    EXPECT_GT(pieces, 2 * placed->tensor_bytes() / InPlaceLayer::kPieceBytes);
  }
}

TEST(InPlaceLayerTest, KeepsEverythingOnlyWithEveryReductionOff) {
  CompressionSpec spec;
  EXPECT_TRUE(InPlaceLayer::KeepsEverything(spec));
  CompressionSpec evict = spec;
  evict.eviction.policy = EvictionPolicy::kStreaming;
  evict.eviction.keep_ratio = 1.0;  // keeps every token, but the blob records the policy
  EXPECT_FALSE(InPlaceLayer::KeepsEverything(evict));
  CompressionSpec keys = spec;
  keys.channels.key_policy = ChannelPolicy::kL2;
  EXPECT_FALSE(InPlaceLayer::KeepsEverything(keys));
  CompressionSpec values = spec;
  values.channels.prune_values = true;
  EXPECT_FALSE(InPlaceLayer::KeepsEverything(values));
  CompressionSpec quant = spec;
  quant.quant.bits = 8;
  EXPECT_FALSE(InPlaceLayer::KeepsEverything(quant));
}

TEST(InPlaceLayerTest, RefusesWhatItCannotBuildNamingTheField) {
  LayerShape shape{.num_kv_heads = 2, .num_q_heads = 4, .seq_len = 16, .head_dim = 32};
  CompressionSpec spec;
  auto expect = [](const absl::StatusOr<InPlaceLayer>& r, const std::string& field) {
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(r.status().message(), HasSubstr(field));
  };
  LayerShape bad = shape;
  bad.head_dim = 7;
  expect(InPlaceLayer::Create(bad, DType::kF16, Layout::kHND, 0, spec), "head_dim");
  expect(InPlaceLayer::Create(shape, static_cast<DType>(9), Layout::kHND, 0, spec), "dtype");
  expect(InPlaceLayer::Create(shape, DType::kF16, static_cast<Layout>(5), 0, spec), "layout");
  expect(InPlaceLayer::Create(shape, DType::kF16, Layout::kHND, -1, spec), "layer_index");
  CompressionSpec quant = spec;
  quant.quant.bits = 4;
  expect(InPlaceLayer::Create(shape, DType::kF16, Layout::kHND, 0, quant), "spec");
}

}  // namespace
}  // namespace kvc

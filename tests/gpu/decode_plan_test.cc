// Host-side planning of the split decode kernel (cuda/decode_plan.h): which shapes it takes, how
// it sizes chunks and scratch for ragged heads, and the bytes the benchmark reports.
#include "cuda/decode_plan.h"

#include <vector>

#include "gtest/gtest.h"
#include "kvc/compact.h"
#include "kvc/selection.h"

namespace kvc::cuda {
namespace {

AttnHead Head(int n_kept, int n_recent, int tk, int tv) {
  AttnHead h = {};
  h.n_kept = n_kept;
  h.n_recent = n_recent;
  h.key_channels = tk;
  h.value_channels = tv;
  return h;
}

DecodeShape Llama(int batch, int bits = 0) {
  DecodeShape s;
  s.dtype = ElemType::kF16;
  s.num_kv_heads = 8;
  s.num_q_heads = 32;
  s.head_dim = 128;
  s.bits = bits;
  s.group = bits > 0 ? 32 : 0;
  s.n_q = 1;
  s.n_new = 1;
  s.batch = batch;
  return s;
}

TEST(PlanDecode, TakesTheLlamaShapeAndSizesChunksToFillTheDevice) {
  const std::vector<AttnHead> heads(8 * 8, Head(32768, 0, 128, 128));
  const DecodePlan p = PlanDecode(Llama(8), heads, 132);
  ASSERT_TRUE(p.split) << p.why_not;
  EXPECT_EQ(p.rows, 4);
  EXPECT_EQ(p.row_tile, 4);
  EXPECT_EQ(p.chunk, kDecodeMaxChunk);  // 2M tokens: the largest chunk
  EXPECT_EQ(p.max_chunks, 32768 / kDecodeMaxChunk);
  EXPECT_EQ(p.partial_floats, size_t{8} * 8 * p.max_chunks * 4 * 130);

  // A small step: the smallest chunk, so that the launch still has many blocks.
  const std::vector<AttnHead> small(8, Head(512, 32, 64, 128));
  const DecodePlan q = PlanDecode(Llama(1, 4), small, 132);
  ASSERT_TRUE(q.split) << q.why_not;
  EXPECT_EQ(q.chunk, kDecodeMinChunk);
  EXPECT_EQ(q.max_chunks, (480 + 31) / 32 + 1);
}

TEST(PlanDecode, RaggedHeadsCountTheirOldAndRecentChunksSeparately) {
  std::vector<AttnHead> heads = {Head(0, 0, 128, 128), Head(33, 1, 128, 128),
                                 Head(100, 40, 128, 128), Head(64, 64, 128, 128)};
  DecodeShape s = Llama(1);
  s.num_kv_heads = 4;
  s.num_q_heads = 8;
  const DecodePlan p = PlanDecode(s, heads, 132, /*chunk=*/33);  // rounded down to 32
  ASSERT_TRUE(p.split) << p.why_not;
  EXPECT_EQ(p.chunk, 32);
  // 33 kept, 1 recent: 32 old rows (1 chunk) + 1 recent (1 chunk); 100/40: 60 old (2) + 40 (2).
  EXPECT_EQ(p.max_chunks, 4);
  EXPECT_EQ(p.rows, 2);
  EXPECT_EQ(p.partial_floats, size_t{4} * 4 * 2 * 130);
}

TEST(PlanDecode, ChunkIsClampedAndAMultipleOfTheTeams) {
  const std::vector<AttnHead> heads(8, Head(4096, 0, 128, 128));
  EXPECT_EQ(PlanDecode(Llama(1), heads, 132, 1).chunk, kDecodeMinChunk);
  EXPECT_EQ(PlanDecode(Llama(1), heads, 132, 100).chunk, 96);
  EXPECT_EQ(PlanDecode(Llama(1), heads, 132, 100000).chunk, kDecodeMaxChunk);
  EXPECT_EQ(PlanDecode(Llama(1), heads, 132, 100).chunk % kDecodeTeams, 0);
}

TEST(PlanDecode, ShapesOutsideTheSplitKernelFallBackWithAReason) {
  const std::vector<AttnHead> heads(8, Head(100, 0, 128, 128));
  auto why = [&](DecodeShape s, std::vector<AttnHead> h) {
    const DecodePlan p = PlanDecode(s, h, 132);
    EXPECT_FALSE(p.split);
    return p.why_not;
  };
  DecodeShape s = Llama(1);
  s.dtype = ElemType::kF32;
  EXPECT_NE(why(s, heads).find("dtype"), std::string::npos);
  s = Llama(1);
  s.head_dim = 256;
  EXPECT_NE(why(s, heads).find("head_dim"), std::string::npos);
  s.head_dim = 96 + 4;
  EXPECT_NE(why(s, heads).find("head_dim"), std::string::npos);
  s = Llama(1);
  s.n_q = 3;  // g * n_q = 12 rows
  s.n_new = 3;
  EXPECT_NE(why(s, heads).find("g * n_q"), std::string::npos);
  s = Llama(1);
  s.n_new = kDecodeMaxNew + 1;
  EXPECT_NE(why(s, heads).find("n_new"), std::string::npos);
  s = Llama(1, 4);
  s.group = 12;
  EXPECT_NE(why(s, heads).find("group"), std::string::npos);
  s = Llama(1, 8);
  s.value_bits = 4;  // keys and values at their own bits: the generic kernel
  EXPECT_NE(why(s, heads).find("values at 4"), std::string::npos);
  s.value_bits = 8;  // the same width said explicitly is the split kernel's
  EXPECT_TRUE(PlanDecode(s, heads, 132).split);
  std::vector<AttnHead> odd = heads;
  odd[3].key_channels = 60;  // not a multiple of 8
  EXPECT_NE(why(Llama(1), odd).find("channels"), std::string::npos);
  EXPECT_NE(why(Llama(2), heads).find("batch"), std::string::npos);  // 8 heads for 2 sequences
  // The bf16 and 8-row limits are inside.
  s = Llama(1);
  s.dtype = ElemType::kBF16;
  s.n_q = 2;
  s.n_new = 5;
  const DecodePlan p = PlanDecode(s, heads, 132);
  EXPECT_TRUE(p.split) << p.why_not;
  EXPECT_EQ(p.row_tile, 8);
}

TEST(PackedHeadReadBytes, CountsEveryBlockAttentionReads) {
  // keep 0.25 of 4K + ThinK 0.5 + 4-bit, G = 32, 32 recent tokens: 992 old rows.
  const AttnHead h = Head(1024, 32, 64, 128);
  const uint64_t want = 4 * (64 + 128)      // channel lists
                        + 2 * 32 * 128 * 2  // recent K and V rows, fp16
                        + 2 * 4 * 31 * 64   // key scales and zeros: 31 groups x 64 channels
                        + 992 * 32          // key codes: 64 channels x 4 bits
                        + 2 * 4 * 992 * 4   // value scales and zeros: 4 groups per row
                        + 992 * 64;         // value codes
  EXPECT_EQ(PackedHeadReadBytes(h, 128, 2, 4, 32), want);
  // Full precision: the kept rows and the channel lists.
  EXPECT_EQ(PackedHeadReadBytes(Head(4096, 0, 128, 128), 128, 2, 0, 0),
            4 * 256 + DenseHeadReadBytes(4096, 128, 2));
}

TEST(PackedHeadReadBytes, NeverExceedsTheHeadSectionOfARealBlob) {
  LayerShape shape{2, 8, 700, 128, 16};
  std::vector<uint8_t> k(size_t{2} * 700 * 128 * 2, 0x3c), v = k;  // fp16 1.0
  LayerInput in;
  in.shape = shape;
  in.dtype = DType::kF16;
  in.layout = Layout::kHND;
  in.k = k.data();
  in.v = v.data();
  for (int bits : {0, 2, 4, 8}) {
    TokenSelection t;
    t.num_kv_heads = 2;
    t.budget = 301;
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 301; ++i) t.positions.push_back(2 * i);
    }
    ChannelSelection c;
    c.key_channels = 64;
    c.value_channels = 128;
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 64; ++i) c.key_idx.push_back(2 * i);
      for (int i = 0; i < 128; ++i) c.value_idx.push_back(i);
    }
    CompressionSpec spec;
    spec.quant.bits = bits;
    spec.recent_tokens = 20;
    const absl::StatusOr<CompactLayer> blob = PackLayer(in, t, c, spec);
    ASSERT_TRUE(blob.ok()) << blob.status();
    const absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob->bytes);
    ASSERT_TRUE(view.ok()) << view.status();
    for (int h = 0; h < 2; ++h) {
      const HeadDesc& d = view->desc(h);
      const uint64_t read =
          PackedHeadReadBytes(Head(d.n_kept, d.n_recent, d.key_channels, d.value_channels), 128, 2,
                              bits, view->header().quant_group);
      // The section also holds the positions (not read) and at most 15 padding bytes per block.
      const uint64_t positions = 4 * 301;
      EXPECT_LE(read + positions, d.size) << "bits " << bits;
      EXPECT_GE(read + positions + 10 * 15, d.size) << "bits " << bits;
    }
  }
}

}  // namespace
}  // namespace kvc::cuda

#include "kvc/compact.h"

#include <cmath>
#include <cstring>
#include <random>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/export_pieces_util.h"
#include "kernels/isa_util.h"
#include "kernels/pack_util.h"
#include "kvc/buffer_pool.h"
#include "kvc/cpu_isa.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using testing_pack::ExpectedHeadRows;
using testing_pack::MakePackLayer;
using testing_pack::PackLayerData;
using testing_pack::RandomChannels;
using testing_pack::RandomTokens;

CompressionSpec Spec(int bits, int recent, int group = 32, int value_bits = 0) {
  CompressionSpec spec;
  spec.quant.bits = bits;
  spec.quant.value_bits = value_bits;
  spec.quant.group_size = group;
  spec.recent_tokens = recent;
  return spec;
}

template <typename T>
T At(absl::Span<const uint8_t> b, size_t off) {
  T v;
  std::memcpy(&v, b.data() + off, sizeof(T));
  return v;
}

struct Case {
  DType dtype;
  Layout layout;
  int bits;
  bool prune;
};

// Pack -> Parse -> unpack over random shapes, dtypes, layouts, pruning and bits (the keys' and
// the values': alike, and values at fewer or more bits than the keys).
TEST(CompactTest, RandomRoundTrip) {
  std::mt19937 rng(7);
  int cases = 0;
  const std::pair<int, int> widths[] = {{0, 0}, {2, 2}, {4, 4}, {8, 8}, {8, 4}, {8, 2}, {2, 8}};
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (Layout lay : {Layout::kHND, Layout::kNHD}) {
      for (const auto& [bits, vbits] : widths) {
        for (bool prune : {false, true}) {
          const int hkv = 1 + static_cast<int>(rng() % 3);
          const int d = 8 * (1 + static_cast<int>(rng() % 8));
          const int s = 1 + static_cast<int>(rng() % 90);
          const int budget = 1 + static_cast<int>(rng() % s);
          const int tk = prune ? 1 + static_cast<int>(rng() % d) : d;
          const int tv = prune ? 1 + static_cast<int>(rng() % d) : d;
          const int recent = static_cast<int>(rng() % 12);
          const int group = 1 + static_cast<int>(rng() % 20);
          SCOPED_TRACE(::testing::Message()
                       << "dtype " << DTypeName(dt) << " layout " << LayoutName(lay) << " bits "
                       << bits << "/" << vbits << " H " << hkv << " S " << s << " D " << d
                       << " B " << budget << " tk " << tk << " tv " << tv << " r " << recent
                       << " G " << group);
          const PackLayerData layer = MakePackLayer(hkv, s, d, dt, lay, rng());
          const TokenSelection tokens = RandomTokens(hkv, s, budget, &rng);
          const ChannelSelection channels = RandomChannels(hkv, d, tk, tv, &rng);
          const CompressionSpec spec = Spec(bits, recent, group, vbits);
          absl::StatusOr<CompactLayer> packed = PackLayer(layer.input(), tokens, channels, spec);
          ASSERT_TRUE(packed.ok()) << packed.status();
          EXPECT_EQ(packed->bytes.size(), PackedSize(layer.shape, dt, tokens, channels, spec));
          absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
          ASSERT_TRUE(view.ok()) << view.status();
          // Version 2 (and the values' byte) only where the widths differ.
          EXPECT_EQ(view->header().version, bits == vbits ? 1 : 2);
          EXPECT_EQ(view->header().value_quant_bits, bits == vbits ? 0 : vbits);
          EXPECT_EQ(view->key_bits(), bits);
          EXPECT_EQ(view->value_bits(), vbits);
          EXPECT_EQ(view->num_kv_heads(), hkv);
          EXPECT_EQ(view->head_dim(), d);
          EXPECT_EQ(view->seq_len(), s);
          EXPECT_EQ(view->dtype(), dt);
          const bool reduced = prune && (tk < d || tv < d);
          const int r = (reduced || bits > 0) ? std::min(recent, budget) : 0;
          for (int h = 0; h < hkv; ++h) {
            const CompactHead hd = view->head(h);
            ASSERT_EQ(hd.n_kept, budget);
            ASSERT_EQ(hd.n_recent, r);
            ASSERT_EQ(hd.key_channels, tk);
            ASSERT_EQ(hd.value_channels, tv);
            for (int j = 0; j < budget; ++j) {
              ASSERT_EQ(hd.positions[j], tokens.positions[h * budget + j]);
            }
            for (int c = 0; c < tk; ++c) ASSERT_EQ(hd.key_idx[c], channels.key_idx[h * tk + c]);
            for (int c = 0; c < tv; ++c) ASSERT_EQ(hd.value_idx[c], channels.value_idx[h * tv + c]);
            std::vector<float> want_k, want_v, got_k(budget * d), got_v(budget * d);
            ExpectedHeadRows(layer, tokens, channels, h, r, &want_k, &want_v);
            UnpackHeadToFloat(*view, h, got_k.data(), got_v.data());
            const int m = budget - r;
            // Quantized rows: within half a step of the true value; the step is at most the value
            // range (4 for amp 2) / (2^bits - 1).
            const float kbound = bits > 0 ? 4.0f / ((1 << bits) - 1) / 2 + 1e-5f : 0.0f;
            const float vbound = vbits > 0 ? 4.0f / ((1 << vbits) - 1) / 2 + 1e-5f : 0.0f;
            std::vector<bool> kept_k(d, false), kept_v(d, false);
            for (int c = 0; c < tk; ++c) kept_k[channels.key_idx[h * tk + c]] = true;
            for (int c = 0; c < tv; ++c) kept_v[channels.value_idx[h * tv + c]] = true;
            for (int j = 0; j < budget; ++j) {
              for (int c = 0; c < d; ++c) {
                const size_t i = static_cast<size_t>(j) * d + c;
                if (bits == 0 || j >= m) {  // stored as is: exact
                  ASSERT_EQ(got_k[i], want_k[i]) << "j " << j << " c " << c;
                  ASSERT_EQ(got_v[i], want_v[i]) << "j " << j << " c " << c;
                  continue;
                }
                if (kept_k[c]) {
                  ASSERT_NEAR(got_k[i], want_k[i], kbound) << "j " << j << " c " << c;
                } else {
                  ASSERT_EQ(got_k[i], 0.0f);
                }
                if (kept_v[c]) {
                  ASSERT_NEAR(got_v[i], want_v[i], vbound) << "j " << j << " c " << c;
                } else {
                  ASSERT_EQ(got_v[i], 0.0f);
                }
              }
            }
          }
          ++cases;
        }
      }
    }
  }
  EXPECT_EQ(cases, 84);
}

// Every block pointer is 16-byte aligned relative to the blob start.
TEST(CompactTest, BlocksAreAligned) {
  std::mt19937 rng(3);
  for (int bits : {0, 2, 4, 8}) {
    const PackLayerData layer = MakePackLayer(3, 37, 24, DType::kF16, Layout::kHND, 11);
    const TokenSelection tokens = RandomTokens(3, 37, 13, &rng);
    const ChannelSelection channels = RandomChannels(3, 24, 7, 5, &rng);
    absl::StatusOr<CompactLayer> packed =
        PackLayer(layer.input(), tokens, channels, Spec(bits, 3, 5));
    ASSERT_TRUE(packed.ok());
    absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
    ASSERT_TRUE(view.ok()) << view.status();
    for (int h = 0; h < 3; ++h) {
      const CompactHead hd = view->head(h);
      const void* ptrs[] = {hd.positions,   hd.key_idx,     hd.value_idx,  hd.key_old,
                            hd.key_scale,   hd.key_zero,    hd.key_codes,  hd.key_recent,
                            hd.value_old,   hd.value_scale, hd.value_zero, hd.value_codes,
                            hd.value_recent};
      for (const void* p : ptrs) {
        if (p == nullptr) continue;
        EXPECT_EQ((static_cast<const uint8_t*>(p) - packed->bytes.data()) % 16, 0);
      }
      EXPECT_EQ(view->desc(h).offset % 16, 0u);
      EXPECT_EQ(hd.key_old == nullptr, bits > 0);
      EXPECT_EQ(hd.key_codes == nullptr, bits == 0);
    }
  }
}

// A tiny case checked byte by byte: H=1, S=4, D=8, f32, keep {0,2,3}, key channels {1,3,5,7},
// all value channels, r = 1 (pruning is on), no quantization.
TEST(CompactTest, TinyHandCaseBytes) {
  PackLayerData layer = MakePackLayer(1, 4, 8, DType::kF32, Layout::kHND, 1);
  for (int t = 0; t < 4; ++t) {
    for (int c = 0; c < 8; ++c) {
      const float kv = 10.0f * t + c, vv = -(10.0f * t + c);
      reinterpret_cast<float*>(layer.k.data())[t * 8 + c] = kv;
      reinterpret_cast<float*>(layer.v.data())[t * 8 + c] = vv;
    }
  }
  TokenSelection tokens{1, 3, {0, 2, 3}, {}};
  ChannelSelection channels;
  channels.key_channels = 4;
  channels.value_channels = 8;
  channels.key_idx = {1, 3, 5, 7};
  channels.value_idx = {0, 1, 2, 3, 4, 5, 6, 7};
  CompressionSpec spec = Spec(0, 1);
  spec.eviction.policy = EvictionPolicy::kH2O;
  spec.channels.key_policy = ChannelPolicy::kThink;
  LayerInput in = layer.input();
  in.layer_index = 5;
  absl::StatusOr<CompactLayer> packed = PackLayer(in, tokens, channels, spec);
  ASSERT_TRUE(packed.ok()) << packed.status();
  const ByteVector& b = packed->bytes;
  // Section: positions 12 -> 16, key_idx 16 -> 32, value_idx 32 -> 64, key_old 2x4 f32 = 32 ->
  // 96, key_recent 1x8 f32 = 32 -> 128, value_old 2x8 f32 = 64 -> 192, value_recent 32 -> 224.
  ASSERT_EQ(b.size(), 64u + 32u + 224u);
  EXPECT_EQ(At<uint32_t>(b, 0), 0x4c43564bu);
  EXPECT_EQ(std::memcmp(b.data(), "KVCL", 4), 0);
  EXPECT_EQ(At<uint16_t>(b, 4), 1);
  EXPECT_EQ(b[6], 0);                // f32
  EXPECT_EQ(b[7], 0);                // bits
  EXPECT_EQ(At<int32_t>(b, 8), 5);   // layer_index
  EXPECT_EQ(At<int32_t>(b, 12), 1);  // heads
  EXPECT_EQ(At<int32_t>(b, 16), 8);  // D
  EXPECT_EQ(At<int32_t>(b, 20), 4);  // S
  EXPECT_EQ(At<int32_t>(b, 24), 0);  // G (unused without quantization)
  EXPECT_EQ(b[28], static_cast<uint8_t>(EvictionPolicy::kH2O));
  EXPECT_EQ(b[29], static_cast<uint8_t>(ChannelPolicy::kThink));
  EXPECT_EQ(At<int32_t>(b, 64), 3);  // n_kept
  EXPECT_EQ(At<int32_t>(b, 68), 1);  // n_recent
  EXPECT_EQ(At<int32_t>(b, 72), 4);  // T_k
  EXPECT_EQ(At<int32_t>(b, 76), 8);  // T_v
  EXPECT_EQ(At<uint64_t>(b, 80), 96u);
  EXPECT_EQ(At<uint64_t>(b, 88), 224u);
  const size_t sec = 96;
  EXPECT_EQ(At<int32_t>(b, sec + 0), 0);
  EXPECT_EQ(At<int32_t>(b, sec + 4), 2);
  EXPECT_EQ(At<int32_t>(b, sec + 8), 3);
  EXPECT_EQ(At<int32_t>(b, sec + 12), 0);  // padding is zero
  for (int i = 0; i < 4; ++i) EXPECT_EQ(At<int32_t>(b, sec + 16 + 4 * i), 2 * i + 1);
  for (int i = 0; i < 8; ++i) EXPECT_EQ(At<int32_t>(b, sec + 32 + 4 * i), i);
  // key_old: rows of tokens 0 and 2, channels 1,3,5,7.
  for (int j = 0; j < 2; ++j) {
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(At<float>(b, sec + 64 + 4 * (4 * j + i)), 10.0f * (2 * j) + (2 * i + 1));
    }
  }
  for (int c = 0; c < 8; ++c) EXPECT_EQ(At<float>(b, sec + 96 + 4 * c), 30.0f + c);  // recent k
  for (int j = 0; j < 2; ++j) {
    for (int c = 0; c < 8; ++c) {
      EXPECT_EQ(At<float>(b, sec + 128 + 4 * (8 * j + c)), -(10.0f * (2 * j) + c));
    }
  }
  for (int c = 0; c < 8; ++c) EXPECT_EQ(At<float>(b, sec + 192 + 4 * c), -(30.0f + c));
}

// A quantized hand case: one head, 3 old tokens, 4-bit keys with G=2, exact codes and params.
TEST(CompactTest, TinyQuantizedBytes) {
  PackLayerData layer = MakePackLayer(1, 3, 8, DType::kF32, Layout::kHND, 1);
  float* k = reinterpret_cast<float*>(layer.k.data());
  float* v = reinterpret_cast<float*>(layer.v.data());
  for (int t = 0; t < 3; ++t) {
    for (int c = 0; c < 8; ++c) {
      k[t * 8 + c] = t == 0 ? 0.0f : (t == 1 ? 15.0f : static_cast<float>(c));
      v[t * 8 + c] = static_cast<float>(c);  // values per token: range 0..7 in one group of 8
    }
  }
  TokenSelection tokens{1, 3, {0, 1, 2}, {}};
  ChannelSelection channels{8, 8, {}, {}};  // identity channels given as empty lists
  absl::StatusOr<CompactLayer> packed = PackLayer(layer.input(), tokens, channels, Spec(4, 0, 2));
  ASSERT_TRUE(packed.ok()) << packed.status();
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
  ASSERT_TRUE(view.ok()) << view.status();
  const CompactHead hd = view->head(0);
  ASSERT_EQ(hd.n_recent, 0);
  // Key groups: tokens {0,1} (min 0, max 15: scale 1, zero 0) and {2} (scale 0, zero c).
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(hd.key_scale[c], 1.0f);
    EXPECT_EQ(hd.key_zero[c], 0.0f);
    EXPECT_EQ(hd.key_scale[8 + c], 0.0f);
    EXPECT_EQ(hd.key_zero[8 + c], static_cast<float>(c));
  }
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(hd.key_codes[i], 0x00);      // token 0: all codes 0
    EXPECT_EQ(hd.key_codes[4 + i], 0xff);  // token 1: all codes 15
    EXPECT_EQ(hd.key_codes[8 + i], 0x00);  // token 2: scale 0 -> code 0
  }
  // Values, groups of 2 channels: (0,1) scale 1/15 zero 0 codes 0,15; (2,3) zero 2 ...
  for (int j = 0; j < 3; ++j) {
    for (int gi = 0; gi < 4; ++gi) {
      EXPECT_FLOAT_EQ(hd.value_scale[j * 4 + gi], 1.0f / 15.0f);
      EXPECT_EQ(hd.value_zero[j * 4 + gi], 2.0f * gi);
      EXPECT_EQ(hd.value_codes[j * 4 + gi], 0xf0);  // codes 0 (low nibble) and 15 (high)
    }
  }
  std::vector<float> kf(24), vf(24);
  UnpackHeadToFloat(*view, 0, kf.data(), vf.data());
  for (int t = 0; t < 3; ++t) {
    for (int c = 0; c < 8; ++c) {
      EXPECT_FLOAT_EQ(kf[t * 8 + c], k[t * 8 + c]);
      EXPECT_NEAR(vf[t * 8 + c], v[t * 8 + c], 1e-6);
    }
  }
}

// NHD input gives the same blob as the same data in HND.
TEST(CompactTest, NhdMatchesHnd) {
  std::mt19937 rng(5);
  for (int bits : {0, 4}) {
    const PackLayerData hnd = MakePackLayer(4, 50, 32, DType::kBF16, Layout::kHND, 9);
    const PackLayerData nhd = MakePackLayer(4, 50, 32, DType::kBF16, Layout::kNHD, 9);
    const TokenSelection tokens = RandomTokens(4, 50, 20, &rng);
    const ChannelSelection channels = RandomChannels(4, 32, 16, 24, &rng);
    absl::StatusOr<CompactLayer> a = PackLayer(hnd.input(), tokens, channels, Spec(bits, 4));
    absl::StatusOr<CompactLayer> b = PackLayer(nhd.input(), tokens, channels, Spec(bits, 4));
    ASSERT_TRUE(a.ok() && b.ok());
    EXPECT_EQ(a->bytes, b->bytes);
  }
}

TEST(CompactTest, RecentOnlyWhenReduced) {
  std::mt19937 rng(1);
  const PackLayerData layer = MakePackLayer(2, 40, 16, DType::kF16, Layout::kHND, 2);
  const TokenSelection tokens = RandomTokens(2, 40, 10, &rng);
  struct R {
    int tk, tv, bits, recent, want;
  };
  for (const R& r : {R{16, 16, 0, 32, 0}, R{8, 16, 0, 32, 10}, R{16, 8, 0, 4, 4},
                     R{16, 16, 2, 3, 3}, R{8, 8, 8, 0, 0}}) {
    const ChannelSelection channels = RandomChannels(2, 16, r.tk, r.tv, &rng);
    absl::StatusOr<CompactLayer> p =
        PackLayer(layer.input(), tokens, channels, Spec(r.bits, r.recent));
    ASSERT_TRUE(p.ok());
    absl::StatusOr<CompactLayerView> v = CompactLayerView::Parse(p->bytes);
    ASSERT_TRUE(v.ok());
    EXPECT_EQ(v->desc(1).n_recent, r.want) << r.tk << " " << r.tv << " " << r.bits;
  }
}

// DENSE export: kept rows in the original dtype, pruned channels zero, bit-exact without
// quantization, the dequantized values (rounded to dtype) with it. Channel sets: both tensors
// pruned, nothing pruned (whole rows copied), keys whole and values pruned.
TEST(CompactTest, ExportDense) {
  std::mt19937 rng(21);
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int bits : {0, 8, 4, 2}) {
      for (const auto& [tk, tv] : {std::pair{9, 12}, {16, 16}, {16, 10}}) {
        SCOPED_TRACE(testing::Message() << "dtype " << static_cast<int>(dt) << " bits " << bits
                                        << " channels " << tk << "/" << tv);
        const PackLayerData layer = MakePackLayer(3, 64, 16, dt, Layout::kHND, 4);
        const TokenSelection tokens = RandomTokens(3, 64, 30, &rng);
        const ChannelSelection channels = RandomChannels(3, 16, tk, tv, &rng);
        absl::StatusOr<CompactLayer> p = PackLayer(layer.input(), tokens, channels, Spec(bits, 5));
        ASSERT_TRUE(p.ok());
        absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(p->bytes);
        ASSERT_TRUE(view.ok());
        absl::StatusOr<DenseLayer> dense = ExportDense(*view);
        ASSERT_TRUE(dense.ok()) << dense.status();
        EXPECT_EQ(dense->num_kv_heads, 3);
        EXPECT_EQ(dense->n_kept, 30);
        EXPECT_EQ(dense->head_dim, 16);
        EXPECT_EQ(dense->seq_len, 64);
        EXPECT_EQ(dense->dtype, dt);
        ASSERT_EQ(dense->k.size(), 3u * 30 * 16 * DTypeSize(dt));
        EXPECT_EQ(dense->positions, tokens.positions);
        std::vector<float> uk(30 * 16), uv(30 * 16), wk, wv;
        for (int h = 0; h < 3; ++h) {
          ExpectedHeadRows(layer, tokens, channels, h, 5, &wk, &wv);
          UnpackHeadToFloat(*view, h, uk.data(), uv.data());
          for (int i = 0; i < 30 * 16; ++i) {
            const float gk = LoadAsFloat(dense->k.data(), dt, h * 480 + i);
            const float gv = LoadAsFloat(dense->v.data(), dt, h * 480 + i);
            if (bits == 0) {
              ASSERT_EQ(gk, wk[i]) << i;
              ASSERT_EQ(gv, wv[i]) << i;
            } else {
              // The dequantized float, rounded once to the dtype.
              float rk = 0, rv = 0;
              StoreFromFloat(&rk, dt, 0, uk[i]);
              StoreFromFloat(&rv, dt, 0, uv[i]);
              ASSERT_EQ(gk, LoadAsFloat(&rk, dt, 0)) << i;
              ASSERT_EQ(gv, LoadAsFloat(&rv, dt, 0)) << i;
              if (wk[i] == 0.0f) {
                ASSERT_EQ(gk, 0.0f);  // pruned stays zero
              }
            }
          }
        }
      }
    }
  }
}

// The concatenated runs of a DenseRuns part.
std::vector<uint8_t> Joined(const std::vector<absl::Span<const uint8_t>>& runs) {
  std::vector<uint8_t> out;
  for (const auto& r : runs) out.insert(out.end(), r.begin(), r.end());
  return out;
}

// DENSE without a copy: where DenseRunsOf accepts a layer (no quantization, no pruning, every
// head the same count) its runs are ExportDense's bytes exactly, and they lie in the blob; it
// refuses quantized, pruned and ragged layers. A layer kept whole is one K and one V run a head.
// DenseValueRunsOf gives ExportDense's V and positions as runs for layers that prune key channels
// only, and ExportDenseKeys is ExportDense's keys for every layer.
// ExportDense writes every byte of the rows it returns: pruned channels come back +0 even when
// the buffer it writes into is reused and dirty (the process-wide pool hands back the previous
// export's buffers, filled with 0xAB first). Channel sets with whole 16-byte chunks pruned, on
// the shuffle path (the CPU's best level) and the scalar one (portable); fp16 and fp32; a head
// dimension whose rows are not whole chunks for fp16 (the scalar path at every level).
TEST(CompactTest, ExportDenseWritesEveryByteOfReusedBuffers) {
  const uint64_t cap_before = LargeBuffers().cap_bytes();
  LargeBuffers().set_cap(uint64_t{64} << 20);
  std::mt19937 rng(29);
  for (const CpuIsa cap : {kBestCpuIsa, CpuIsa::kPortable}) {
    const testing_isa::ScopedIsaCap scoped(cap);
    for (const DType dt : {DType::kF16, DType::kF32}) {
      for (const int d : {128, 132}) {
        SCOPED_TRACE(testing::Message() << DTypeName(dt) << " d " << d << " " << CpuIsaName(cap));
        const int heads = 8, seq = 1100, kept = 1024, recent = 3;
        const PackLayerData layer = MakePackLayer(heads, seq, d, dt, Layout::kHND, 6);
        const TokenSelection tokens = RandomTokens(heads, seq, kept, &rng);
        // Keys: a few runs with whole chunks pruned between them; values: every third channel.
        ChannelSelection channels{0, 0, {}, {}};
        std::vector<int32_t> kc, vc;
        for (int c = 0; c < d; ++c) {
          if (c < 8 || (c >= 16 && c < 21) || c == 40 || c == 77 || c >= d - 20) kc.push_back(c);
          if (c % 3 == 1) vc.push_back(c);
        }
        channels.key_channels = static_cast<int>(kc.size());
        channels.value_channels = static_cast<int>(vc.size());
        for (int h = 0; h < heads; ++h) {
          channels.key_idx.insert(channels.key_idx.end(), kc.begin(), kc.end());
          channels.value_idx.insert(channels.value_idx.end(), vc.begin(), vc.end());
        }
        absl::StatusOr<CompactLayer> p =
            PackLayer(layer.input(), tokens, channels, Spec(0, recent));
        ASSERT_TRUE(p.ok()) << p.status();
        absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(p->bytes);
        ASSERT_TRUE(view.ok());
        {
          absl::StatusOr<DenseLayer> first = ExportDense(*view);
          ASSERT_TRUE(first.ok());
          ASSERT_GE(first->k.size(), BufferPool::kMinPooledBytes);  // pooled, so reused below
          std::memset(first->k.data(), 0xab, first->k.size());
          std::memset(first->v.data(), 0xab, first->v.size());
        }
        const uint64_t reused_before = LargeBuffers().reused();
        absl::StatusOr<DenseLayer> dense = ExportDense(*view);
        ASSERT_TRUE(dense.ok());
        // K and V both in memory written before (none freshly mapped, i.e. zero).
        EXPECT_EQ(LargeBuffers().reused() - reused_before, 2u);
        std::vector<float> wk, wv;
        for (int h = 0; h < heads; ++h) {
          ExpectedHeadRows(layer, tokens, channels, h, recent, &wk, &wv);
          for (size_t i = 0; i < wk.size(); ++i) {
            const size_t at = static_cast<size_t>(h) * kept * d + i;
            ASSERT_EQ(LoadAsFloat(dense->k.data(), dt, at), wk[i]) << "key element " << i;
            ASSERT_EQ(LoadAsFloat(dense->v.data(), dt, at), wv[i]) << "value element " << i;
          }
        }
      }
    }
  }
  LargeBuffers().set_cap(cap_before);
}

// The piece-by-piece export (DenseExporter, what kvcd sends a DENSE layer from while it writes
// the rest) finishes K head by head, then V head by head, each range equal to the one-shot
// export's bytes and never written again: every dtype, quantized or not, key or value channels
// pruned, a ragged layer (padding rows), the keys alone too.
TEST(CompactTest, ExportersFinishPrefixesPieceByPiece) {
  std::mt19937 rng(31);
  int checked = 0;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int bits : {0, 4}) {
      for (const auto& [tk, tv] : {std::pair{16, 16}, {9, 16}, {16, 10}}) {
        SCOPED_TRACE(testing::Message() << DTypeName(dt) << " bits " << bits << " channels "
                                        << tk << "/" << tv);
        const PackLayerData layer = MakePackLayer(3, 64, 16, dt, Layout::kHND, 4);
        TokenSelection tokens = RandomTokens(3, 64, 30, &rng);
        if (tk == 9) {  // ragged: head 1 keeps 20 of its 30 tokens
          std::vector<int32_t> positions;
          for (int h = 0; h < 3; ++h) {
            const auto first = tokens.positions.begin() + h * 30;
            positions.insert(positions.end(), first, first + (h == 1 ? 20 : 30));
          }
          tokens.positions = positions;
          tokens.counts = {30, 20, 30};
        }
        absl::StatusOr<CompactLayer> p = PackLayer(
            layer.input(), tokens, RandomChannels(3, 16, tk, tv, &rng), Spec(bits, 5));
        ASSERT_TRUE(p.ok()) << p.status();
        absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(p->bytes);
        ASSERT_TRUE(view.ok());
        for (const bool values : {true, false}) {
          absl::StatusOr<DenseLayer> want = values ? ExportDense(*view) : ExportDenseKeys(*view);
          absl::StatusOr<DenseExporter> ex = MakeDenseExporter(*view, values);
          ASSERT_TRUE(want.ok() && ex.ok());
          EXPECT_EQ(ex->pieces(), values ? 6 : 3);
          testing_pack::ExpectPiecesFinishPrefixes(*std::move(ex), *want);
          ++checked;
        }
      }
    }
  }
  EXPECT_EQ(checked, 36);
}

TEST(CompactTest, DenseRunsAreExportDenseInPlace) {
  std::mt19937 rng(23);
  int accepted = 0, values_accepted = 0;
  for (DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (int bits : {0, 4}) {
      for (const auto& [tk, tv] : {std::pair{16, 16}, {16, 10}, {9, 16}}) {
        for (int budget : {30, 64}) {
          SCOPED_TRACE(testing::Message() << "dtype " << static_cast<int>(dt) << " bits " << bits
                                          << " channels " << tk << "/" << tv << " kept " << budget);
          const PackLayerData layer = MakePackLayer(3, 64, 16, dt, Layout::kHND, 4);
          const TokenSelection tokens = RandomTokens(3, 64, budget, &rng);
          const ChannelSelection channels = RandomChannels(3, 16, tk, tv, &rng);
          absl::StatusOr<CompactLayer> p =
              PackLayer(layer.input(), tokens, channels, Spec(bits, 5));
          ASSERT_TRUE(p.ok());
          absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(p->bytes);
          ASSERT_TRUE(view.ok());
          absl::StatusOr<DenseLayer> dense = ExportDense(*view);
          ASSERT_TRUE(dense.ok());
          std::vector<uint8_t> pos(dense->positions.size() * sizeof(int32_t));
          std::memcpy(pos.data(), dense->positions.data(), pos.size());
          // The keys alone, for every layer: ExportDense's bytes, nothing else.
          absl::StatusOr<DenseLayer> keys = ExportDenseKeys(*view);
          ASSERT_TRUE(keys.ok());
          EXPECT_EQ(keys->k, dense->k);
          EXPECT_EQ(keys->n_kept, dense->n_kept);
          EXPECT_EQ(keys->counts, dense->counts);
          EXPECT_TRUE(keys->v.empty() && keys->positions.empty());
          // Values in place: refused only for quantized layers and pruned values.
          DenseRuns value_runs;
          const bool values_in_place = DenseValueRunsOf(*view, &value_runs);
          ASSERT_EQ(values_in_place, bits == 0 && tv == 16);
          EXPECT_TRUE(value_runs.k.empty());
          if (values_in_place) {
            ++values_accepted;
            EXPECT_EQ(Joined(value_runs.v),
                      std::vector<uint8_t>(dense->v.begin(), dense->v.end()));
            EXPECT_EQ(Joined(value_runs.positions), pos);
          } else {
            EXPECT_TRUE(value_runs.v.empty() && value_runs.positions.empty());
          }
          DenseRuns runs;
          const bool in_place = DenseRunsOf(*view, &runs);
          ASSERT_EQ(in_place, bits == 0 && tk == 16 && tv == 16);
          if (!in_place) {
            EXPECT_TRUE(runs.k.empty() && runs.v.empty() && runs.positions.empty());
            continue;
          }
          ++accepted;
          EXPECT_EQ(Joined(runs.k), std::vector<uint8_t>(dense->k.begin(), dense->k.end()));
          EXPECT_EQ(Joined(runs.v), std::vector<uint8_t>(dense->v.begin(), dense->v.end()));
          EXPECT_EQ(Joined(runs.positions), pos);
          for (const auto* part : {&runs.k, &runs.v, &runs.positions}) {
            for (const auto& r : *part) {
              EXPECT_GE(r.data(), p->bytes.data());
              EXPECT_LE(r.data() + r.size(), p->bytes.data() + p->bytes.size());
            }
          }
          // Rows are 16-byte multiples here, so a head's recent rows follow its old ones.
          EXPECT_EQ(runs.k.size(), 3u);
          EXPECT_EQ(runs.v.size(), 3u);
        }
      }
    }
  }
  EXPECT_EQ(accepted, 6);
  EXPECT_EQ(values_accepted, 12);
  // Ragged heads (head-adaptive budgets), which ExportDense pads to the largest count: the
  // padding comes as spans of constant bytes outside the blob (zero rows, positions -1), longer
  // ones in several spans. Here head 1 keeps 4 of 6 tokens, and a second layer of 3,000-token
  // heads keeps 2,900 in one and 100 in the other (2,800 rows of padding: more than one span).
  const PackLayerData layer = MakePackLayer(2, 40, 16, DType::kF16, Layout::kHND, 4);
  TokenSelection ragged;
  ragged.num_kv_heads = 2;
  ragged.budget = 6;
  ragged.counts = {6, 4};
  ragged.positions = {1, 5, 9, 20, 30, 39, 2, 3, 38, 39};
  absl::StatusOr<CompactLayer> p =
      PackLayer(layer.input(), ragged, RandomChannels(2, 16, 16, 16, &rng), Spec(0, 2));
  ASSERT_TRUE(p.ok()) << p.status();
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(p->bytes);
  ASSERT_TRUE(view.ok());
  const auto check_ragged = [](const CompactLayerView& view, const ByteVector& blob,
                               size_t min_padding_spans) {
    DenseRuns runs, value_runs;
    ASSERT_TRUE(DenseRunsOf(view, &runs));
    ASSERT_TRUE(DenseValueRunsOf(view, &value_runs));
    absl::StatusOr<DenseLayer> dense = ExportDense(view);
    absl::StatusOr<DenseLayer> keys = ExportDenseKeys(view);
    ASSERT_TRUE(dense.ok() && keys.ok());
    EXPECT_EQ(keys->k, dense->k);
    std::vector<uint8_t> pos(dense->positions.size() * sizeof(int32_t));
    std::memcpy(pos.data(), dense->positions.data(), pos.size());
    EXPECT_EQ(Joined(runs.k), std::vector<uint8_t>(dense->k.begin(), dense->k.end()));
    EXPECT_EQ(Joined(runs.v), std::vector<uint8_t>(dense->v.begin(), dense->v.end()));
    EXPECT_EQ(Joined(runs.positions), pos);
    EXPECT_EQ(Joined(value_runs.v), Joined(runs.v));
    EXPECT_EQ(Joined(value_runs.positions), pos);
    size_t padding = 0;
    for (const auto* part : {&runs.k, &runs.v, &runs.positions}) {
      for (const auto& r : *part) {
        const bool in_blob =
            r.data() >= blob.data() && r.data() + r.size() <= blob.data() + blob.size();
        EXPECT_NE(in_blob, IsDensePadding(r));
        padding += IsDensePadding(r);
      }
    }
    EXPECT_GE(padding, min_padding_spans);
  };
  check_ragged(*view, p->bytes, 3);  // K, V and positions padded once each
  const PackLayerData large = MakePackLayer(2, 3000, 128, DType::kF32, Layout::kHND, 4);
  TokenSelection uneven;
  uneven.num_kv_heads = 2;
  uneven.budget = 2900;
  uneven.counts = {2900, 100};
  for (int h = 0; h < 2; ++h) {
    for (int t = 0; t < uneven.counts[h]; ++t) uneven.positions.push_back(t * 3000 / 2900);
  }
  absl::StatusOr<CompactLayer> q =
      PackLayer(large.input(), uneven, RandomChannels(2, 128, 128, 128, &rng), Spec(0, 2));
  ASSERT_TRUE(q.ok()) << q.status();
  absl::StatusOr<CompactLayerView> large_view = CompactLayerView::Parse(q->bytes);
  ASSERT_TRUE(large_view.ok());
  // 2,800 fp32 rows of 128 are 1.4 MiB of padding in K and in V: two spans each.
  check_ragged(*large_view, q->bytes, 5);
}

// A valid 2-head, 4-bit, pruned blob to corrupt.
class CompactParseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 rng(17);
    layer_ = MakePackLayer(2, 40, 16, DType::kF16, Layout::kHND, 8);
    tokens_ = RandomTokens(2, 40, 12, &rng);
    channels_ = RandomChannels(2, 16, 8, 12, &rng);
    absl::StatusOr<CompactLayer> p = PackLayer(layer_.input(), tokens_, channels_, Spec(4, 3, 4));
    ASSERT_TRUE(p.ok());
    blob_.assign(p->bytes.begin(), p->bytes.end());
    ASSERT_TRUE(CompactLayerView::Parse(blob_).ok());
  }
  template <typename T>
  void Put(size_t off, T v) {
    std::memcpy(blob_.data() + off, &v, sizeof(T));
  }
  std::string Error() {
    absl::StatusOr<CompactLayerView> v = CompactLayerView::Parse(blob_);
    EXPECT_FALSE(v.ok());
    if (v.ok()) return "";
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(v.status().message());
  }
  size_t Section(int h) { return At<uint64_t>(blob_, 64 + 32 * h + 16); }

  PackLayerData layer_;
  TokenSelection tokens_;
  ChannelSelection channels_;
  std::vector<uint8_t> blob_;
};

TEST_F(CompactParseTest, EveryTruncationIsRejected) {
  for (size_t n = 0; n < blob_.size(); ++n) {
    std::vector<uint8_t> cut(blob_.begin(), blob_.begin() + n);
    EXPECT_FALSE(CompactLayerView::Parse(cut).ok()) << n;
  }
  blob_.resize(10);
  EXPECT_THAT(Error(), HasSubstr("truncated"));
}

TEST_F(CompactParseTest, LastSectionPastEnd) {
  blob_.resize(blob_.size() - 16);
  EXPECT_THAT(Error(), HasSubstr("runs past"));
}

TEST_F(CompactParseTest, TrailingBytes) {
  blob_.resize(blob_.size() + 16);
  EXPECT_THAT(Error(), HasSubstr("head sections end at"));
}

TEST_F(CompactParseTest, BadMagic) {
  blob_[0] ^= 1;
  EXPECT_THAT(Error(), HasSubstr("magic"));
}

TEST_F(CompactParseTest, BadVersion) {
  Put<uint16_t>(4, 3);
  EXPECT_THAT(Error(), HasSubstr("version 3"));
}

// The values' own bits: only in version 2, and only where they differ from the keys'.
TEST_F(CompactParseTest, ValueBits) {
  blob_[30] = 2;  // a version 1 blob keeps the byte zero
  EXPECT_THAT(Error(), HasSubstr("value_quant_bits 2 in a version 1 blob"));
  Put<uint16_t>(4, 2);
  for (int bad : {0, 3, 4, 16}) {  // 4: the keys' bits
    blob_[30] = static_cast<uint8_t>(bad);
    EXPECT_THAT(Error(), HasSubstr(absl::StrCat("value_quant_bits ", bad, " with quant_bits 4")));
  }
  // A version 1 blob relabelled with other value bits: its sections no longer match the counts.
  blob_[30] = 8;
  EXPECT_THAT(Error(), HasSubstr("implied by its counts"));
  blob_[7] = 0;  // values quantized, keys not
  EXPECT_THAT(Error(), HasSubstr("value_quant_bits 8 with quant_bits 0"));
}

// The same bits for both written the old way, byte for byte (value_bits 0 or equal).
TEST_F(CompactParseTest, EqualWidthsAreVersionOne) {
  absl::StatusOr<CompactLayer> p =
      PackLayer(layer_.input(), tokens_, channels_, Spec(4, 3, 4, /*value_bits=*/4));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(std::vector<uint8_t>(p->bytes.begin(), p->bytes.end()), blob_);
}

TEST_F(CompactParseTest, BadDtypeAndBits) {
  blob_[6] = 3;
  EXPECT_THAT(Error(), HasSubstr("dtype 3"));
  blob_[6] = 1;
  blob_[7] = 3;
  EXPECT_THAT(Error(), HasSubstr("quant_bits 3"));
  blob_[7] = 4;
  Put<int32_t>(24, 0);
  EXPECT_THAT(Error(), HasSubstr("quant_group"));
}

TEST_F(CompactParseTest, BadShapeFields) {
  Put<int32_t>(16, 300);
  EXPECT_THAT(Error(), HasSubstr("head_dim 300"));
  Put<int32_t>(16, 16);
  Put<int32_t>(12, 1 << 30);
  EXPECT_THAT(Error(), HasSubstr("num_kv_heads"));
  Put<int32_t>(12, 0);
  EXPECT_THAT(Error(), HasSubstr("num_kv_heads"));
  Put<int32_t>(12, 2);
  Put<int32_t>(20, 0);
  EXPECT_THAT(Error(), HasSubstr("seq_len"));
}

TEST_F(CompactParseTest, OffsetOutOfRange) {
  Put<uint64_t>(64 + 32 + 16, uint64_t{1} << 40);
  EXPECT_THAT(Error(), HasSubstr("head 1 offset"));
  Put<uint64_t>(64 + 32 + 16, Section(0));  // overlapping head 0
  EXPECT_THAT(Error(), HasSubstr("head 1 offset"));
}

TEST_F(CompactParseTest, SizeInconsistentWithCounts) {
  Put<uint64_t>(64 + 24, At<uint64_t>(blob_, 64 + 24) + 16);
  EXPECT_THAT(Error(), HasSubstr("head 0 size"));
}

TEST_F(CompactParseTest, CountsOutOfRange) {
  Put<int32_t>(64 + 4, 13);  // n_recent > n_kept
  EXPECT_THAT(Error(), HasSubstr("head 0 n_recent 13"));
  Put<int32_t>(64 + 4, 3);
  Put<int32_t>(64 + 32 + 8, 17);  // T_k > D
  EXPECT_THAT(Error(), HasSubstr("head 1 key_channels 17"));
  Put<int32_t>(64 + 32 + 8, 8);
  Put<int32_t>(64, 41);  // n_kept > S
  EXPECT_THAT(Error(), HasSubstr("head 0 n_kept 41"));
}

TEST_F(CompactParseTest, UnsortedPositions) {
  const size_t p = Section(1);
  const int32_t a = At<int32_t>(blob_, p), b = At<int32_t>(blob_, p + 4);
  Put<int32_t>(p, b);
  Put<int32_t>(p + 4, a);
  EXPECT_THAT(Error(), HasSubstr("head 1 positions[1]"));
  EXPECT_THAT(Error(), HasSubstr("ascending"));
}

TEST_F(CompactParseTest, PositionBeyondSeqLen) {
  Put<int32_t>(Section(0) + 4 * 11, 40);
  EXPECT_THAT(Error(), HasSubstr("head 0 positions[11] = 40 is outside [0, seq_len 40)"));
  Put<int32_t>(Section(0), -1);
  EXPECT_THAT(Error(), HasSubstr("positions[0] = -1"));
}

TEST_F(CompactParseTest, ChannelIndexBeyondHeadDim) {
  // key_idx follows the 12 positions (48 bytes, already 16-aligned).
  Put<int32_t>(Section(0) + 48 + 4 * 7, 16);
  EXPECT_THAT(Error(), HasSubstr("head 0 key_idx[7] = 16 is outside [0, head_dim 16)"));
  Put<int32_t>(Section(0) + 48 + 4 * 7, 15);
  ASSERT_TRUE(CompactLayerView::Parse(blob_).ok());
  // value_idx follows the 8 key channels (32 bytes).
  Put<int32_t>(Section(0) + 80 + 4, At<int32_t>(blob_, Section(0) + 80));
  EXPECT_THAT(Error(), HasSubstr("head 0 value_idx[1]"));
}

TEST_F(CompactParseTest, UnalignedBuffer) {
  std::vector<uint8_t> shifted(blob_.size() + 1);
  std::memcpy(shifted.data() + 1, blob_.data(), blob_.size());
  absl::StatusOr<CompactLayerView> v =
      CompactLayerView::Parse(absl::MakeConstSpan(shifted.data() + 1, blob_.size()));
  ASSERT_FALSE(v.ok());
  EXPECT_THAT(std::string(v.status().message()), HasSubstr("aligned"));
}

// Random corruption of the header, descriptors and index lists: whatever Parse accepts still
// satisfies the contract (checked here), and reading it stays in bounds.
TEST_F(CompactParseTest, RandomCorruption) {
  std::mt19937 rng(99);
  const std::vector<uint8_t> good = blob_;
  const size_t span = Section(1) + 128;
  int rejected = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    blob_ = good;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) blob_[rng() % span] ^= static_cast<uint8_t>(1u << (rng() % 8));
    absl::StatusOr<CompactLayerView> v = CompactLayerView::Parse(blob_);
    if (!v.ok()) {
      ++rejected;
      continue;
    }
    for (int h = 0; h < v->num_kv_heads(); ++h) {
      const CompactHead hd = v->head(h);
      for (int j = 0; j < hd.n_kept; ++j) {
        ASSERT_LT(hd.positions[j], v->seq_len());
        if (j > 0) {
          ASSERT_GT(hd.positions[j], hd.positions[j - 1]);
        }
      }
      for (int c = 0; c < hd.key_channels; ++c) ASSERT_LT(hd.key_idx[c], v->head_dim());
      std::vector<float> k(static_cast<size_t>(hd.n_kept) * v->head_dim());
      std::vector<float> val(k.size());
      UnpackHeadToFloat(*v, h, k.data(), val.data());
    }
  }
  EXPECT_GT(rejected, 1000);
}

TEST(CompactPackTest, RejectsBadInputs) {
  std::mt19937 rng(2);
  const PackLayerData layer = MakePackLayer(2, 20, 16, DType::kF16, Layout::kHND, 3);
  const TokenSelection tokens = RandomTokens(2, 20, 6, &rng);
  const ChannelSelection channels = RandomChannels(2, 16, 8, 16, &rng);
  auto err = [&](LayerInput in, TokenSelection t, ChannelSelection c, CompressionSpec s) {
    absl::StatusOr<CompactLayer> p = PackLayer(in, t, c, s);
    EXPECT_FALSE(p.ok());
    if (p.ok()) return std::string();
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    return std::string(p.status().message());
  };
  const CompressionSpec spec = Spec(4, 2);
  ASSERT_TRUE(PackLayer(layer.input(), tokens, channels, spec).ok());
  LayerInput in = layer.input();
  in.k = nullptr;
  EXPECT_THAT(err(in, tokens, channels, spec), HasSubstr("in.k: null"));
  in = layer.input();
  in.shape.head_dim = 4;
  EXPECT_THAT(err(in, tokens, channels, spec), HasSubstr("in.shape.head_dim: 4"));
  TokenSelection t = tokens;
  t.num_kv_heads = 3;
  EXPECT_THAT(err(layer.input(), t, channels, spec), HasSubstr("tokens.num_kv_heads: 3"));
  t = tokens;
  t.budget = 21;
  EXPECT_THAT(err(layer.input(), t, channels, spec), HasSubstr("tokens.budget: 21"));
  t = tokens;
  t.positions.pop_back();
  EXPECT_THAT(err(layer.input(), t, channels, spec), HasSubstr("tokens.positions: size 11"));
  t = tokens;
  std::swap(t.positions[6], t.positions[7]);
  EXPECT_THAT(err(layer.input(), t, channels, spec), HasSubstr("tokens.positions[head 1][1]"));
  t = tokens;
  t.positions[11] = 20;
  EXPECT_THAT(err(layer.input(), t, channels, spec),
              HasSubstr("tokens.positions[head 1][5]: 20 is outside [0, seq_len 20)"));
  ChannelSelection c = channels;
  c.key_idx[7] = 16;
  EXPECT_THAT(err(layer.input(), tokens, c, spec), HasSubstr("channels.key_idx[head 0][7]: 16"));
  c = channels;
  c.key_channels = 0;
  EXPECT_THAT(err(layer.input(), tokens, c, spec), HasSubstr("channels.key_channels: 0"));
  c = channels;
  c.value_idx.resize(5);
  EXPECT_THAT(err(layer.input(), tokens, c, spec), HasSubstr("channels.value_idx: size 5"));
  CompressionSpec s = spec;
  s.quant.bits = 3;
  EXPECT_THAT(err(layer.input(), tokens, channels, s), HasSubstr("spec.quant.bits: 3"));
  s = spec;
  s.quant.group_size = 0;
  EXPECT_THAT(err(layer.input(), tokens, channels, s), HasSubstr("spec.quant.group_size: 0"));
  s = spec;
  s.quant.value_bits = 3;
  EXPECT_THAT(err(layer.input(), tokens, channels, s), HasSubstr("spec.quant.value_bits: 3"));
  s = Spec(0, 2);
  s.quant.value_bits = 4;  // values quantized, keys not
  EXPECT_THAT(err(layer.input(), tokens, channels, s), HasSubstr("spec.quant.value_bits: 4"));
  s = spec;
  s.recent_tokens = -1;
  EXPECT_THAT(err(layer.input(), tokens, channels, s), HasSubstr("spec.recent_tokens: -1"));
}

}  // namespace
}  // namespace kvc

// The split decode kernel (LaunchDecodeAttention) against a double-precision host reference over
// the same packed rows, with ragged heads (different kept and recent counts per head, empty
// heads), several chunks per head with a short last one, batches, every bit width and fp16/bf16;
// and the tensor-core attention scores against the CUDA-core logits -> softmax -> column sum path.
// Without a visible CUDA device main() prints the reason and exits 77 (ctest: skipped).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/decode_plan.h"
#include "cuda/kernels.h"
#include "gpu_util.h"
#include "gpu_dev.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/compact.h"

namespace kvc {
namespace {

using cuda::AttnHead;

using gpu_testing::Dev;

AttnHead HeadOf(const CompactLayerView& v, int h) {
  const uint8_t* base = v.blob().data();
  auto rel = [base](const void* p) -> uint64_t {
    return p == nullptr ? 0 : static_cast<uint64_t>(static_cast<const uint8_t*>(p) - base);
  };
  const CompactHead c = v.head(h);
  return {c.n_kept,           c.n_recent,         c.key_channels,    c.value_channels,
          rel(c.positions),   rel(c.key_idx),     rel(c.value_idx),  rel(c.key_old),
          rel(c.key_scale),   rel(c.key_zero),    rel(c.key_codes),  rel(c.key_recent),
          rel(c.value_old),   rel(c.value_scale), rel(c.value_zero), rel(c.value_codes),
          rel(c.value_recent)};
}

int Code(const uint8_t* row, int i, int bits) {
  const int bit = i * bits;
  return (row[bit >> 3] >> (bit & 7)) & ((1 << bits) - 1);
}

// Key or value row t of head h, dequantized, in head channels (pruned channels 0). `m_full` is
// the blob's old-row count (row strides and group indices come from the blob, not the trimmed
// head).
std::vector<double> Row(const CompactLayerView& v, int h, bool values, bool old, int t) {
  const CompactHead c = v.head(h);
  const int d = v.head_dim(), g = v.header().quant_group;
  const int bits = values ? v.value_bits() : v.key_bits();
  const DType dt = v.dtype();
  std::vector<double> x(d, 0.0);
  if (!old) {
    const void* rows = values ? c.value_recent : c.key_recent;
    for (int ch = 0; ch < d; ++ch) x[ch] = LoadAsFloat(rows, dt, static_cast<size_t>(t) * d + ch);
    return x;
  }
  const int n = values ? c.value_channels : c.key_channels;
  const int32_t* idx = values ? c.value_idx : c.key_idx;
  for (int j = 0; j < n; ++j) {
    double val;
    if (bits == 0) {
      val = LoadAsFloat(values ? c.value_old : c.key_old, dt, static_cast<size_t>(t) * n + j);
    } else {
      const uint8_t* codes = (values ? c.value_codes : c.key_codes) +
                             static_cast<size_t>(t) * ((static_cast<size_t>(n) * bits + 7) / 8);
      size_t gi;
      if (values) {
        gi = static_cast<size_t>(t) * ((n + g - 1) / g) + j / g;
      } else {
        gi = static_cast<size_t>(t / g) * n + j;
      }
      const float* sc = values ? c.value_scale : c.key_scale;
      const float* ze = values ? c.value_zero : c.key_zero;
      val = static_cast<float>(Code(codes, j, bits)) * sc[gi] + ze[gi];
    }
    x[idx[j]] = val;
  }
  return x;
}

struct Trim {  // rows of the blob's head a test head keeps: old rows [0, m), recent rows [0, r)
  int m, r;
};

struct Case {
  DType dtype;
  int bits;
  int g, n_q, n_new;
  int chunk;
  bool think;
  int d = 128;
};

void RunCase(const Case& cs) {
  SCOPED_TRACE(absl::StrCat("dtype ", static_cast<int>(cs.dtype), " bits ", cs.bits, " g ", cs.g,
                            " n_q ", cs.n_q, " n_new ", cs.n_new, " chunk ", cs.chunk, " D ",
                            cs.d));
  const int hkv = 5, d = cs.d, s = 900, batch = 3;
  const LayerShape shape{hkv, hkv * cs.g, s, d, 16};
  const gpu_testing::Layer layer = gpu_testing::RandomLayer(shape, cs.dtype, Layout::kHND, 77);
  CompressionSpec spec;
  spec.eviction.policy = EvictionPolicy::kSnapKV;
  spec.eviction.budget = 400;
  spec.channels.key_policy = cs.think ? ChannelPolicy::kThink : ChannelPolicy::kNone;
  spec.channels.key_lambda = cs.think ? 0.5 : 0.0;
  spec.quant.bits = cs.bits;
  spec.quant.group_size = 16;
  spec.recent_tokens = 70;
  auto cpu = CreateCpuBackend({});
  ASSERT_TRUE(cpu.ok());
  const absl::StatusOr<CompactLayer> blob = (*cpu)->Compress(layer.input(), spec, nullptr);
  ASSERT_TRUE(blob.ok()) << blob.status();
  const absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(blob->bytes);
  ASSERT_TRUE(view.ok());
  const int m0 = view->desc(0).n_kept - view->desc(0).n_recent;
  const int r0 = view->desc(0).n_recent;
  // Ragged heads: full, few old rows, recent only, old only, empty (only the new tokens).
  const Trim trims[hkv] = {{m0, r0}, {m0 / 3 + 1, r0}, {0, r0 / 2}, {m0, 0}, {0, 0}};
  std::vector<AttnHead> heads;
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hkv; ++h) {
      AttnHead a = HeadOf(*view, h);
      a.n_recent = trims[h].r;
      a.n_kept = trims[h].m + trims[h].r;
      heads.push_back(a);
    }
  }
  cuda::DecodeShape ds{static_cast<cuda::ElemType>(cs.dtype),
                       hkv,
                       hkv * cs.g,
                       d,
                       cs.bits,
                       view->header().quant_group,
                       cs.n_q,
                       cs.n_new,
                       batch};
  const cuda::DecodePlan plan = cuda::PlanDecode(ds, heads, 132, cs.chunk);
  ASSERT_TRUE(plan.split) << plan.why_not;

  const int hq = hkv * cs.g;
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const size_t qn = static_cast<size_t>(hq) * cs.n_q * d,
               kn = static_cast<size_t>(hkv) * cs.n_new * d;
  std::vector<float> q(batch * qn), k_new(batch * kn), v_new(batch * kn);
  for (float& x : q) x = 2 * u(rng);
  for (float& x : k_new) x = u(rng);
  for (float& x : v_new) x = u(rng);
  Dev<uint8_t> dblob(blob->bytes.data(), blob->bytes.size());
  Dev<AttnHead> dheads(heads.data(), heads.size());
  Dev<float> dq(q.data(), q.size()), dk(k_new.data(), k_new.size()), dv(v_new.data(), v_new.size());
  Dev<float> dout(batch * qn), partial(plan.partial_floats);
  cudaMemset(dout.p, 0xff, sizeof(float) * batch * qn);  // NaN until written
  std::vector<cuda::DecodeSeq> seqs(batch);
  for (int b = 0; b < batch; ++b) {
    seqs[b] = {dblob.p,       dheads.p + b * hkv, dq.p + b * qn,
               dk.p + b * kn, dv.p + b * kn,      dout.p + b * qn};
  }
  Dev<cuda::DecodeSeq> dseqs(seqs.data(), seqs.size());
  cuda::DecodeArgs a;
  a.dtype = ds.dtype;
  a.num_kv_heads = hkv;
  a.num_q_heads = hq;
  a.head_dim = d;
  a.bits = cs.bits;
  a.group = ds.group;
  a.n_q = cs.n_q;
  a.n_new = cs.n_new;
  a.batch = batch;
  a.seqs = dseqs.p;
  a.row_tile = plan.row_tile;
  a.chunk = plan.chunk;
  a.max_chunks = plan.max_chunks;
  a.partial = partial.p;
  ASSERT_EQ(cuda::LaunchDecodeAttention(a, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> got = dout.Get(batch * qn);
  // The teams' and chunks' sums are added in a fixed order: a second launch gives the same bits.
  cudaMemset(dout.p, 0xff, sizeof(float) * batch * qn);
  ASSERT_EQ(cuda::LaunchDecodeAttention(a, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(dout.Get(batch * qn) == got) << "a second launch gave different bits";

  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (int b = 0; b < batch; ++b) {
    for (int hqi = 0; hqi < hq; ++hqi) {
      const int h = hqi / cs.g;
      for (int i = 0; i < cs.n_q; ++i) {
        const float* qr = q.data() + b * qn + (static_cast<size_t>(hqi) * cs.n_q + i) * d;
        std::vector<std::vector<double>> keys, vals;
        for (int t = 0; t < trims[h].m; ++t) {
          keys.push_back(Row(*view, h, false, true, t));
          vals.push_back(Row(*view, h, true, true, t));
        }
        for (int t = 0; t < trims[h].r; ++t) {
          keys.push_back(Row(*view, h, false, false, t));
          vals.push_back(Row(*view, h, true, false, t));
        }
        for (int t = 0; t < cs.n_new - cs.n_q + i + 1; ++t) {
          const float* kr = k_new.data() + b * kn + (static_cast<size_t>(h) * cs.n_new + t) * d;
          const float* vr = v_new.data() + b * kn + (static_cast<size_t>(h) * cs.n_new + t) * d;
          keys.emplace_back(kr, kr + d);
          vals.emplace_back(vr, vr + d);
        }
        std::vector<double> sc(keys.size());
        double mx = -INFINITY;
        for (size_t t = 0; t < keys.size(); ++t) {
          double s2 = 0;
          for (int c = 0; c < d; ++c) s2 += qr[c] * keys[t][c];
          sc[t] = s2 * scale;
          mx = std::max(mx, sc[t]);
        }
        double sum = 0;
        for (double& x : sc) sum += (x = std::exp(x - mx));
        for (int c = 0; c < d; ++c) {
          double want = 0;
          for (size_t t = 0; t < keys.size(); ++t) want += sc[t] * vals[t][c];
          want /= sum;
          const float g2 = got[b * qn + (static_cast<size_t>(hqi) * cs.n_q + i) * d + c];
          ASSERT_NEAR(want, g2, 1e-3 + 1e-3 * std::fabs(want))
              << "sequence " << b << " query head " << hqi << " row " << i << " channel " << c;
        }
      }
    }
  }
}

TEST(SplitDecode, MatchesTheHostReferenceOnRaggedHeads) {
  for (DType dt : {DType::kF16, DType::kBF16}) {
    for (int bits : {0, 2, 4, 8}) {
      RunCase({dt, bits, 4, 1, 1, 32, true});
    }
  }
  RunCase({DType::kF16, 4, 1, 1, 1, 256, false});   // one query row, one chunk per block
  RunCase({DType::kF16, 8, 2, 3, 5, 40, true});     // 6 rows (row tile 8), 5 new tokens
  RunCase({DType::kBF16, 0, 8, 1, 64, 64, false});  // 8 rows, the most new tokens
  // head_dim 64 and 96: lanes past D idle in recent rows (and past the kept channels in old ones).
  for (int d : {64, 96}) {
    for (int bits : {0, 2, 4, 8}) {
      RunCase({DType::kF16, bits, 4, 1, 1, 32, bits == 4, d});
    }
    RunCase({DType::kBF16, 4, 2, 2, 3, 48, true, d});
  }
}

TEST(SplitDecode, RejectsArgumentsOutsideThePlan) {
  cuda::DecodeArgs a;
  a.dtype = cuda::ElemType::kF16;
  a.num_kv_heads = 1;
  a.num_q_heads = 4;
  a.head_dim = 128;
  a.n_q = a.n_new = 1;
  a.batch = 1;
  a.row_tile = 4;
  a.chunk = 30;  // not a multiple of the teams
  a.seqs = reinterpret_cast<const cuda::DecodeSeq*>(16);
  EXPECT_EQ(cuda::LaunchDecodeAttention(a, nullptr), cudaErrorInvalidValue);
  a.chunk = 32;
  a.dtype = cuda::ElemType::kF32;
  EXPECT_EQ(cuda::LaunchDecodeAttention(a, nullptr), cudaErrorInvalidValue);
  a.dtype = cuda::ElemType::kF16;
  a.num_q_heads = 12;  // 12 rows > row tile 4... and > 8
  EXPECT_EQ(cuda::LaunchDecodeAttention(a, nullptr), cudaErrorInvalidValue);
}

// Tensor-core column scores against the CUDA-core three-kernel path on the same device buffers.
void CompareScores(DType dt, int hkv, int g, int s, int d, int w, int row_block, bool gumbel) {
  SCOPED_TRACE(absl::StrCat("dtype ", static_cast<int>(dt), " S ", s, " D ", d, " W ", w, " rows ",
                            row_block, " gumbel ", gumbel));
  const int hq = hkv * g;
  const LayerShape shape{hkv, hq, s, d, w};
  const gpu_testing::Layer layer = gpu_testing::RandomLayer(shape, dt, Layout::kNHD, 11);
  Dev<uint8_t> k(layer.k.data(), layer.k.size()), q(layer.q.data(), layer.q.size());
  const cuda::Strides ks{d, static_cast<int64_t>(hkv) * d}, qs{d, static_cast<int64_t>(hq) * d};
  const cuda::ElemType et = static_cast<cuda::ElemType>(dt);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  Dev<float> ref(static_cast<size_t>(hkv) * s), tc(static_cast<size_t>(hkv) * s);
  Dev<float> logits(static_cast<size_t>(hq) * row_block * s);
  Dev<float> scratch(cuda::ColumnScoreScratchFloats(hq, row_block, s));
  for (int row0 = 0; row0 < w; row0 += row_block) {
    const cuda::QueryRows qr{row0, std::min(row_block, w - row0)};
    ASSERT_EQ(
        cuda::LaunchQKLogits(et, q.p, qs, k.p, ks, hq, hkv, w, qr, s, d, scale, logits.p, nullptr),
        cudaSuccess);
    ASSERT_EQ(cuda::LaunchSoftmaxRows(logits.p, hq, w, qr, s, gumbel, 9, 2, 1.0f / 1.5f, nullptr),
              cudaSuccess);
    ASSERT_EQ(cuda::LaunchGroupColumnSum(logits.p, hq, hkv, qr.rows, s, row0 > 0, ref.p, nullptr),
              cudaSuccess);
    ASSERT_EQ(cuda::LaunchTensorCoreColumnScores(et, q.p, qs, k.p, ks, hq, hkv, w, qr, s, d, scale,
                                                 gumbel, 9, 2, 1.0f / 1.5f, row0 > 0, scratch.p,
                                                 tc.p, nullptr),
              cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<float> a = ref.Get(static_cast<size_t>(hkv) * s);
  const std::vector<float> b = tc.Get(static_cast<size_t>(hkv) * s);
  float mx = 0;
  for (float x : a) mx = std::max(mx, std::fabs(x));
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_TRUE(std::isfinite(b[i])) << i;
    ASSERT_NEAR(a[i], b[i], 1e-5f * mx + 1e-7f) << "head " << i / s << " key " << i % s;
  }
}

TEST(TensorCoreScores, MatchTheCudaCorePath) {
  for (DType dt : {DType::kF16, DType::kBF16}) {
    CompareScores(dt, 2, 4, 1000, 128, 32, 32, false);
    CompareScores(dt, 2, 4, 1000, 128, 32, 32, true);
  }
  CompareScores(DType::kF16, 1, 1, 1, 8, 1, 1, false);        // one key
  CompareScores(DType::kF16, 2, 1, 77, 8, 5, 5, true);        // tiles with tails, D < 16
  CompareScores(DType::kBF16, 2, 3, 300, 96, 40, 16, true);   // 3 row blocks, accumulate
  CompareScores(DType::kF16, 1, 4, 513, 256, 64, 64, false);  // D 256, rows over 4 row tiles
  CompareScores(DType::kF16, 2, 2, 130, 100, 130, 50, true);  // W = S, D not a multiple of 8
}

TEST(TensorCoreScores, Fp32IsLeftToTheCudaCorePath) {
  cuda::QueryRows qr{0, 1};
  EXPECT_EQ(cuda::LaunchTensorCoreColumnScores(cuda::ElemType::kF32, nullptr, {}, nullptr, {}, 1, 1,
                                               1, qr, 1, 8, 1.0f, false, 0, 0, 1.0f, false, nullptr,
                                               nullptr, nullptr),
            cudaErrorInvalidValue);
}

}  // namespace
}  // namespace kvc

int main(int argc, char** argv) { return kvc::gpu_testing::RunGpuTests(argc, argv); }

// The integer attention kernels (kernels/cpu/attention_int.h), row by row: on every instruction
// set this CPU has, value sums equal the portable kernels' bit for bit (the integer sums are exact
// and the float steps are the same operations in the same order) and key scores up to the fp32
// sum over channel blocks (whose order differs), over 2/4/8-bit
// codes, channel counts that fill whole vectors, parts of them or several, rows that leave tails,
// 1 to 9 queries and every grouping (value groups past the vector kernels' limit included); and
// each result stays within the error bound the header states against the float arithmetic on the
// same codes. At the level of whole attention outputs, over random shapes and specs on real-ish
// data, the integer path's error against the exact (fp32) path stays a small fraction of the
// output's scale and (at 2 and 4 bits, where it is the default) of the error the quantized cache
// itself carries.
#include "../../kernels/cpu/attention_int.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

#include "../../kernels/core/quantize.h"
#include "../../kernels/cpu/attention_int_rows.h"
#include "gtest/gtest.h"
#include "kernels/isa_util.h"
#include "kernels/pack_util.h"
#include "kvc/attention.h"
#include "kvc/cpu_isa.h"
#include "kvc/selection.h"

namespace kvc {
namespace {

using cpu::attn::AccumulateValueCodesInt;
using cpu::attn::Rows;
using cpu::attn::ScoreKeyCodesInt;
using Math = PackedAttentionOptions::Math;
using testing_isa::ScopedIsaCap;
using testing_isa::SupportedIsas;
using testing_pack::ExpectedHeadRows;
using testing_pack::PackLayerData;
using testing_pack::RandomChannels;
using testing_pack::RandomTokens;
using testing_pack::ReferenceAttention;

std::vector<uint8_t> RandomBytes(size_t n, std::mt19937* rng) {
  std::uniform_int_distribution<int> d(0, 255);
  std::vector<uint8_t> v(n);
  for (uint8_t& b : v) b = static_cast<uint8_t>(d(*rng));
  return v;
}

std::vector<float> Uniform(size_t n, float lo, float hi, std::mt19937* rng) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(*rng);
  return v;
}

struct KeyCase {
  int bits, n, group, rows, nq;
};

// Scores of rows [j0, j1) on the current path, into a fresh buffer of stride j1 - j0 + 3 (the
// last three columns must stay untouched).
std::vector<float> ScoreKeys(const Rows& K, int j0, int j1, const std::vector<float>& qm, int nq) {
  const int ss = j1 - j0 + 3;
  std::vector<float> s(static_cast<size_t>(nq) * ss, -7.0f);
  ScoreKeyCodesInt(K, j0, j1, qm.data(), nq, s.data(), ss);
  return s;
}

TEST(AttentionIntTest, KeyScoresEqualOnEveryPathAndStayWithinTheirBound) {
  std::mt19937 rng(31);
  std::vector<KeyCase> cases;
  for (int bits : {2, 4, 8}) {
    for (int n : {8, 16, 24, 32, 40, 56, 64, 72, 96, 128, 136, 200, 256}) {
      for (int nq : {1, 2, 3, 4, 5, 8, 9}) {
        const int group = nq % 3 == 0 ? 8 : nq % 3 == 1 ? 32 : 13;
        cases.push_back({bits, n, group, 37 + nq * 9, nq});
      }
    }
  }
  cases.push_back({4, 5, 32, 19, 3});  // rows that end inside a byte
  cases.push_back({2, 7, 4, 23, 4});
  cases.push_back({4, 64, std::numeric_limits<int>::max(), 50, 4});  // one group for every row
  int checked = 0;
  for (const KeyCase& kc : cases) {
    SCOPED_TRACE(::testing::Message()
                 << "bits " << kc.bits << " n " << kc.n << " G " << kc.group << " nq " << kc.nq);
    const size_t rb = quant::CodeRowBytes(kc.n, kc.bits);
    const int groups = quant::NumGroups(kc.rows, kc.group);
    const std::vector<uint8_t> codes = RandomBytes(rb * kc.rows, &rng);
    std::vector<float> scale = Uniform(static_cast<size_t>(groups) * kc.n, 0.001f, 0.3f, &rng);
    scale[kc.n / 2] = 0.0f;  // a constant channel
    const std::vector<float> zero = Uniform(static_cast<size_t>(groups) * kc.n, -2.0f, 2.0f, &rng);
    Rows K;
    K.kind = Rows::kKeyCodes;
    K.base = codes.data();
    K.row_bytes = rb;
    K.n = kc.n;
    K.bits = kc.bits;
    K.group = kc.group;
    K.scale = scale.data();
    K.zero = zero.data();
    std::vector<float> qm = Uniform(static_cast<size_t>(kc.nq) * kc.n, -3.0f, 3.0f, &rng);
    if (kc.nq > 2) std::fill(qm.begin() + kc.n, qm.begin() + 2 * kc.n, 0.0f);  // a silent query
    const int j0 = 3, j1 = kc.rows - 2;
    std::vector<float> portable;
    {
      const ScopedIsaCap cap(CpuIsa::kPortable);
      portable = ScoreKeys(K, j0, j1, qm, kc.nq);
    }
    // The bound: |score - float score| <= sum over blocks b of alpha_b / 2 * sum_{c in b}
    // |code_c - mid| (+ fp32 rounding), alpha_b = max_{c in b} |q_c scale_c| / 127 for blocks of
    // 32 / bits channels of the row's token group; mid = (2^bits - 1) / 2.
    const int ss = j1 - j0 + 3;
    const int B = 32 / kc.bits;
    const double mid = ((1 << kc.bits) - 1) / 2.0;
    std::vector<double> mags(portable.size(), 0.0);
    for (int a = 0; a < kc.nq; ++a) {
      for (int j = j0; j < j1; ++j) {
        const size_t gi = static_cast<size_t>(j / kc.group);
        double exact = 0, bound = 0, mag = 0;
        for (int b0 = 0; b0 < kc.n; b0 += B) {
          double amax = 0, spread = 0;
          for (int c = b0; c < std::min(kc.n, b0 + B); ++c) {
            const double code = quant::CodeAt(codes.data() + j * rb, c, kc.bits);
            const double q = qm[static_cast<size_t>(a) * kc.n + c];
            const double qs = static_cast<float>(q * scale[gi * kc.n + c]);
            const double z = zero[gi * kc.n + c];
            exact += qs * code + q * z;
            mag += std::fabs(qs * code) + std::fabs(q * z);
            spread += std::fabs(code - mid);
            amax = std::max(amax, std::fabs(qs));
          }
          bound += amax / 127 / 2 * spread * (1 + 1e-4);
        }
        const double got = portable[static_cast<size_t>(a) * ss + (j - j0)];
        mags[static_cast<size_t>(a) * ss + (j - j0)] = mag;
        ASSERT_LE(std::fabs(got - exact), bound + 1e-6 * (1 + mag))
            << "query " << a << " row " << j;
      }
      for (int j = j1 - j0; j < ss; ++j)
        ASSERT_EQ(portable[static_cast<size_t>(a) * ss + j], -7.0f);
    }
    for (CpuIsa isa : SupportedIsas()) {
      SCOPED_TRACE(CpuIsaName(isa));
      const ScopedIsaCap cap(isa);
      const std::vector<float> got = ScoreKeys(K, j0, j1, qm, kc.nq);
      // The integer sums are exact; only the fp32 sum over blocks differs in order.
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_NEAR(got[i], portable[i], 2e-6 * (1 + mags[i])) << "element " << i;
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, static_cast<int>(cases.size() * SupportedIsas().size()));
}

struct ValueCase {
  int bits, n, group, rows, nq;
};

TEST(AttentionIntTest, ValueSumsEqualOnEveryPathAndStayWithinTheirBound) {
  std::mt19937 rng(77);
  std::vector<ValueCase> cases;
  for (int bits : {2, 4}) {
    for (int n : {8, 32, 64, 96, 128, 256}) {
      for (int group : {8, 16, 32, 64, 128}) {
        for (int nq : {1, 3, 4, 6, 9}) cases.push_back({bits, n, group, 150 + 7 * nq, nq});
      }
    }
    cases.push_back({bits, 128, 4, 70, 4});   // 32 groups: past the vector kernels
    cases.push_back({bits, 120, 12, 65, 4});  // a partial last group
    cases.push_back({bits, 7, 3, 9, 2});      // rows ending inside a byte
    cases.push_back({bits, 80, 16, 3, 4});    // fewer rows than one step
  }
  int checked = 0;
  for (const ValueCase& vc : cases) {
    SCOPED_TRACE(::testing::Message() << "bits " << vc.bits << " n " << vc.n << " G " << vc.group
                                      << " rows " << vc.rows << " nq " << vc.nq);
    const size_t rb = quant::CodeRowBytes(vc.n, vc.bits);
    const int ng = quant::NumGroups(vc.n, vc.group);
    const std::vector<uint8_t> codes = RandomBytes(rb * vc.rows, &rng);
    const std::vector<float> scale = Uniform(static_cast<size_t>(vc.rows) * ng, 0.01f, 0.5f, &rng);
    const std::vector<float> zero = Uniform(static_cast<size_t>(vc.rows) * ng, -2.0f, 1.0f, &rng);
    Rows V;
    V.kind = Rows::kValueCodes;
    V.base = codes.data();
    V.row_bytes = rb;
    V.n = vc.n;
    V.bits = vc.bits;
    V.group = vc.group;
    V.scale = scale.data();
    V.zero = zero.data();
    // Softmax-like weights: mostly small, a few near 1, some exactly 0; one query all zero.
    const int j0 = 1, j1 = vc.rows;
    const int ps = vc.rows + 2;
    std::vector<float> p(static_cast<size_t>(vc.nq) * ps);
    std::exponential_distribution<float> e(1.0f);
    for (float& x : p) x = std::exp(-4.0f * e(rng));
    for (size_t i = 0; i < p.size(); i += 11) p[i] = 0.0f;
    if (vc.nq > 2) std::fill(p.begin() + ps, p.begin() + 2 * ps, 0.0f);
    const std::vector<float> init = Uniform(static_cast<size_t>(vc.nq) * vc.n, -1.0f, 1.0f, &rng);
    std::vector<float> portable = init;
    {
      const ScopedIsaCap cap(CpuIsa::kPortable);
      AccumulateValueCodesInt(V, j0, j1, p.data(), ps, vc.nq, portable.data());
    }
    // The bound: each block's weights move by at most beta/2 = max w / 510, and (centring) each
    // move multiplies code - mid, mid = (2^bits - 1) / 2.
    const double mid = ((1 << vc.bits) - 1) / 2.0;
    for (int a = 0; a < vc.nq; ++a) {
      for (int c = 0; c < vc.n; ++c) {
        const int g = c / vc.group;
        double exact = init[static_cast<size_t>(a) * vc.n + c], bound = 0, mag = 0;
        for (int b0 = j0; b0 < j1; b0 += cpu::attn::isa::kValueBlock) {
          const int b1 = std::min(j1, b0 + cpu::attn::isa::kValueBlock);
          double wmax = 0, spread = 0;
          for (int j = b0; j < b1; ++j) {
            const double pj = p[static_cast<size_t>(a) * ps + (j - j0)];
            const double code = quant::CodeAt(codes.data() + j * rb, c, vc.bits);
            const double s = scale[static_cast<size_t>(j) * ng + g];
            const double z = zero[static_cast<size_t>(j) * ng + g];
            exact += pj * (code * s + z);
            mag += std::fabs(pj * (code * s + z));
            wmax =
                std::max(wmax, static_cast<double>(static_cast<float>(pj) * static_cast<float>(s)));
            spread += std::fabs(code - mid);
          }
          bound += wmax / 510.0 * spread;
        }
        const double got = portable[static_cast<size_t>(a) * vc.n + c];
        ASSERT_LE(std::fabs(got - exact), bound * (1 + 1e-5) + 2e-6 * (1 + mag))
            << "query " << a << " channel " << c;
      }
    }
    for (CpuIsa isa : SupportedIsas()) {
      SCOPED_TRACE(CpuIsaName(isa));
      const ScopedIsaCap cap(isa);
      std::vector<float> got = init;
      AccumulateValueCodesInt(V, j0, j1, p.data(), ps, vc.nq, got.data());
      for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], portable[i]) << "element " << i;
      ++checked;
    }
  }
  EXPECT_EQ(checked, static_cast<int>(cases.size() * SupportedIsas().size()));
}

// A layer that looks like a model's (fp32, HND): keys with per-channel magnitudes spread over
// ~10x (log-normal) plus two outlier channels, a per-channel offset and slow drift along the
// tokens (AR(1)); values Gaussian with per-channel scales.
PackLayerData RealisticLayer(int hkv, int seq_len, int d, std::mt19937* rng) {
  PackLayerData l;
  l.shape.num_kv_heads = hkv;
  l.shape.num_q_heads = hkv;
  l.shape.seq_len = seq_len;
  l.shape.head_dim = d;
  l.dtype = DType::kF32;
  l.layout = Layout::kHND;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const size_t n = static_cast<size_t>(hkv) * seq_len * d;
  l.kf.resize(n);
  l.vf.resize(n);
  for (int h = 0; h < hkv; ++h) {
    std::vector<float> km(d), kb(d), vm(d), state(d);
    for (int c = 0; c < d; ++c) {
      km[c] = std::exp(0.6f * normal(*rng));
      kb[c] = 0.5f * normal(*rng);
      vm[c] = std::exp(0.3f * normal(*rng));
      state[c] = normal(*rng);
    }
    km[static_cast<size_t>((*rng)() % d)] *= 6.0f;
    km[static_cast<size_t>((*rng)() % d)] *= 6.0f;
    for (int t = 0; t < seq_len; ++t) {
      for (int c = 0; c < d; ++c) {
        const size_t i = (static_cast<size_t>(h) * seq_len + t) * d + c;
        state[c] = 0.9f * state[c] + 0.44f * normal(*rng);
        l.kf[i] = km[c] * state[c] + kb[c];
        l.vf[i] = vm[c] * normal(*rng);
      }
    }
  }
  l.k.resize(n * sizeof(float));
  l.v.resize(n * sizeof(float));
  std::memcpy(l.k.data(), l.kf.data(), l.k.size());
  std::memcpy(l.v.data(), l.vf.data(), l.v.size());
  return l;
}

double Rms(const std::vector<float>& x) {
  double s = 0;
  for (float v : x) s += static_cast<double>(v) * v;
  return std::sqrt(s / static_cast<double>(x.size()));
}

double MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double{a[i]} - b[i]));
  return m;
}

// 40 random shapes and specs (2/4/8 bits, token groups of 8-32, ThinK-pruned keys or not, GQA
// groups 1-8, 1-2 queries per head; queries aimed at a cached token or not). Errors relative to
// the RMS of the exact output: the integer path against the exact path, and the exact path
// against attention over the unquantized kept rows (what quantization itself costs).
TEST(AttentionIntTest, OutputErrorIsSmallAgainstFloatAndAgainstTheCacheOwn) {
  std::mt19937 rng(2025);
  struct Row {
    int bits;
    double int_err, cache_err;
  };
  std::vector<Row> rows;
  for (int i = 0; i < 40; ++i) {
    const int hkv = 1 << (rng() % 3), g = (i % 3 == 0) ? 1 : (i % 3 == 1 ? 4 : 8);
    const int d = rng() % 2 == 0 ? 64 : 128;
    const int s = 300 + static_cast<int>(rng() % 2200);
    const int budget = s / 4 + static_cast<int>(rng() % (s - s / 4));
    const int tk = (rng() % 2 == 0) ? d : d / 2, tv = (rng() % 3 == 0) ? d / 2 : d;
    const int bits = i % 3 == 0 ? 2 : (i % 3 == 1 ? 4 : 8);
    const int group = 8 << (rng() % 3);
    const int n_q = 1 + static_cast<int>(rng() % 2);
    SCOPED_TRACE(::testing::Message() << "case " << i << ": Hkv " << hkv << " g " << g << " D " << d
                                      << " S " << s << " B " << budget << " Tk " << tk << " Tv "
                                      << tv << " bits " << bits << " G " << group);
    const PackLayerData layer = RealisticLayer(hkv, s, d, &rng);
    const TokenSelection tokens = RandomTokens(hkv, s, budget, &rng);
    const ChannelSelection channels = RandomChannels(hkv, d, tk, tv, &rng);
    CompressionSpec spec;
    spec.quant.bits = bits;
    spec.quant.group_size = group;
    spec.recent_tokens = 16;
    absl::StatusOr<CompactLayer> packed = PackLayer(layer.input(), tokens, channels, spec);
    ASSERT_TRUE(packed.ok()) << packed.status();
    absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
    ASSERT_TRUE(view.ok()) << view.status();
    // Queries: half aimed at a kept token (a peaked softmax), half random (a flat one).
    const int hq = hkv * g;
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> q(static_cast<size_t>(hq) * n_q * d);
    for (int qh = 0; qh < hq; ++qh) {
      const int h = qh / g;
      for (int k = 0; k < n_q; ++k) {
        float* qv = &q[(static_cast<size_t>(qh) * n_q + k) * d];
        if ((qh + k) % 2 == 0) {
          const int t = tokens.head(h)[rng() % tokens.count(h)];
          const float* kv = &layer.kf[(static_cast<size_t>(h) * s + t) * d];
          double norm2 = 0;
          for (int c = 0; c < d; ++c) norm2 += double{kv[c]} * kv[c];
          const float a = static_cast<float>(10.0 * std::sqrt(static_cast<double>(d)) / norm2);
          for (int c = 0; c < d; ++c) qv[c] = a * kv[c] + 0.1f * normal(rng);
        } else {
          for (int c = 0; c < d; ++c) qv[c] = 0.3f * normal(rng);
        }
      }
    }
    const std::vector<float> k_new(static_cast<size_t>(hkv) * n_q * d, 0.1f),
        v_new(static_cast<size_t>(hkv) * n_q * d, 0.2f);
    const DecodeQuery dq{hq, n_q, q.data(), n_q, k_new.data(), v_new.data()};
    std::vector<float> out_auto(q.size()), out_int(q.size()), out_exact(q.size());
    ASSERT_TRUE(PackedAttentionCpu(*view, dq, out_auto.data()).ok());
    ASSERT_TRUE(
        PackedAttentionCpu(*view, dq, out_int.data(), nullptr, {.math = Math::kInteger}).ok());
    ASSERT_TRUE(
        PackedAttentionCpu(*view, dq, out_exact.data(), nullptr, {.math = Math::kExact}).ok());
    // The default: integer at 2 and 4 bits, exact at 8.
    EXPECT_EQ(out_auto, bits == 8 ? out_exact : out_int);
    std::vector<std::vector<float>> keys(hkv), values(hkv);
    for (int h = 0; h < hkv; ++h) {
      ExpectedHeadRows(layer, tokens, channels, h, view->head(h).n_recent, &keys[h], &values[h]);
    }
    const std::vector<float> out_float =
        ReferenceAttention(keys, values, d, hq, n_q, q, n_q, k_new, v_new);
    const double rms = Rms(out_exact);
    ASSERT_GT(rms, 0.0);
    const Row r{bits, MaxAbsDiff(out_int, out_exact) / rms, MaxAbsDiff(out_exact, out_float) / rms};
    rows.push_back(r);
    // Per case: within 15% of the output's scale; at 2 and 4 bits (the default's integer
    // widths) at most half what quantization itself does (at 8 bits the int8 query has the
    // codes' own resolution: at most five times).
    EXPECT_LE(r.int_err, 0.15);
    EXPECT_LE(r.int_err, (bits == 8 ? 5.0 : 0.5) * r.cache_err);
  }
  // Summary per width (the numbers docs/performance.md quotes): mean and max of each error.
  for (int bits : {2, 4, 8}) {
    double mi = 0, xi = 0, mc = 0, xc = 0;
    int n = 0;
    for (const Row& r : rows) {
      if (r.bits != bits) continue;
      ++n;
      mi += r.int_err;
      mc += r.cache_err;
      xi = std::max(xi, r.int_err);
      xc = std::max(xc, r.cache_err);
    }
    std::printf(
        "%d-bit (%d cases): max|int - exact| / rms: mean %.4f max %.4f; "
        "max|exact - unquantized| / rms: mean %.4f max %.4f\n",
        bits, n, mi / n, xi, mc / n, xc);
    // On average the integer arithmetic adds at most a sixth of the cache's own error at 2 and
    // 4 bits (as much again at 8: why the default keeps 8-bit blocks exact).
    EXPECT_LE(mi, (bits == 8 ? 2.0 : 1.0 / 6) * mc) << bits << "-bit";
  }
}

// kAuto takes the integer path for 2- and 4-bit heads with at least 32 kept channels, and stays
// exact for 8-bit caches and smaller heads (where the integer path's set-up costs more than it
// saves); kInteger forces it everywhere.
TEST(AttentionIntTest, AutoChoosesByWidthAndChannels) {
  std::mt19937 rng(4);
  for (const auto& [bits, d, want_integer] : std::vector<std::tuple<int, int, bool>>{
           {4, 64, true}, {2, 64, true}, {8, 64, false}, {4, 16, false}, {2, 8, false}}) {
    SCOPED_TRACE(::testing::Message() << bits << "-bit D " << d);
    const PackLayerData layer = RealisticLayer(1, 300, d, &rng);
    CompressionSpec spec;
    spec.quant.bits = bits;
    spec.quant.group_size = 8;
    spec.recent_tokens = 4;
    absl::StatusOr<CompactLayer> packed = PackLayer(layer.input(), RandomTokens(1, 300, 200, &rng),
                                                    RandomChannels(1, d, d, d, &rng), spec);
    ASSERT_TRUE(packed.ok()) << packed.status();
    const CompactLayerView view = *CompactLayerView::Parse(packed->bytes);
    std::vector<float> q(4 * d), kn(d, 0.1f), vn(d, 0.2f);
    std::normal_distribution<float> normal(0.0f, 0.5f);
    for (float& x : q) x = normal(rng);
    const DecodeQuery dq{4, 1, q.data(), 1, kn.data(), vn.data()};
    std::vector<float> out_auto(q.size()), out_int(q.size()), out_exact(q.size());
    ASSERT_TRUE(PackedAttentionCpu(view, dq, out_auto.data()).ok());
    ASSERT_TRUE(
        PackedAttentionCpu(view, dq, out_int.data(), nullptr, {.math = Math::kInteger}).ok());
    ASSERT_TRUE(
        PackedAttentionCpu(view, dq, out_exact.data(), nullptr, {.math = Math::kExact}).ok());
    EXPECT_NE(out_int, out_exact);  // the integer path does change the arithmetic
    EXPECT_EQ(out_auto, want_integer ? out_int : out_exact);
  }
}

}  // namespace
}  // namespace kvc

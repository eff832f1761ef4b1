#include "gpu_compare.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "channel_reference.h"
#include "gtest/gtest.h"
#include "kvc/selection.h"

namespace kvc::gpu_testing {
namespace {

std::vector<int32_t> HeadPositions(const CompactLayerView& v, int h) {
  const CompactHead hd = v.head(h);
  return std::vector<int32_t>(hd.positions, hd.positions + hd.n_kept);
}

// True when every position in one set but not the other has a CPU score within tolerance of the
// boundary scores (a tie the two devices may legitimately break differently). NaN scores never
// win a slot on either device, so a NaN among the differences is a real mismatch.
bool DifferencesAreTies(const std::vector<int32_t>& a, const std::vector<int32_t>& b,
                        const float* score, int s, std::string* why) {
  std::vector<int32_t> only_a, only_b;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(only_a));
  std::set_difference(b.begin(), b.end(), a.begin(), a.end(), std::back_inserter(only_b));
  float mx = 0;
  for (int j = 0; j < s; ++j) {
    if (std::isfinite(score[j])) mx = std::max(mx, std::fabs(score[j]));
  }
  const float tol = 2e-5f * mx + 1e-7f;
  for (int32_t x : only_a) {
    for (int32_t y : only_b) {
      if (!(std::fabs(score[x] - score[y]) <= tol)) {
        *why = absl::StrCat("position ", x, " (score ", score[x], ") vs ", y, " (score ", score[y],
                            "), tolerance ", tol);
        return false;
      }
    }
  }
  return true;
}

void ExpectBytesEqual(const void* a, const void* b, size_t n, const std::string& what) {
  if (n == 0) return;
  ASSERT_NE(a, nullptr) << what;
  ASSERT_NE(b, nullptr) << what;
  const auto* x = static_cast<const uint8_t*>(a);
  const auto* y = static_cast<const uint8_t*>(b);
  const auto mismatch = std::mismatch(x, x + n, y);
  EXPECT_EQ(mismatch.first, x + n)
      << what << ": first differing byte at " << (mismatch.first - x) << " of " << n;
}

bool Near(float a, float b, float rel, bool allow_nan) {
  if (allow_nan && std::isnan(a) && std::isnan(b)) return true;
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= rel * std::max(1.0f, std::fabs(a));
}

void ExpectFloatsNear(const float* a, const float* b, size_t n, float rel, bool allow_nan,
                      const std::string& what) {
  for (size_t i = 0; i < n; ++i) {
    if (!Near(a[i], b[i], rel, allow_nan)) {
      ADD_FAILURE() << what << "[" << i << "]: cpu " << a[i] << " cuda " << b[i];
      return;
    }
  }
}

void ExpectCodesNear(const uint8_t* a, const uint8_t* b, int rows, int n, int bits,
                     const std::string& what) {
  const size_t row_bytes = (static_cast<size_t>(n) * bits + 7) / 8;
  for (int r = 0; r < rows; ++r) {
    for (int i = 0; i < n; ++i) {
      const size_t bit = static_cast<size_t>(i) * bits;
      const int ca = (a[r * row_bytes + bit / 8] >> (bit % 8)) & ((1 << bits) - 1);
      const int cb = (b[r * row_bytes + bit / 8] >> (bit % 8)) & ((1 << bits) - 1);
      if (std::abs(ca - cb) > 1) {
        ADD_FAILURE() << what << " row " << r << " element " << i << ": cpu " << ca << " cuda "
                      << cb;
        return;
      }
    }
  }
}

// Every block of head h, for heads whose token and channel selections agree.
void CompareHead(const CompactLayerView& c, const CompactLayerView& g, int h, DType dtype,
                 bool allow_nan) {
  const int bits = c.key_bits(), vbits = c.value_bits(), gs = c.header().quant_group;
  const int d = c.head_dim();
  const size_t es = DTypeSize(dtype);
  const CompactHead a = c.head(h), b = g.head(h);
  const int m = a.n_kept - a.n_recent, r = a.n_recent;
  const std::string hs = absl::StrCat("head ", h, " ");
  ExpectBytesEqual(a.positions, b.positions, 4 * a.n_kept, hs + "positions");
  ExpectBytesEqual(a.key_idx, b.key_idx, 4 * a.key_channels, hs + "key_idx");
  ExpectBytesEqual(a.value_idx, b.value_idx, 4 * a.value_channels, hs + "value_idx");
  ExpectBytesEqual(a.key_recent, b.key_recent, es * r * d, hs + "key_recent");
  ExpectBytesEqual(a.value_recent, b.value_recent, es * r * d, hs + "value_recent");
  if (bits == 0) {
    ExpectBytesEqual(a.key_old, b.key_old, es * m * a.key_channels, hs + "key_old");
    ExpectBytesEqual(a.value_old, b.value_old, es * m * a.value_channels, hs + "value_old");
    return;
  }
  const size_t kp = static_cast<size_t>((m + gs - 1) / gs) * a.key_channels;
  const size_t vp = static_cast<size_t>(m) * ((a.value_channels + gs - 1) / gs);
  ExpectFloatsNear(a.key_scale, b.key_scale, kp, 1e-6f, allow_nan, hs + "key_scale");
  ExpectFloatsNear(a.key_zero, b.key_zero, kp, 1e-6f, allow_nan, hs + "key_zero");
  ExpectFloatsNear(a.value_scale, b.value_scale, vp, 1e-6f, allow_nan, hs + "value_scale");
  ExpectFloatsNear(a.value_zero, b.value_zero, vp, 1e-6f, allow_nan, hs + "value_zero");
  ExpectCodesNear(a.key_codes, b.key_codes, m, a.key_channels, bits, hs + "key_codes");
  ExpectCodesNear(a.value_codes, b.value_codes, m, a.value_channels, vbits, hs + "value_codes");
}

// A head whose kept sets differ at ties: the recent rows when both kept the same recent
// positions, and (full precision, same channels) the old rows of every position both kept.
// Returns how many rows it compared.
int ComparePartialHead(const CompactLayerView& c, const CompactLayerView& g, int h, DType dtype,
                       bool same_channels) {
  const int bits = c.header().quant_bits, d = c.head_dim();
  const size_t es = DTypeSize(dtype);
  const CompactHead a = c.head(h), b = g.head(h);
  if (a.n_kept != b.n_kept || a.n_recent != b.n_recent) {
    ADD_FAILURE() << "head " << h << ": kept counts differ: " << a.n_kept << "/" << a.n_recent
                  << " vs " << b.n_kept << "/" << b.n_recent;
    return 0;
  }
  const int m = a.n_kept - a.n_recent, r = a.n_recent;
  int rows = 0;
  if (r > 0 && std::equal(a.positions + m, a.positions + a.n_kept, b.positions + m)) {
    ExpectBytesEqual(a.key_recent, b.key_recent, es * r * d,
                     absl::StrCat("head ", h, " key_recent"));
    ExpectBytesEqual(a.value_recent, b.value_recent, es * r * d,
                     absl::StrCat("head ", h, " value_recent"));
    rows += r;
  }
  if (bits != 0 || !same_channels) return rows;
  const size_t kb = es * a.key_channels, vb = es * a.value_channels;
  for (int i = 0, j = 0; i < m && j < m;) {
    if (a.positions[i] < b.positions[j]) {
      ++i;
    } else if (a.positions[i] > b.positions[j]) {
      ++j;
    } else {
      const std::string what = absl::StrCat("head ", h, " position ", a.positions[i]);
      ExpectBytesEqual(static_cast<const uint8_t*>(a.key_old) + i * kb,
                       static_cast<const uint8_t*>(b.key_old) + j * kb, kb, what + " key_old");
      ExpectBytesEqual(static_cast<const uint8_t*>(a.value_old) + i * vb,
                       static_cast<const uint8_t*>(b.value_old) + j * vb, vb, what + " value_old");
      ++rows;
      ++i;
      ++j;
    }
  }
  return rows;
}

}  // namespace

Backend& Cpu() {
  static Backend* b = CreateCpuBackend({}).value().release();
  return *b;
}

Backend& Gpu() {
  static Backend* b = CreateCudaBackend({}).value().release();
  return *b;
}

void CompareAttention(const CompactLayerView& view, int num_q_heads,
                      const CompareOptions& options) {
  std::mt19937_64 rng(options.attention_seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int d = view.head_dim(), hkv = view.num_kv_heads();
  DecodeQuery q;
  q.num_q_heads = num_q_heads;
  q.n_q = options.attention_n_q;
  q.n_new = q.n_q + 1;
  std::vector<float> qs(static_cast<size_t>(num_q_heads) * q.n_q * d);
  std::vector<float> kn(static_cast<size_t>(hkv) * q.n_new * d), vn(kn.size());
  for (float& x : qs) x = u(rng);
  for (float& x : kn) x = u(rng);
  for (float& x : vn) x = u(rng);
  q.q = qs.data();
  q.k_new = kn.data();
  q.v_new = vn.data();
  std::vector<float> out_cpu(qs.size()), out_gpu(qs.size(), -12345.0f);
  ASSERT_TRUE(Cpu().Attend(view, q, out_cpu.data()).ok());
  const absl::Status st = Gpu().Attend(view, q, out_gpu.data());
  ASSERT_TRUE(st.ok()) << st;
  for (size_t i = 0; i < out_cpu.size(); ++i) {
    const float a = out_cpu[i], b = out_gpu[i];
    if (options.allow_nan && std::isnan(a) && std::isnan(b)) continue;
    ASSERT_FALSE(std::isnan(b)) << "cuda attention output element " << i << " is NaN";
    ASSERT_NEAR(a, b, 2e-3f + 2e-3f * std::fabs(a)) << "attention output element " << i;
  }
}

void CompareCompressed(const std::string& name, const Layer& layer, const LayerInput& in,
                       const CompressionSpec& spec, const CompareOptions& options) {
  const LayerInput host_in = layer.input();
  const LayerShape& sh = layer.shape;
  CompressTimings t;
  const absl::StatusOr<CompactLayer> cpu = Cpu().Compress(host_in, spec, nullptr);
  ASSERT_TRUE(cpu.ok()) << cpu.status();
  const absl::StatusOr<CompactLayer> gpu = Gpu().Compress(in, spec, &t);
  ASSERT_TRUE(gpu.ok()) << gpu.status();
  EXPECT_GE(t.total, t.score);
  const absl::StatusOr<CompactLayerView> cv = CompactLayerView::Parse(cpu->bytes);
  const absl::StatusOr<CompactLayerView> gv = CompactLayerView::Parse(gpu->bytes);
  ASSERT_TRUE(cv.ok()) << cv.status();
  ASSERT_TRUE(gv.ok()) << "the CUDA blob does not parse: " << gv.status();
  ExpectBytesEqual(&cv->header(), &gv->header(), sizeof(LayerHeader), "header");
  ASSERT_EQ(cv->blob().size(), gv->blob().size()) << "blob size";

  // Token selections: equal, or different only among tied scores.
  std::vector<float> scores;
  std::vector<bool> same_tokens(sh.num_kv_heads, true);
  for (int h = 0; h < sh.num_kv_heads; ++h) {
    ExpectBytesEqual(&cv->desc(h), &gv->desc(h), sizeof(HeadDesc), absl::StrCat("desc ", h));
    const auto a = HeadPositions(*cv, h), b = HeadPositions(*gv, h);
    if (a == b) continue;
    same_tokens[h] = false;
    if (scores.empty()) {
      scores = ScoreTokens(host_in, spec.eviction).value();
      if (spec.eviction.granularity == Granularity::kPerLayer) {
        for (int hh = 1; hh < sh.num_kv_heads; ++hh) {
          for (int j = 0; j < sh.seq_len; ++j) {
            scores[j] += scores[static_cast<size_t>(hh) * sh.seq_len + j];
          }
        }
      }
    }
    const int row = spec.eviction.granularity == Granularity::kPerLayer ? 0 : h;
    std::string why;
    EXPECT_TRUE(DifferencesAreTies(a, b, scores.data() + static_cast<size_t>(row) * sh.seq_len,
                                   sh.seq_len, &why))
        << "head " << h << ": kept sets differ beyond ties: " << why;
  }
  // Channel selections (on the heads whose tokens agree): equal, or different only among ties of
  // the double-precision reference.
  int tied_heads = 0, partial_rows = 0;
  for (int h = 0; h < sh.num_kv_heads; ++h) {
    const CompactHead a = cv->head(h), b = gv->head(h);
    const bool keys_equal = a.key_channels == b.key_channels &&
                            std::equal(a.key_idx, a.key_idx + a.key_channels, b.key_idx);
    const bool values_equal = a.value_channels == b.value_channels &&
                              std::equal(a.value_idx, a.value_idx + a.value_channels, b.value_idx);
    const bool same_channels = keys_equal && values_equal;
    if (!same_tokens[h]) {
      ++tied_heads;
      partial_rows += ComparePartialHead(*cv, *gv, h, layer.dtype, same_channels);
      continue;
    }
    if (same_channels) {
      CompareHead(*cv, *gv, h, layer.dtype, options.allow_nan);
      continue;
    }
    ++tied_heads;
    const std::vector<double> ks = ReferenceChannelScores(layer, spec, *cv, h, false);
    const std::vector<double> vs = ReferenceChannelScores(layer, spec, *cv, h, true);
    std::string why;
    EXPECT_TRUE(ChannelDifferencesAreTies(a.key_idx, b.key_idx, a.key_channels, ks, &why))
        << "head " << h << " key channels: " << why;
    EXPECT_TRUE(ChannelDifferencesAreTies(a.value_idx, b.value_idx, a.value_channels, vs, &why))
        << "head " << h << " value channels: " << why;
    partial_rows += ComparePartialHead(*cv, *gv, h, layer.dtype, false);
  }
  if (tied_heads > 0) {
    std::printf("note: %s: %d of %d heads broke ties differently; %d of their rows compared\n",
                name.c_str(), tied_heads, sh.num_kv_heads, partial_rows);
  }
  // Decode attention over each blob, by both backends: comparable whatever the selections.
  CompareAttention(*cv, sh.num_q_heads, options);
  CompareAttention(*gv, sh.num_q_heads, options);
}

}  // namespace kvc::gpu_testing

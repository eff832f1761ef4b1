// RotateKeys / ExportDenseContiguous (kvc/contiguous_export.h): turning stored post-RoPE keys by
// -shift gives the keys RoPE would have produced at position - shift, for both pair conventions,
// partial rotary dims and linear scaling; channels past rotary_dims and the values stay as they
// were; bad RoPE parameters are INVALID_ARGUMENT naming the field.
#include "kvc/contiguous_export.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/export_pieces_util.h"
#include "kernels/isa_util.h"
#include "kernels/pack_util.h"
#include "kvc/dtype.h"
#include "kvc/selection.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

// Reference RoPE in double of one row at `pos`.
std::vector<double> Rope(const std::vector<double>& x, double pos, const RopeParams& r) {
  const int d = static_cast<int>(x.size());
  const int rd = r.rotary_dims == 0 ? d : r.rotary_dims, half = rd / 2;
  std::vector<double> out = x;
  for (int p = 0; p < half; ++p) {
    const double a = pos / r.linear_factor * std::pow(r.theta, -2.0 * p / rd);
    const int i0 = r.half_split ? p : 2 * p, i1 = r.half_split ? p + half : 2 * p + 1;
    out[i0] = x[i0] * std::cos(a) - x[i1] * std::sin(a);
    out[i1] = x[i0] * std::sin(a) + x[i1] * std::cos(a);
  }
  return out;
}

struct Fixture {
  DenseLayer layer;
  std::vector<std::vector<double>> raw;  // un-rotated rows
  std::vector<int> pos;                  // each row's original position
};

// Keys = RoPE(raw, original position) stored in `dtype`; values a copy of the keys.
Fixture Make(const RopeParams& r, DType dtype, int heads, int kept, int d, int seq_len) {
  Fixture f;
  f.layer.num_kv_heads = heads;
  f.layer.n_kept = kept;
  f.layer.head_dim = d;
  f.layer.seq_len = seq_len;
  f.layer.dtype = dtype;
  const size_t n = static_cast<size_t>(heads) * kept * d;
  f.layer.k.resize(n * DTypeSize(dtype));
  f.layer.v.resize(n * DTypeSize(dtype));
  std::mt19937 rng(3);
  std::normal_distribution<double> g;
  for (int h = 0; h < heads; ++h) {
    for (int j = 0; j < kept; ++j) {
      std::vector<double> x(d);
      for (double& e : x) e = g(rng);
      const int pos = j * (seq_len / kept) + h;  // spread over the prompt, differing per head
      const std::vector<double> k = Rope(x, pos, r);
      const size_t row = (static_cast<size_t>(h) * kept + j) * d;
      for (int c = 0; c < d; ++c) {
        StoreFromFloat(f.layer.k.data(), dtype, row + c, static_cast<float>(k[c]));
        StoreFromFloat(f.layer.v.data(), dtype, row + c, static_cast<float>(k[c]));
      }
      f.raw.push_back(x);
      f.pos.push_back(pos);
    }
  }
  return f;
}

class RotateKeysTest : public ::testing::TestWithParam<bool> {};

TEST_P(RotateKeysTest, MovesKeysToTheShiftedPosition) {
  for (const int rotary_dims : {0, 8}) {
    for (const double factor : {1.0, 4.0}) {
      RopeParams r;
      r.theta = 500000;
      r.rotary_dims = rotary_dims;
      r.half_split = GetParam();
      r.linear_factor = factor;
      const int d = 16, kept = 12, seq_len = 300, shift = seq_len - kept;
      Fixture f = Make(r, DType::kF32, 2, kept, d, seq_len);
      const std::vector<uint8_t> values(f.layer.v.data(), f.layer.v.data() + f.layer.v.size());
      ASSERT_TRUE(RotateKeys(r, shift, &f.layer).ok());
      for (size_t row = 0; row < f.raw.size(); ++row) {
        const std::vector<double> want = Rope(f.raw[row], f.pos[row] - shift, r);
        for (int c = 0; c < d; ++c) {
          EXPECT_NEAR(LoadAsFloat(f.layer.k.data(), DType::kF32, row * d + c), want[c], 1e-5)
              << "row " << row << " channel " << c << " rotary_dims " << rotary_dims;
        }
      }
      EXPECT_EQ(std::memcmp(values.data(), f.layer.v.data(), values.size()), 0);
    }
  }
}

TEST_P(RotateKeysTest, HalfPrecisionRoundsOnce) {
  for (const DType dt : {DType::kF16, DType::kBF16}) {
    RopeParams r;
    r.half_split = GetParam();
    const int d = 32, kept = 8, seq_len = 64;
    Fixture f = Make(r, dt, 1, kept, d, seq_len);
    ASSERT_TRUE(RotateKeys(r, seq_len - kept, &f.layer).ok());
    const double tol = dt == DType::kF16 ? 4e-3 : 3e-2;  // storage rounding, twice
    for (size_t row = 0; row < f.raw.size(); ++row) {
      const std::vector<double> want = Rope(f.raw[row], f.pos[row] - (seq_len - kept), r);
      for (int c = 0; c < d; ++c) {
        EXPECT_NEAR(LoadAsFloat(f.layer.k.data(), dt, row * d + c), want[c],
                    tol * (1 + std::abs(want[c])))
            << DTypeName(dt);
      }
    }
  }
}

// The computation RotateKeys is defined by, element by element: each pair in double from the
// stored values, rounded to float, then stored in the dtype.
void RotateKeysByElement(const RopeParams& r, int shift, DenseLayer* layer) {
  const int d = layer->head_dim, rd = r.rotary_dims == 0 ? d : r.rotary_dims, half = rd / 2;
  const size_t rows = static_cast<size_t>(layer->num_kv_heads) * layer->n_kept;
  for (size_t row = 0; row < rows; ++row) {
    for (int p = 0; p < half; ++p) {
      const double a = -static_cast<double>(shift) / r.linear_factor * std::pow(r.theta,
                                                                                -2.0 * p / rd);
      const size_t i0 = row * d + (r.half_split ? p : 2 * p);
      const size_t i1 = row * d + (r.half_split ? p + half : 2 * p + 1);
      const double x0 = LoadAsFloat(layer->k.data(), layer->dtype, i0);
      const double x1 = LoadAsFloat(layer->k.data(), layer->dtype, i1);
      StoreFromFloat(layer->k.data(), layer->dtype, i0,
                     static_cast<float>(x0 * std::cos(a) - x1 * std::sin(a)));
      StoreFromFloat(layer->k.data(), layer->dtype, i1,
                     static_cast<float>(x0 * std::sin(a) + x1 * std::cos(a)));
    }
  }
}

// Both ways of turning rows (the fused kernels in registers where the rotary channels come in
// groups of eight, float buffers otherwise) give the element-by-element result bit for bit: every
// dtype, partial rotary dims that fit the fused kernels (48) and that do not (20), a row count
// that is not a multiple of the buffer's block, on each of the rotation's builds (the CPU's best,
// AVX2, portable). Some rows hold arbitrary bit patterns (subnormals, values that overflow the
// dtype once turned, infinities, NaN: a NaN need only stay NaN).
TEST_P(RotateKeysTest, BlocksEqualTheElementByElementComputation) {
  for (const CpuIsa cap : {kBestCpuIsa, CpuIsa::kAvx2, CpuIsa::kPortable}) {
    const testing_isa::ScopedIsaCap scoped(cap);
    for (const DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
      for (const int rotary_dims : {0, 48, 20}) {
        RopeParams r;
        r.theta = 500000;
        r.rotary_dims = rotary_dims;
        r.half_split = GetParam();
        r.linear_factor = rotary_dims == 0 ? 1.0 : 2.0;
        const int d = 64, kept = 301, seq_len = 5000;
        Fixture a = Make(r, dt, 3, kept, d, seq_len);
        std::mt19937 rng(7);
        const size_t esize = DTypeSize(dt), row_bytes = d * esize;
        for (size_t row = 0; row < a.raw.size(); row += 5) {
          for (size_t b = 0; b < row_bytes; ++b) a.layer.k[row * row_bytes + b] = rng() & 0xff;
        }
        Fixture b = a;
        ASSERT_TRUE(RotateKeys(r, seq_len - kept, &a.layer).ok());
        RotateKeysByElement(r, seq_len - kept, &b.layer);
        ASSERT_EQ(a.layer.k.size(), b.layer.k.size());
        EXPECT_EQ(testing_pack::ElementsDiffering(a.layer.k.data(), b.layer.k.data(), dt,
                                                  a.layer.k.size() / esize),
                  0u)
            << DTypeName(dt) << " rotary_dims " << rotary_dims << " " << CpuIsaName(cap);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Pairs, RotateKeysTest, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "HalfSplit" : "Interleaved"; });

// The keys-only export from the blob's runs (what GetCache sends with V and positions from the
// blob) is ExportDenseContiguous's keys byte for byte: every dtype, both pair conventions,
// partial rotary dims, a layer kept whole (no turn) and evicted ones. So is
// ExportDenseKeysContiguous's, on those layers and on ones with key channels pruned.
TEST(ExportKeysContiguousTest, EqualsTheFullExportsKeys) {
  std::mt19937 rng(5);
  int compared = 0;
  for (const DType dt : {DType::kF32, DType::kF16, DType::kBF16}) {
    for (const bool half_split : {false, true}) {
      for (const int budget : {64, 23}) {
        SCOPED_TRACE(testing::Message() << DTypeName(dt) << " half_split " << half_split
                                        << " kept " << budget);
        const testing_pack::PackLayerData layer =
            testing_pack::MakePackLayer(3, 64, 32, dt, Layout::kHND, 4);
        const TokenSelection tokens = testing_pack::RandomTokens(3, 64, budget, &rng);
        const ChannelSelection channels = testing_pack::RandomChannels(3, 32, 32, 32, &rng);
        absl::StatusOr<CompactLayer> packed =
            PackLayer(layer.input(), tokens, channels, CompressionSpec{});
        ASSERT_TRUE(packed.ok()) << packed.status();
        absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
        ASSERT_TRUE(view.ok());
        DenseRuns runs;
        ASSERT_TRUE(DenseRunsOf(*view, &runs));
        RopeParams r;
        r.theta = 10000;
        r.half_split = half_split;
        r.rotary_dims = budget == 23 ? 16 : 0;
        absl::StatusOr<DenseLayer> full = ExportDenseContiguous(*view, r);
        absl::StatusOr<DenseLayer> keys = ExportKeysContiguous(*view, runs, r);
        ASSERT_TRUE(full.ok() && keys.ok());
        // Piece by piece (what GetCache sends from while the rest is written): each head's keys
        // turned as they are written, finished in order, the bytes of the one-shot exports.
        for (const bool keys_only : {false, true}) {
          absl::StatusOr<DenseExporter> ex = MakeContiguousExporter(*view, r, keys_only);
          ASSERT_TRUE(ex.ok());
          absl::StatusOr<DenseLayer> want =
              keys_only ? ExportDenseKeysContiguous(*view, r) : ExportDenseContiguous(*view, r);
          ASSERT_TRUE(want.ok());
          testing_pack::ExpectPiecesFinishPrefixes(*std::move(ex), *want);
        }
        absl::StatusOr<DenseExporter> from_runs = MakeKeysContiguousExporter(*view, runs, r);
        ASSERT_TRUE(from_runs.ok());
        EXPECT_EQ(from_runs->pieces(), 3);
        testing_pack::ExpectPiecesFinishPrefixes(*std::move(from_runs), *keys);
        EXPECT_EQ(keys->n_kept, full->n_kept);
        ASSERT_EQ(keys->k.size(), full->k.size());
        EXPECT_EQ(std::memcmp(keys->k.data(), full->k.data(), full->k.size()), 0);
        EXPECT_TRUE(keys->v.empty() && keys->positions.empty());
        // The keys alone exported and turned (what GetCache sends beside a key-pruned layer's
        // value runs; here with half the key channels pruned too): the full export's keys.
        const ChannelSelection pruned = testing_pack::RandomChannels(3, 32, 16, 32, &rng);
        absl::StatusOr<CompactLayer> pruned_packed =
            PackLayer(layer.input(), tokens, pruned, CompressionSpec{});
        ASSERT_TRUE(pruned_packed.ok()) << pruned_packed.status();
        for (const auto* blob : {&packed->bytes, &pruned_packed->bytes}) {
          absl::StatusOr<CompactLayerView> v = CompactLayerView::Parse(*blob);
          ASSERT_TRUE(v.ok());
          absl::StatusOr<DenseLayer> whole = ExportDenseContiguous(*v, r);
          absl::StatusOr<DenseLayer> alone = ExportDenseKeysContiguous(*v, r);
          ASSERT_TRUE(whole.ok() && alone.ok());
          EXPECT_EQ(alone->k, whole->k);
          EXPECT_TRUE(alone->v.empty() && alone->positions.empty());
        }
        ++compared;
      }
    }
  }
  EXPECT_EQ(compared, 12);
  // Runs that are not the view's: refused, nothing read past them.
  const testing_pack::PackLayerData layer =
      testing_pack::MakePackLayer(2, 16, 16, DType::kF16, Layout::kHND, 4);
  std::mt19937 rng2(1);
  absl::StatusOr<CompactLayer> packed =
      PackLayer(layer.input(), testing_pack::RandomTokens(2, 16, 8, &rng2),
                testing_pack::RandomChannels(2, 16, 16, 16, &rng2), CompressionSpec{});
  ASSERT_TRUE(packed.ok());
  absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(packed->bytes);
  ASSERT_TRUE(view.ok());
  DenseRuns runs;
  ASSERT_TRUE(DenseRunsOf(*view, &runs));
  runs.k.pop_back();
  EXPECT_EQ(ExportKeysContiguous(*view, runs, RopeParams{}).status().code(),
            absl::StatusCode::kInternal);
  // Heads that keep different counts (head-adaptive budgets) have no contiguous layout: both the
  // whole export and the keys alone refuse them, naming the head.
  TokenSelection ragged;
  ragged.num_kv_heads = 2;
  ragged.budget = 6;
  ragged.counts = {6, 4};
  ragged.positions = {1, 5, 9, 11, 13, 15, 2, 3, 14, 15};
  absl::StatusOr<CompactLayer> uneven = PackLayer(
      layer.input(), ragged, testing_pack::RandomChannels(2, 16, 16, 16, &rng2), CompressionSpec{});
  ASSERT_TRUE(uneven.ok()) << uneven.status();
  absl::StatusOr<CompactLayerView> uneven_view = CompactLayerView::Parse(uneven->bytes);
  ASSERT_TRUE(uneven_view.ok());
  for (const auto& refused :
       {ExportDenseContiguous(*uneven_view, RopeParams{}),
        ExportDenseKeysContiguous(*uneven_view, RopeParams{})}) {
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(refused.status().message()),
                ::testing::HasSubstr("head 1 keeps 4 tokens but head 0 keeps 6"));
  }
}

TEST(RopeParamsTest, RejectsBadRope) {
  Fixture f = Make(RopeParams{}, DType::kF32, 1, 4, 16, 8);
  const std::vector<uint8_t> before(f.layer.k.data(), f.layer.k.data() + f.layer.k.size());
  struct Case {
    RopeParams r;
    const char* field;
  };
  std::vector<Case> cases(5);
  cases[0].r.theta = 0;
  cases[0].field = "rope.theta";
  cases[1].r.rotary_dims = 7;
  cases[1].field = "rope.rotary_dims";
  cases[2].r.rotary_dims = 18;
  cases[2].field = "rope.rotary_dims";
  cases[3].r.linear_factor = 0.5;
  cases[3].field = "rope.scaling_factor";
  cases[4].r.theta = NAN;
  cases[4].field = "rope.theta";
  for (const Case& c : cases) {
    absl::Status s = RotateKeys(c.r, 4, &f.layer);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.field));
  }
  // Nothing changed.
  EXPECT_EQ(std::memcmp(before.data(), f.layer.k.data(), before.size()), 0);
}

}  // namespace
}  // namespace kvc

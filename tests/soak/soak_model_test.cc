// The soak's verifier and ledger: a flipped byte, a mixed cache, a lossless blob that differs from
// the input are all caught, and the ledger allows exactly the legal versions.
#include "soak_model.h"

#include <functional>
#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kvc/compact.h"

namespace kvc::soak {
namespace {

std::unique_ptr<Backend> Cpu() {
  BackendOptions o;
  o.num_threads = 1;
  auto b = CreateCpuBackend(o);
  EXPECT_TRUE(b.ok()) << b.status();
  return *std::move(b);
}

CacheInfo InfoOf(const Version& v) {
  CacheInfo info;
  info.set_cache_id(v.id);
  *info.mutable_shape() = v.header.shape();
  info.set_dtype(v.header.dtype());
  *info.mutable_compression() = v.header.compression();
  info.set_checksum(v.checksum);
  for (const ByteVector& b : v.packed) {
    auto view = CompactLayerView::Parse(b);
    EXPECT_TRUE(view.ok());
    info.add_kept_tokens(view->desc(0).n_kept);
  }
  return info;
}

// What a correct kvcd serves for `v`.
CacheData Served(const Version& v, CacheFormat format) {
  CacheData d;
  d.info = InfoOf(v);
  for (int l = 0; l < v.num_layers; ++l) {
    LayerData layer;
    layer.layer = l;
    layer.kept_tokens = d.info.kept_tokens(l);
    if (format == CacheFormat::kPacked) {
      layer.packed = v.packed[l];
    } else {
      auto view = CompactLayerView::Parse(v.packed[l]);
      auto dense = ExportDense(*view);
      EXPECT_TRUE(dense.ok());
      layer.k = dense->k;
      layer.v = dense->v;
      layer.positions = dense->positions;
    }
    d.layers.push_back(std::move(layer));
  }
  return d;
}

// The first version drawn from seeds 1, 2, ... that satisfies `want`.
std::shared_ptr<const Version> Find(const std::string& id, Backend& backend,
                                    const std::function<bool(const Version&)>& want,
                                    uint64_t first_seed = 1) {
  ShapeLimits limits;
  limits.max_layers = 2;
  limits.max_tokens = 64;
  for (uint64_t seed = first_seed; seed < first_seed + 200; ++seed) {
    auto v = MakeVersion(id, seed, limits, backend);
    EXPECT_TRUE(v.ok()) << v.status();
    if (v.ok() && want(*v->version)) return v->version;
  }
  ADD_FAILURE() << "no version found";
  return nullptr;
}

TEST(SoakModelTest, VersionsAreDeterministicAndCoverTheSpecSpace) {
  auto backend = Cpu();
  ShapeLimits limits;
  limits.max_tokens = 64;
  auto a = MakeVersion("x", 7, limits, *backend);
  auto b = MakeVersion("x", 7, limits, *backend);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->version->Describe(), b->version->Describe());
  ASSERT_EQ(a->version->packed.size(), b->version->packed.size());
  for (size_t l = 0; l < a->version->packed.size(); ++l)
    EXPECT_EQ(a->version->packed[l], b->version->packed[l]);
  std::set<std::string> policies, dtypes;
  bool lossless = false, quantized = false, pruned = false, nhd = false;
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    auto v = MakeVersion("x", seed, limits, *backend);
    ASSERT_TRUE(v.ok()) << v.status();
    policies.insert(v->version->header.compression().eviction().policy());
    dtypes.insert(std::to_string(v->version->header.dtype()));
    lossless = lossless || v->version->lossless;
    quantized = quantized || v->version->spec.quant.bits > 0;
    pruned = pruned || v->version->spec.channels.key_lambda > 0;
    nhd = nhd || v->version->layout == Layout::kNHD;
    // Only lossless versions keep their input (for the input comparison).
    EXPECT_EQ(v->version->input != nullptr, v->version->lossless);
    EXPECT_NE(v->input, nullptr);
  }
  EXPECT_EQ(policies.size(), 7u);
  EXPECT_EQ(dtypes.size(), 3u);
  EXPECT_TRUE(lossless && quantized && pruned && nhd);
}

TEST(SoakModelTest, VerifyAcceptsCorrectBytesAndNamesAFlippedOne) {
  auto backend = Cpu();
  auto v = Find("a", *backend, [](const Version& v) { return !v.lossless; });
  ASSERT_NE(v, nullptr);
  for (CacheFormat f : {CacheFormat::kPacked, CacheFormat::kDense}) {
    GetOptions opt;
    opt.format = f;
    CacheData got = Served(*v, f);
    EXPECT_TRUE(Verify(*v, got, opt, true).ok()) << Verify(*v, got, opt, true);
    ByteVector& bytes = f == CacheFormat::kPacked ? got.layers.back().packed : got.layers.back().v;
    bytes[bytes.size() / 2] ^= 1;
    absl::Status s = Verify(*v, got, opt, true);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(s.message().find(absl::StrCat("byte ", bytes.size() / 2)), std::string::npos) << s;
  }
}

TEST(SoakModelTest, VerifyChecksTheRangeTheChecksumAndAMissingLayer) {
  auto backend = Cpu();
  auto v = Find("a", *backend, [](const Version& v) { return v.num_layers == 2; });
  ASSERT_NE(v, nullptr);
  GetOptions opt;
  CacheData got = Served(*v, CacheFormat::kPacked);
  got.layers.pop_back();
  EXPECT_EQ(Verify(*v, got, opt, /*complete=*/true).code(), absl::StatusCode::kDataLoss);
  EXPECT_TRUE(Verify(*v, got, opt, /*complete=*/false).ok());  // a cancelled download's prefix
  got = Served(*v, CacheFormat::kPacked);
  got.info.set_checksum(got.info.checksum() + 1);
  EXPECT_EQ(Verify(*v, got, opt, true).code(), absl::StatusCode::kDataLoss);
  opt.layer_begin = 1;
  got = Served(*v, CacheFormat::kPacked);
  got.layers.erase(got.layers.begin());
  EXPECT_TRUE(Verify(*v, got, opt, true).ok());
}

TEST(SoakModelTest, LosslessVersionsAreAlsoComparedWithTheInput) {
  auto backend = Cpu();
  auto v = Find("a", *backend, [](const Version& v) { return v.lossless; });
  ASSERT_NE(v, nullptr);
  Version tampered = *v;  // as if the engine and kvcd agreed on bytes that are not the input
  auto input = std::make_shared<Version::Input>(*v->input);
  input->k[0][3] ^= 0x40;
  tampered.input = input;
  for (CacheFormat f : {CacheFormat::kPacked, CacheFormat::kDense}) {
    GetOptions opt;
    opt.format = f;
    EXPECT_TRUE(Verify(*v, Served(*v, f), opt, true).ok());
    absl::Status s = Verify(tampered, Served(*v, f), opt, true);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_NE(s.message().find("input"), std::string::npos) << s;
  }
}

TEST(SoakModelTest, MatchPicksTheRightVersionAndCallsAMixAMix) {
  auto backend = Cpu();
  auto two = [](const Version& v) { return v.num_layers == 2; };
  auto a = Find("race/0", *backend, two, 1);
  ASSERT_NE(a, nullptr);
  auto b = Find("race/0", *backend, two, a->seed + 1);
  ASSERT_NE(b, nullptr);
  GetOptions opt;
  auto m = Match({a, b}, Served(*b, CacheFormat::kPacked), opt, true);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(*m, b);
  CacheData mix = Served(*a, CacheFormat::kPacked);
  mix.layers[1] = Served(*b, CacheFormat::kPacked).layers[1];
  m = Match({a, b}, mix, opt, true);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(m.status().message().find("MIXED"), std::string::npos) << m.status();
  EXPECT_FALSE(Match({}, Served(*a, CacheFormat::kPacked), opt, true).ok());
}

std::shared_ptr<const Version> Named(const std::string& id, uint64_t seed) {
  auto v = std::make_shared<Version>();
  v->id = id;
  v->seed = seed;
  return v;
}

// What a GetCache of `id` that starts and ends now may return.
std::vector<std::shared_ptr<const Version>> Fresh(Ledger& ledger, const std::string& id) {
  const uint64_t start = ledger.Tick();
  const uint64_t end = ledger.Tick();
  return ledger.Candidates(id, start, end);
}

TEST(SoakModelTest, LedgerAllowsExactlyTheLegalVersions) {
  Ledger ledger;
  using Vs = std::vector<std::shared_ptr<const Version>>;
  auto a = Named("x", 1), b = Named("x", 2), c = Named("x", 3), d = Named("x", 4);
  uint64_t s = ledger.Tick();
  uint64_t h = ledger.BeginPut(a, s);
  EXPECT_EQ(Fresh(ledger, "x"), Vs{a});  // in flight
  ledger.EndPut("x", h, true, true, ledger.Tick());
  const uint64_t get_before_b = ledger.Tick();  // a get that starts now and ends after b
  h = ledger.BeginPut(b, ledger.Tick());
  ledger.EndPut("x", h, true, true, ledger.Tick());
  EXPECT_EQ(ledger.Candidates("x", get_before_b, ledger.Tick()), (Vs{a, b}));
  EXPECT_EQ(Fresh(ledger, "x"), Vs{b});  // a is overwritten
  // An upload that surely failed is never a candidate; one that may have landed stays one.
  h = ledger.BeginPut(c, ledger.Tick());
  ledger.EndPut("x", h, false, /*maybe_stored=*/false, ledger.Tick());
  h = ledger.BeginPut(d, ledger.Tick());
  ledger.EndPut("x", h, false, /*maybe_stored=*/true, ledger.Tick());
  EXPECT_EQ(Fresh(ledger, "x"), (Vs{b, d}));
  // A delete empties the id; a later get may only see NOT_FOUND.
  s = ledger.Tick();
  ledger.Deleted("x", s, ledger.Tick());
  EXPECT_TRUE(Fresh(ledger, "x").empty());
  // A restart wipes everything stored before it.
  h = ledger.BeginPut(a, ledger.Tick());
  ledger.EndPut("x", h, true, true, ledger.Tick());
  ledger.Wiped(ledger.Tick());
  EXPECT_TRUE(Fresh(ledger, "x").empty());
  // Other ids are untouched by all this.
  EXPECT_TRUE(ledger.Candidates("y", 0, ledger.Tick()).empty());
}

TEST(SoakModelTest, LedgerKeepsWhatARunningGetMaySeeAndForgetsTheRest) {
  Ledger ledger;
  auto a = Named("x", 1), b = Named("x", 2), c = Named("x", 3);
  uint64_t h = ledger.BeginPut(a, ledger.Tick());
  ledger.EndPut("x", h, true, true, ledger.Tick());
  const uint64_t get = ledger.BeginGet();  // a long download of a
  h = ledger.BeginPut(b, ledger.Tick());
  ledger.EndPut("x", h, true, true, ledger.Tick());
  h = ledger.BeginPut(c, ledger.Tick());
  ledger.EndPut("x", h, true, true, ledger.Tick());
  auto seen = ledger.Candidates("x", get, ledger.Tick());
  EXPECT_EQ(seen.size(), 3u);  // a, b and c were each the content at some point of the get
  ledger.EndGet(get);
  h = ledger.BeginPut(a, ledger.Tick());
  ledger.EndPut("x", h, false, false, ledger.Tick());  // any later op prunes
  EXPECT_EQ(ledger.RecordsForTesting(), 1u);           // only c can still be served
}

}  // namespace
}  // namespace kvc::soak

// The fidelity tool's pieces that need no model: option checks, the default sweep, CSV/table
// formatting, the PNG encoder (decoded back with zlib) and the plot renderer.
#include "kvc/fidelity/report.h"

#include <zlib.h>

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/fidelity/png.h"

namespace kvc::fidelity {
namespace {

using ::testing::HasSubstr;

uint32_t Be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}

TEST(RunOptionsTest, ValidatesEveryField) {
  model::LlamaConfig c;
  c.seq_len = 512;
  RunOptions ok;
  EXPECT_TRUE(ValidateRunOptions(ok, c).ok());
  RunOptions o = ok;
  o.num_sequences = 0;
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("num_sequences: 0"));
  o = ok;
  o.prefix_len = 0;
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("prefix_len: 0"));
  o = ok;
  o.continuation = 0;
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("continuation: 0"));
  o = ok;
  o.obs_window = 257;
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("obs_window: 257"));
  o = ok;
  o.obs_window = -1;
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("obs_window: -1"));
  o = ok;
  o.prefix_len = 500;
  o.continuation = 13;
  EXPECT_THAT(ValidateRunOptions(o, c).message(),
              HasSubstr("500 + 13 exceeds the model's seq_len 512"));
  o.continuation = 12;  // exactly the context
  EXPECT_TRUE(ValidateRunOptions(o, c).ok());
  o = ok;
  o.temperature = -0.5f;
  EXPECT_THAT(ValidateRunOptions(o, c).message(), HasSubstr("temperature: -0.5"));
}

TEST(SweepTest, QuantGroupDefaultsAndMustDivideHeadDim) {
  EXPECT_EQ(*ResolveQuantGroup(0, 8), 8);
  EXPECT_EQ(*ResolveQuantGroup(0, 128), 32);
  EXPECT_EQ(*ResolveQuantGroup(4, 8), 4);
  EXPECT_THAT(ResolveQuantGroup(32, 8).status().message(),
              HasSubstr("quant_group: 32 must divide head_dim 8"));
  EXPECT_EQ(*ResolveQuantGroup(0, 24), 24);  // min(32, 24) divides 24
  EXPECT_THAT(ResolveQuantGroup(0, 48).status().message(),
              HasSubstr("quant_group: 32 must divide head_dim 48"));
  EXPECT_THAT(ResolveQuantGroup(-1, 8).status().message(), HasSubstr("quant_group: -1"));
}

TEST(SweepTest, DefaultSweepCoversPoliciesThinkAndQuant) {
  const std::vector<SweepEntry> sweep = DefaultSweep(8);
  ASSERT_EQ(sweep.size(), 6u * 4 + 2 + 2 + 6 + 18);
  EXPECT_EQ(sweep[0].label, "streaming:1");
  EXPECT_EQ(sweep[0].series, "streaming");
  EXPECT_EQ(sweep[23].label, "random:0.25");
  EXPECT_EQ(sweep[24].label, "snapkv:0.5+think:0.25");
  EXPECT_EQ(sweep[24].family, "think");
  EXPECT_EQ(sweep[24].series, "snapkv:*+think:0.25");
  EXPECT_EQ(sweep[24].spec.channels.key_policy, ChannelPolicy::kThink);
  EXPECT_EQ(sweep[27].label, "q2g8");
  EXPECT_EQ(sweep[27].family, "quant");
  EXPECT_EQ(sweep[27].series, "q2g8");
  EXPECT_EQ(sweep[27].spec.quant.group_size, 8);
  EXPECT_EQ(sweep[27].spec.eviction.policy, EvictionPolicy::kNone);
  EXPECT_EQ(sweep[28].label, "h2o:0.5,ada=0.2");
  EXPECT_TRUE(sweep[28].spec.eviction.adaptive);
  EXPECT_EQ(sweep[34].label, "h2o:0.5,value=mul");
  EXPECT_EQ(sweep.back().label, "keydiff:0.25");
}

std::vector<SweepResult> SampleResults() {
  std::vector<SweepResult> r;
  const std::vector<SweepEntry> sweep = DefaultSweep(8);
  for (size_t i = 0; i < sweep.size(); ++i) {
    Metrics m;
    m.steps = 10;
    m.top1_agreement = sweep[i].keep_ratio;  // a recognisable value per row
    m.mean_kl = 0.125 * i;
    m.attn_rel_err = {0.1, 0.2};
    m.mean_attn_rel_err = 0.15;
    m.size_ratio = 0.9 * sweep[i].keep_ratio + 0.01 * static_cast<double>(i % 3);
    r.push_back({sweep[i], m});
  }
  return r;
}

TEST(ReportTest, CsvHasOneRowPerResultAndEveryColumn) {
  const std::string csv = FormatCsv(SampleResults());
  std::vector<std::string> lines = absl::StrSplit(csv, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 1u + DefaultSweep(8).size());
  const size_t columns = std::vector<std::string>(absl::StrSplit(lines[0], ',')).size();
  EXPECT_EQ(columns, 24u + 2);
  EXPECT_THAT(lines[0], HasSubstr(",scenario,"));
  EXPECT_THAT(lines[0], HasSubstr(",seeds,sequences,steps,obs_window,bytes,full_bytes,"));
  EXPECT_THAT(lines[0], HasSubstr(",top1_sd,top1_ci_lo,top1_ci_hi,"));
  for (std::string line : lines) {
    // Spec-string labels with commas are quoted: drop the quoted part before counting.
    if (line[0] == '"') {
      ASSERT_NE(line.find("\","), std::string::npos) << line;
      line = "label" + line.substr(line.find("\","));
    }
    EXPECT_EQ(std::vector<std::string>(absl::StrSplit(line, ',')).size(), columns) << line;
  }
  EXPECT_THAT(lines[3], HasSubstr("streaming:0.5,inside,eviction,streaming,0.5000,"));
  const std::string table = FormatTable(SampleResults());
  EXPECT_THAT(table, HasSubstr("h2o:0.75"));
  EXPECT_THAT(table, HasSubstr("q4g8"));
}

TEST(ReportTest, CsvQuotesLabelsWithCommas) {
  SweepResult r;
  r.entry = EntryForSpec(*ParseSpecString("snapkv:0.25,kernel=5,pool=avg"));
  r.metrics.attn_rel_err = {0.1};
  const std::string row = FormatCsvRow(r, 1);
  EXPECT_EQ(row.rfind("\"snapkv:0.25,kernel=5,pool=avg\",inside,", 0), 0u) << row;
  EXPECT_EQ(FormatTableRow(r).rfind("snapkv:0.25,kernel=5,pool=avg", 0), 0u);
}

// Decodes our own PNG: signature, chunk CRCs, IHDR, inflated scanlines.
std::vector<uint8_t> DecodePng(const std::vector<uint8_t>& png, int* w, int* h) {
  static const uint8_t kSig[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  EXPECT_EQ(std::memcmp(png.data(), kSig, 8), 0);
  size_t at = 8;
  std::vector<uint8_t> idat;
  std::vector<std::string> types;
  while (at + 12 <= png.size()) {
    const uint32_t len = Be32(&png[at]);
    const std::string type(reinterpret_cast<const char*>(&png[at + 4]), 4);
    types.push_back(type);
    const uLong crc = crc32(0L, &png[at + 4], 4 + len);
    EXPECT_EQ(Be32(&png[at + 8 + len]), static_cast<uint32_t>(crc)) << type;
    if (type == "IHDR") {
      *w = static_cast<int>(Be32(&png[at + 8]));
      *h = static_cast<int>(Be32(&png[at + 12]));
      EXPECT_EQ(png[at + 16], 8);  // bit depth
      EXPECT_EQ(png[at + 17], 2);  // truecolor
    }
    if (type == "IDAT") idat.insert(idat.end(), &png[at + 8], &png[at + 8 + len]);
    at += 12 + len;
  }
  EXPECT_EQ(at, png.size());
  EXPECT_THAT(types, ::testing::ElementsAre("IHDR", "IDAT", "IEND"));
  uLongf raw_size = static_cast<uLongf>(*h) * (1 + 3 * *w);
  std::vector<uint8_t> raw(raw_size);
  EXPECT_EQ(uncompress(raw.data(), &raw_size, idat.data(), idat.size()), Z_OK);
  std::vector<uint8_t> rgb;
  for (int y = 0; y < *h; ++y) {
    EXPECT_EQ(raw[y * (1 + 3 * *w)], 0);  // filter None
    rgb.insert(rgb.end(), &raw[y * (1 + 3 * *w) + 1], &raw[(y + 1) * (1 + 3 * *w)]);
  }
  return rgb;
}

TEST(PngTest, EncodesPixelsExactly) {
  Image img(7, 3, {10, 20, 30});
  img.Set(0, 0, {255, 0, 0});
  img.Set(6, 2, {0, 255, 1});
  img.Set(7, 0, {1, 1, 1});   // outside: ignored
  img.Set(-1, 1, {1, 1, 1});  // outside: ignored
  auto png = EncodePng(img);
  ASSERT_TRUE(png.ok());
  int w = 0, h = 0;
  EXPECT_EQ(DecodePng(*png, &w, &h), img.pixels());
  EXPECT_EQ(w, 7);
  EXPECT_EQ(h, 3);
  EXPECT_EQ(img.At(0, 0), (Rgb{255, 0, 0}));
  EXPECT_EQ(img.At(6, 2), (Rgb{0, 255, 1}));
  EXPECT_EQ(img.At(1, 1), (Rgb{10, 20, 30}));
}

TEST(PngTest, WriteReportsUnwritablePaths) {
  Image img(2, 2, {});
  absl::Status s = WritePng(img, "/nonexistent-dir/x.png");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("/nonexistent-dir/x.png"));
}

int CountColor(const Image& img, Rgb c, int x0 = 0, int y0 = 0, int x1 = -1, int y1 = -1) {
  if (x1 < 0) x1 = img.width() - 1;
  if (y1 < 0) y1 = img.height() - 1;
  int n = 0;
  for (int y = y0; y <= y1; ++y) {
    for (int x = x0; x <= x1; ++x) n += img.At(x, y) == c;
  }
  return n;
}

TEST(FontTest, GlyphsAreDistinctAndTextIsDrawn) {
  EXPECT_EQ(Glyph('a'), Glyph('A'));
  EXPECT_NE(Glyph('A'), Glyph('B'));
  EXPECT_EQ(Glyph('~'), Glyph('?'));  // not in the font
  Image img(100, 20, {255, 255, 255});
  img.Text(1, 1, "L", {0, 0, 0}, 2);
  // 'L' is 7 pixels of stem plus 4 more of foot, each a 2x2 block.
  EXPECT_EQ(CountColor(img, {0, 0, 0}), (7 + 4) * 4);
  EXPECT_EQ(Image::TextWidth("abc", 2), 36);
  Image v(20, 100, {255, 255, 255});
  v.TextVertical(1, 90, "L", {0, 0, 0}, 1);
  EXPECT_EQ(CountColor(v, {0, 0, 0}), 11);
}

TEST(PlotTest, DrawsEverySeriesAndLegend) {
  const std::vector<SweepResult> results = SampleResults();
  const std::vector<PlotSpec> panels = AgreementPlots(results, "title");
  ASSERT_EQ(panels.size(), 1u);
  const PlotSpec& spec = panels[0];
  // Every row is drawn: 6 eviction series, 2 ThinK series, 2 quantization points, then 3
  // head-adaptive, 6 value-aware, 2 expected-attention series and KeyDiff.
  ASSERT_EQ(spec.series.size(), 6u + 2 + 2 + 3 + 6 + 2 + 1);
  EXPECT_EQ(spec.series[0].name, "streaming");
  EXPECT_EQ(spec.series[6].name, "snapkv:*+think:0.25");
  EXPECT_EQ(spec.series[9].name, "q2g8");
  ASSERT_EQ(spec.series[0].points.size(), 4u);
  EXPECT_NEAR(spec.series[0].points.front().first, 0.9 * 0.25, 0.03);  // sorted by x (size)
  EXPECT_EQ(spec.series[0].points.front().second, 0.25);
  const Image img = RenderLinePlot(spec);
  // Each series has its own palette color: markers + line + legend swatch.
  const Rgb first{31, 119, 180}, sixth{140, 86, 75};
  EXPECT_GT(CountColor(img, first), 50);
  EXPECT_GT(CountColor(img, sixth), 50);
  // Title, tick labels and axes are black.
  EXPECT_GT(CountColor(img, {0, 0, 0}, 0, 0, img.width() - 1, 40), 20);
  EXPECT_GT(CountColor(img, {0, 0, 0}), 500);
  // A degenerate range does not crash; it says so.
  // Legend rows for all 10 series fit in the image.
  EXPECT_GE(img.height(), 50 + 10 * 24);
  PlotSpec bad = spec;
  bad.x_max = bad.x_min;
  const Image msg = RenderLinePlot(bad);
  EXPECT_GT(CountColor(msg, {0, 0, 0}), 0);
  EXPECT_EQ(CountColor(msg, first), 0);
}

}  // namespace
}  // namespace kvc::fidelity

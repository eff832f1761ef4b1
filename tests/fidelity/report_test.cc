// The fidelity tool's pieces that need no model: option checks, the default sweep, CSV/table
// formatting, the plots, and their PNG (rendered by rsvg-convert, decoded back here with zlib).
#include "kvc/fidelity/report.h"

#include <unistd.h>
#include <zlib.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/fidelity/fidelity.h"

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
    SweepResult row;
    row.entry = sweep[i];
    row.metrics = m;
    r.push_back(row);
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

// Decodes a PNG as rsvg-convert writes it: signature, chunk CRCs, IHDR (8-bit RGB or RGBA, not
// interlaced), the IDAT chunks inflated and unfiltered (None, Sub, Up, Average, Paeth). Returns
// RGB pixels; alpha, when present, must be opaque.
std::vector<uint8_t> DecodePng(const std::vector<uint8_t>& png, int* w, int* h) {
  static const uint8_t kSig[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  EXPECT_GE(png.size(), 8u);
  EXPECT_EQ(std::memcmp(png.data(), kSig, 8), 0);
  size_t at = 8;
  int channels = 0;
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
      EXPECT_TRUE(png[at + 17] == 2 || png[at + 17] == 6) << int{png[at + 17]};  // RGB(A)
      channels = png[at + 17] == 6 ? 4 : 3;
      EXPECT_EQ(png[at + 20], 0);  // not interlaced
    }
    if (type == "IDAT") idat.insert(idat.end(), &png[at + 8], &png[at + 8 + len]);
    at += 12 + len;
  }
  EXPECT_EQ(at, png.size());
  EXPECT_FALSE(types.empty());
  if (types.empty() || channels == 0) return {};
  EXPECT_EQ(types.front(), "IHDR");
  EXPECT_EQ(types.back(), "IEND");
  const size_t stride = static_cast<size_t>(*w) * channels;
  uLongf raw_size = static_cast<uLongf>(*h) * (1 + stride);
  std::vector<uint8_t> raw(raw_size);
  EXPECT_EQ(uncompress(raw.data(), &raw_size, idat.data(), idat.size()), Z_OK);
  std::vector<uint8_t> pix(static_cast<size_t>(*h) * stride), rgb;
  for (int y = 0; y < *h; ++y) {
    const uint8_t filter = raw[y * (1 + stride)];
    const uint8_t* in = &raw[y * (1 + stride) + 1];
    uint8_t* out = &pix[y * stride];
    const uint8_t* up = y > 0 ? &pix[(y - 1) * stride] : nullptr;
    for (size_t i = 0; i < stride; ++i) {
      const int a = i >= static_cast<size_t>(channels) ? out[i - channels] : 0;
      const int b = up != nullptr ? up[i] : 0;
      const int c = up != nullptr && i >= static_cast<size_t>(channels) ? up[i - channels] : 0;
      int pred = 0;
      switch (filter) {
        case 0:
          pred = 0;
          break;
        case 1:
          pred = a;
          break;
        case 2:
          pred = b;
          break;
        case 3:
          pred = (a + b) / 2;
          break;
        case 4: {
          const int p = a + b - c, pa = std::abs(p - a), pb = std::abs(p - b), pc = std::abs(p - c);
          pred = pa <= pb && pa <= pc ? a : (pb <= pc ? b : c);
          break;
        }
        default:
          ADD_FAILURE() << "filter " << int{filter};
      }
      out[i] = static_cast<uint8_t>(in[i] + pred);
    }
  }
  for (size_t i = 0; i < pix.size(); i += channels) {
    rgb.insert(rgb.end(), &pix[i], &pix[i] + 3);
    if (channels == 4) {
      EXPECT_EQ(pix[i + 3], 255) << "pixel " << i / channels;
    }
  }
  return rgb;
}

// Pixels of colour (r, g, b) in rows [y0, y1) of an RGB image `w` wide.
int CountColor(const std::vector<uint8_t>& rgb, int w, std::array<uint8_t, 3> c, int y0, int y1) {
  int n = 0;
  for (size_t i = static_cast<size_t>(y0) * w * 3;
       i + 2 < rgb.size() && i < static_cast<size_t>(y1) * w * 3; i += 3) {
    n += rgb[i] == c[0] && rgb[i + 1] == c[1] && rgb[i + 2] == c[2];
  }
  return n;
}

// Pixels darker than (64, 64, 64) in rows [y0, y1): text, axes, ticks.
int CountDark(const std::vector<uint8_t>& rgb, int w, int y0, int y1) {
  int n = 0;
  for (size_t i = static_cast<size_t>(y0) * w * 3;
       i + 2 < rgb.size() && i < static_cast<size_t>(y1) * w * 3; i += 3) {
    n += rgb[i] < 64 && rgb[i + 1] < 64 && rgb[i + 2] < 64;
  }
  return n;
}

std::string TempPng(const std::string& name) {
  return ::testing::TempDir() + "kvc_report_" + name + ".png";
}

TEST(PngTest, RsvgConvertRendersTheSvgPlot) {
  if (!PngWriterAvailable().ok()) {
    GTEST_SKIP() << "SKIPPED: rsvg-convert is not installed (Debian package librsvg2-bin)";
  }
  const std::vector<PlotSpec> panels = AgreementPlots(SampleResults(), "title");
  const std::string path = TempPng("plot");
  ASSERT_TRUE(WritePng(panels, path).ok());
  std::ifstream in(path, std::ios::binary);
  const std::vector<uint8_t> png((std::istreambuf_iterator<char>(in)),
                                 std::istreambuf_iterator<char>());
  std::remove(path.c_str());
  int w = 0, h = 0;
  const std::vector<uint8_t> rgb = DecodePng(png, &w, &h);
  // The SVG's own size.
  const std::string svg = RenderSvg(panels);
  EXPECT_THAT(svg, HasSubstr(absl::StrCat("width=\"", w, "\" height=\"", h, "\"")));
  ASSERT_EQ(rgb.size(), static_cast<size_t>(w) * h * 3);
  // Each series has its own palette color (lines, markers, legend swatches), the title and the
  // axes are dark, the background white.
  EXPECT_GT(CountColor(rgb, w, {31, 119, 180}, 0, h), 50);
  EXPECT_GT(CountColor(rgb, w, {140, 86, 75}, 0, h), 50);
  EXPECT_GT(CountDark(rgb, w, 0, 40), 20);
  EXPECT_GT(CountDark(rgb, w, 0, h), 500);
  EXPECT_GT(CountColor(rgb, w, {255, 255, 255}, 0, h), w * h / 2);
}

TEST(PngTest, WriteReportsUnwritablePaths) {
  if (!PngWriterAvailable().ok()) {
    GTEST_SKIP() << "SKIPPED: rsvg-convert is not installed (Debian package librsvg2-bin)";
  }
  absl::Status s = WritePng(AgreementPlots(SampleResults(), "t"), "/nonexistent-dir/x.png");
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("/nonexistent-dir/x.png"));
}

TEST(PngTest, WithoutRsvgConvertTheErrorSaysWhatToInstall) {
  const char* old = std::getenv("PATH");
  const std::string saved = old != nullptr ? old : "";
  setenv("PATH", "/nonexistent-dir", 1);
  const absl::Status available = PngWriterAvailable();
  const absl::Status written = WritePng(AgreementPlots(SampleResults(), "t"), TempPng("none"));
  setenv("PATH", saved.c_str(), 1);
  EXPECT_EQ(available.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(available.message(), HasSubstr("rsvg-convert"));
  EXPECT_THAT(available.message(), HasSubstr("librsvg2-bin"));
  EXPECT_EQ(written.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(::access(TempPng("none").c_str(), F_OK), 0);  // nothing written
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
  const std::string svg = RenderSvg(panels);
  // Each series has its own palette color; every legend entry is a text; the title is there.
  EXPECT_THAT(svg, HasSubstr("stroke=\"#1f77b4\""));
  EXPECT_THAT(svg, HasSubstr("stroke=\"#8c564b\""));
  for (const Series& s : spec.series) EXPECT_THAT(svg, HasSubstr(">" + s.name + "</text>"));
  EXPECT_THAT(svg, HasSubstr(">" + spec.title + "</text>"));
  // Legend rows for every series fit in the plot.
  int h = 0;
  ASSERT_NE(svg.find("height=\""), std::string::npos);
  h = std::atoi(svg.c_str() + svg.find("height=\"") + 8);
  EXPECT_GE(h, 50 + static_cast<int>(spec.series.size()) * 24);
  // A degenerate range does not crash: the panel keeps its title and draws no series.
  PlotSpec bad = spec;
  bad.x_max = bad.x_min;
  const std::string msg = RenderSvg({bad});
  EXPECT_THAT(msg, HasSubstr(">" + spec.title + "</text>"));
  EXPECT_EQ(msg.find("#1f77b4"), std::string::npos);
}

}  // namespace
}  // namespace kvc::fidelity

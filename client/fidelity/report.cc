#include "kvc/fidelity/report.h"

#include <algorithm>
#include <cmath>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace kvc::fidelity {
namespace {

constexpr Rgb kWhite{255, 255, 255};
constexpr Rgb kBlack{0, 0, 0};
constexpr Rgb kGrid{225, 225, 225};
constexpr Rgb kPalette[] = {{31, 119, 180},  {255, 127, 14}, {44, 160, 44},   {214, 39, 40},
                            {148, 103, 189}, {140, 86, 75},  {227, 119, 194}, {127, 127, 127}};

std::string TickLabel(double v) {
  std::string s = absl::StrFormat("%.2f", v);
  // "0.50" -> "0.5", "1.00" -> "1": shorter labels, same value.
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

}  // namespace

std::string FormatTable(const std::vector<SweepResult>& results) {
  int layers = 0;
  for (const SweepResult& r : results) {
    layers = std::max(layers, static_cast<int>(r.metrics.attn_rel_err.size()));
  }
  std::string out = absl::StrFormat("%-24s %6s %7s %10s %9s %9s  ", "config", "size", "top1",
                                    "mean_KL", "max_KL", "attn_err");
  for (int l = 0; l < layers; ++l)
    absl::StrAppend(&out, absl::StrFormat(" %6s", absl::StrCat("L", l)));
  absl::StrAppend(&out, "\n");
  for (const SweepResult& r : results) {
    const Metrics& m = r.metrics;
    absl::StrAppend(
        &out, absl::StrFormat("%-24s %6.3f %7.4f %10.3e %9.2e %9.4f  ", r.entry.label, m.size_ratio,
                              m.top1_agreement, m.mean_kl, m.max_kl, m.mean_attn_rel_err));
    for (double e : m.attn_rel_err) absl::StrAppend(&out, absl::StrFormat(" %6.4f", e));
    absl::StrAppend(&out, "\n");
  }
  return out;
}

namespace {

// RFC 4180: a field with a comma or quote (spec-string labels such as "h2o:0.5,value=mul") is
// quoted, quotes doubled.
std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

}  // namespace

std::string FormatCsv(const std::vector<SweepResult>& results) {
  int layers = 0;
  for (const SweepResult& r : results) {
    layers = std::max(layers, static_cast<int>(r.metrics.attn_rel_err.size()));
  }
  std::string out =
      "config,family,policy,keep_ratio,key_lambda,quant_bits,steps,size_ratio,top1_agreement,"
      "mean_kl,max_kl,attn_rel_err";
  for (int l = 0; l < layers; ++l) absl::StrAppend(&out, ",attn_err_l", l);
  absl::StrAppend(&out, "\n");
  for (const SweepResult& r : results) {
    const Metrics& m = r.metrics;
    absl::StrAppend(
        &out,
        absl::StrFormat("%s,%s,%s,%.4f,%.4f,%d,%d,%.6f,%.6f,%.6e,%.6e,%.6e", CsvField(r.entry.label),
                        r.entry.family, r.entry.policy, r.entry.keep_ratio,
                        r.entry.spec.channels.key_lambda, r.entry.spec.quant.bits, m.steps,
                        m.size_ratio, m.top1_agreement, m.mean_kl, m.max_kl, m.mean_attn_rel_err));
    for (int l = 0; l < layers; ++l) {
      const double e = l < static_cast<int>(m.attn_rel_err.size()) ? m.attn_rel_err[l] : NAN;
      absl::StrAppend(&out, absl::StrFormat(",%.6e", e));
    }
    absl::StrAppend(&out, "\n");
  }
  return out;
}

Image RenderLinePlot(const PlotSpec& spec) {
  Image img(spec.width, spec.height, kWhite);
  const int scale = 2;
  const int char_h = kGlyphHeight * scale;
  int legend_w = 0;
  for (const Series& s : spec.series) {
    legend_w = std::max(legend_w, Image::TextWidth(s.name, scale));
  }
  const int left = 90, top = 50, bottom = spec.height - 70;
  const int right = spec.width - (legend_w + 60);
  if (right <= left + 10 || bottom <= top + 10 || !(spec.x_max > spec.x_min) ||
      !(spec.y_max > spec.y_min)) {
    img.Text(10, 10, "plot area too small", kBlack, scale);
    return img;
  }
  auto px = [&](double x) {
    return left + static_cast<int>(
                      std::lround((x - spec.x_min) / (spec.x_max - spec.x_min) * (right - left)));
  };
  auto py = [&](double y) {
    return bottom - static_cast<int>(
                        std::lround((y - spec.y_min) / (spec.y_max - spec.y_min) * (bottom - top)));
  };
  // Grid and ticks.
  for (double t : spec.y_ticks) {
    if (t < spec.y_min || t > spec.y_max) continue;
    const int y = py(t);
    img.Line(left, y, right, y, kGrid);
    img.Line(left - 6, y, left, y, kBlack);
    const std::string label = TickLabel(t);
    img.Text(left - 10 - Image::TextWidth(label, scale), y - char_h / 2, label, kBlack, scale);
  }
  for (double t : spec.x_ticks) {
    if (t < spec.x_min || t > spec.x_max) continue;
    const int x = px(t);
    img.Line(x, top, x, bottom, kGrid);
    img.Line(x, bottom, x, bottom + 6, kBlack);
    const std::string label = TickLabel(t);
    img.Text(x - Image::TextWidth(label, scale) / 2, bottom + 12, label, kBlack, scale);
  }
  img.Line(left, top, left, bottom, kBlack, 2);
  img.Line(left, bottom, right, bottom, kBlack, 2);
  // Labels and title.
  img.Text((left + right - Image::TextWidth(spec.x_label, scale)) / 2, bottom + 40, spec.x_label,
           kBlack, scale);
  img.TextVertical(18, (top + bottom + Image::TextWidth(spec.y_label, scale)) / 2, spec.y_label,
                   kBlack, scale);
  img.Text((spec.width - Image::TextWidth(spec.title, scale)) / 2, 16, spec.title, kBlack, scale);
  // Series, clipped to the plot rectangle by clamping (values outside are drawn on the border).
  auto cx = [&](double x) { return std::clamp(px(x), left, right); };
  auto cy = [&](double y) { return std::clamp(py(y), top, bottom); };
  for (size_t i = 0; i < spec.series.size(); ++i) {
    const Series& s = spec.series[i];
    const Rgb color = kPalette[i % (sizeof(kPalette) / sizeof(kPalette[0]))];
    for (size_t j = 0; j < s.points.size(); ++j) {
      const int x = cx(s.points[j].first), y = cy(s.points[j].second);
      if (j > 0) img.Line(cx(s.points[j - 1].first), cy(s.points[j - 1].second), x, y, color, 2);
      img.FillRect(x - 3, y - 3, x + 3, y + 3, color);
    }
    const int ly = top + 10 + static_cast<int>(i) * (char_h + 10);
    img.Line(right + 15, ly + char_h / 2, right + 35, ly + char_h / 2, color, 3);
    img.Text(right + 42, ly, s.name, kBlack, scale);
  }
  return img;
}

PlotSpec AgreementPlot(const std::vector<SweepResult>& results, const std::string& title) {
  PlotSpec spec;
  spec.title = title;
  spec.x_label = "keep ratio";
  spec.y_label = "top-1 agreement";
  spec.x_min = 0.2;
  spec.x_max = 1.0;
  spec.y_min = 0.0;
  spec.y_max = 1.0;
  spec.x_ticks = {0.25, 0.5, 0.75, 1.0};
  spec.y_ticks = {0.0, 0.2, 0.4, 0.6, 0.8, 1.0};
  std::vector<std::string> order;
  std::map<std::string, Series> by_policy;
  for (const SweepResult& r : results) {
    if (r.entry.family != "eviction") continue;
    if (!by_policy.count(r.entry.policy)) order.push_back(r.entry.policy);
    Series& s = by_policy[r.entry.policy];
    s.name = r.entry.policy;
    s.points.emplace_back(r.entry.keep_ratio, r.metrics.top1_agreement);
  }
  for (const std::string& name : order) {
    Series s = by_policy[name];
    std::sort(s.points.begin(), s.points.end());
    spec.series.push_back(std::move(s));
  }
  return spec;
}

}  // namespace kvc::fidelity

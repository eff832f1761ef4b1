#include "kvc/fidelity/report.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "kvc/status_macros.h"

extern char** environ;

namespace kvc::fidelity {
namespace {

// Turns the SVG into PNG: librsvg's command-line tool (Debian package librsvg2-bin).
constexpr char kPngWriter[] = "rsvg-convert";

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
};
constexpr Rgb kPalette[] = {{31, 119, 180},  {255, 127, 14}, {44, 160, 44},   {214, 39, 40},
                            {148, 103, 189}, {140, 86, 75},  {227, 119, 194}, {127, 127, 127}};
constexpr int kColors = sizeof(kPalette) / sizeof(kPalette[0]);

std::string TickLabel(double v) {
  std::string s = absl::StrFormat("%.2f", v);
  // "0.50" -> "0.5", "1.00" -> "1": shorter labels, same value.
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s;
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"\n") == std::string::npos) return s;
  return absl::StrCat("\"", absl::StrReplaceAll(s, {{"\"", "\"\""}}), "\"");
}

int NumLayers(const std::vector<SweepResult>& results) {
  int layers = 0;
  for (const SweepResult& r : results) {
    layers = std::max(layers, static_cast<int>(r.metrics.attn_rel_err.size()));
  }
  return layers;
}

double BytesPerSequence(const Metrics& m, uint64_t bytes) {
  return m.seq_top1.empty() ? 0 : static_cast<double>(bytes) / m.seq_top1.size();
}

// Legend rows and the plot's minimum height for them.
int LegendRowHeight() { return 24; }
int PanelHeight(const PlotSpec& spec) {
  return std::max(spec.height, 70 + static_cast<int>(spec.series.size()) * LegendRowHeight() + 80);
}

std::string XmlEscape(const std::string& s) {
  return absl::StrReplaceAll(s, {{"&", "&amp;"}, {"<", "&lt;"}, {">", "&gt;"}, {"\"", "&quot;"}});
}

std::string Hex(Rgb c) { return absl::StrFormat("#%02x%02x%02x", c.r, c.g, c.b); }

}  // namespace

SweepResult MakeResult(const SweepEntry& entry, Scenario scenario,
                       const std::vector<Metrics>& per_seed) {
  const SeedStats s = Summarize(per_seed);
  SweepResult r;
  r.entry = entry;
  r.metrics = s.pooled;
  r.scenario = scenario;
  r.seeds = s.seeds;
  r.top1_sd = s.top1_sd;
  r.kl_sd = s.kl_sd;
  r.top1_ci = s.top1_ci;
  r.kl_ci = s.kl_ci;
  return r;
}

std::string FormatTableHeader(int layers) {
  // "±" is two bytes and one column: the widths below count columns.
  std::string out = absl::StrFormat("%-30s %-6s %3s %6s %9s  %-32s %-36s %8s %8s ", "config",
                                    "scen", "W", "size", "bytes/seq", "top1 ±sd [95% CI]",
                                    "mean_KL ±sd [95% CI]", "max_KL", "attn_err");
  for (int l = 0; l < layers; ++l) {
    absl::StrAppend(&out, absl::StrFormat(" %6s", absl::StrCat("L", l)));
  }
  return out;
}

std::string FormatTableRow(const SweepResult& r) {
  const Metrics& m = r.metrics;
  const std::string top1 = absl::StrFormat("%.4f ±%.4f [%.3f, %.3f]", m.top1_agreement, r.top1_sd,
                                           r.top1_ci.lo, r.top1_ci.hi);
  const std::string kl =
      absl::StrFormat("%.3e ±%.1e [%.2e, %.2e]", m.mean_kl, r.kl_sd, r.kl_ci.lo, r.kl_ci.hi);
  // "±" is two bytes and one column: pad by hand.
  std::string out = absl::StrFormat(
      "%-30s %-6s %3d %6.3f %9.0f  %s%*s %s%*s %8.2e %8.4f ", r.entry.label,
      ScenarioName(r.scenario), m.obs_window, m.size_ratio, BytesPerSequence(m, m.compact_bytes),
      top1, std::max(0, 32 - static_cast<int>(top1.size())), "", kl,
      std::max(0, 36 - static_cast<int>(kl.size())), "", m.max_kl, m.mean_attn_rel_err);
  for (double e : m.attn_rel_err) absl::StrAppend(&out, absl::StrFormat(" %6.4f", e));
  return out;
}

std::string FormatTable(const std::vector<SweepResult>& results) {
  std::string out = absl::StrCat(FormatTableHeader(NumLayers(results)), "\n");
  for (const SweepResult& r : results) absl::StrAppend(&out, FormatTableRow(r), "\n");
  return out;
}

std::string FormatCsvHeader(int layers) {
  std::string out =
      "config,scenario,family,policy,keep_ratio,key_lambda,quant_bits,seeds,sequences,steps,"
      "obs_window,bytes,full_bytes,size_ratio,top1_agreement,top1_sd,top1_ci_lo,top1_ci_hi,"
      "mean_kl,mean_kl_sd,mean_kl_ci_lo,mean_kl_ci_hi,max_kl,attn_rel_err";
  for (int l = 0; l < layers; ++l) absl::StrAppend(&out, ",attn_err_l", l);
  return out;
}

std::string FormatCsvRow(const SweepResult& r, int layers) {
  const Metrics& m = r.metrics;
  std::string out = absl::StrFormat(
      "%s,%s,%s,%s,%.4f,%.4f,%d,%d,%d,%d,%d,%.1f,%.1f,%.6f,%.6f,%.6f,%.6f,%.6f,%.6e,%.6e,%.6e,"
      "%.6e,%.6e,%.6e",
      CsvField(r.entry.label), ScenarioName(r.scenario), r.entry.family, CsvField(r.entry.policy),
      r.entry.keep_ratio, r.entry.spec.channels.key_lambda, r.entry.spec.quant.bits, r.seeds,
      static_cast<int>(m.seq_top1.size()), m.steps, m.obs_window,
      BytesPerSequence(m, m.compact_bytes), BytesPerSequence(m, m.full_bytes), m.size_ratio,
      m.top1_agreement, r.top1_sd, r.top1_ci.lo, r.top1_ci.hi, m.mean_kl, r.kl_sd, r.kl_ci.lo,
      r.kl_ci.hi, m.max_kl, m.mean_attn_rel_err);
  for (int l = 0; l < layers; ++l) {
    const double e = l < static_cast<int>(m.attn_rel_err.size()) ? m.attn_rel_err[l] : NAN;
    absl::StrAppend(&out, absl::StrFormat(",%.6e", e));
  }
  return out;
}

std::string FormatCsv(const std::vector<SweepResult>& results) {
  const int layers = NumLayers(results);
  std::string out = absl::StrCat(FormatCsvHeader(layers), "\n");
  for (const SweepResult& r : results) absl::StrAppend(&out, FormatCsvRow(r, layers), "\n");
  return out;
}

absl::Status CheckWritable(const std::string& path, absl::string_view flag) {
  const bool existed = ::access(path.c_str(), F_OK) == 0;
  std::FILE* f = std::fopen(path.c_str(), "a");  // "a": never truncates what is there
  if (f == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": cannot write '", path, "': ", std::strerror(errno)));
  }
  std::fclose(f);
  if (!existed) std::remove(path.c_str());
  return absl::OkStatus();
}

std::string RenderSvg(const std::vector<PlotSpec>& panels) {
  int width = 1, height = 0;
  for (const PlotSpec& p : panels) {
    width = std::max(width, p.width);
    height += PanelHeight(p);
  }
  std::string out = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
      "font-family=\"sans-serif\" font-size=\"13\">\n<rect width=\"100%%\" height=\"100%%\" "
      "fill=\"white\"/>\n",
      width, height, width, height);
  int y0 = 0;
  for (const PlotSpec& spec : panels) {
    const int h = PanelHeight(spec);
    size_t legend_chars = 0;
    for (const Series& s : spec.series) legend_chars = std::max(legend_chars, s.name.size());
    const double left = 70, top = y0 + 40, bottom = y0 + h - 55;
    const double right = spec.width - (static_cast<double>(legend_chars) * 7.5 + 60);
    absl::StrAppend(
        &out, absl::StrFormat("<text x=\"%d\" y=\"%d\" text-anchor=\"middle\" font-size=\"15\">"
                              "%s</text>\n",
                              spec.width / 2, y0 + 22, XmlEscape(spec.title)));
    if (!(right > left + 10) || !(spec.x_max > spec.x_min) || !(spec.y_max > spec.y_min)) {
      y0 += h;
      continue;
    }
    auto px = [&](double x) {
      x = std::clamp(x, spec.x_min, spec.x_max);
      return left + (x - spec.x_min) / (spec.x_max - spec.x_min) * (right - left);
    };
    auto py = [&](double y) {
      y = std::clamp(y, spec.y_min, spec.y_max);
      return bottom - (y - spec.y_min) / (spec.y_max - spec.y_min) * (bottom - top);
    };
    for (double t : spec.y_ticks) {
      if (t < spec.y_min - 1e-9 || t > spec.y_max + 1e-9) continue;
      absl::StrAppend(
          &out, absl::StrFormat("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                                "stroke=\"#e1e1e1\"/><text x=\"%.1f\" y=\"%.1f\" "
                                "text-anchor=\"end\">%s</text>\n",
                                left, py(t), right, py(t), left - 8, py(t) + 4, TickLabel(t)));
    }
    for (double t : spec.x_ticks) {
      if (t < spec.x_min - 1e-9 || t > spec.x_max + 1e-9) continue;
      absl::StrAppend(&out,
                      absl::StrFormat("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                                      "stroke=\"#e1e1e1\"/><text x=\"%.1f\" y=\"%.1f\" "
                                      "text-anchor=\"middle\">%s</text>\n",
                                      px(t), top, px(t), bottom, px(t), bottom + 18, TickLabel(t)));
    }
    absl::StrAppend(
        &out,
        absl::StrFormat("<polyline points=\"%.1f,%.1f %.1f,%.1f %.1f,%.1f\" fill=\"none\" "
                        "stroke=\"black\" stroke-width=\"1.5\"/>\n",
                        left, top, left, bottom, right, bottom),
        absl::StrFormat("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%s</text>\n",
                        (left + right) / 2, bottom + 40, XmlEscape(spec.x_label)),
        absl::StrFormat("<text transform=\"translate(18,%.1f) rotate(-90)\" "
                        "text-anchor=\"middle\">%s</text>\n",
                        (top + bottom) / 2, XmlEscape(spec.y_label)));
    for (size_t i = 0; i < spec.series.size(); ++i) {
      const Series& s = spec.series[i];
      const std::string color = Hex(kPalette[i % kColors]);
      const int marker = static_cast<int>(i / kColors) % 3;
      auto mark = [&](double x, double y) {
        if (marker == 0) {
          return absl::StrFormat(
              "<rect x=\"%.1f\" y=\"%.1f\" width=\"7\" height=\"7\" "
              "fill=\"%s\"/>",
              x - 3.5, y - 3.5, color);
        }
        if (marker == 1) {
          return absl::StrFormat(
              "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"4\" fill=\"white\" "
              "stroke=\"%s\" stroke-width=\"2\"/>",
              x, y, color);
        }
        return absl::StrFormat(
            "<path d=\"M%.1f %.1fl8 8m0 -8l-8 8\" stroke=\"%s\" "
            "stroke-width=\"2\"/>",
            x - 4, y - 4, color);
      };
      absl::StrAppend(&out, "<g>");
      std::string line;
      for (const auto& [x, y] : s.points) {
        absl::StrAppend(&line, absl::StrFormat("%.1f,%.1f ", px(x), py(y)));
      }
      if (s.points.size() > 1) {
        absl::StrAppend(&out, absl::StrFormat("<polyline points=\"%s\" fill=\"none\" "
                                              "stroke=\"%s\" stroke-width=\"2\"/>",
                                              line, color));
      }
      for (size_t j = 0; j < s.points.size(); ++j) {
        const double x = px(s.points[j].first), y = py(s.points[j].second);
        if (j < s.errors.size()) {
          absl::StrAppend(
              &out, absl::StrFormat("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" "
                                    "y2=\"%.1f\" stroke=\"%s\"/>",
                                    x, py(s.errors[j].first), x, py(s.errors[j].second), color));
        }
        absl::StrAppend(&out, mark(x, y));
      }
      const double ly = top + 10 + static_cast<double>(i) * LegendRowHeight();
      absl::StrAppend(&out,
                      absl::StrFormat("<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
                                      "stroke=\"%s\" stroke-width=\"3\"/>",
                                      right + 15, ly, right + 35, ly, color),
                      mark(right + 25, ly),
                      absl::StrFormat("<text x=\"%.1f\" y=\"%.1f\">%s</text></g>\n", right + 42,
                                      ly + 4, XmlEscape(s.name)));
    }
    y0 += h;
  }
  absl::StrAppend(&out, "</svg>\n");
  return out;
}

absl::Status WriteSvg(const std::vector<PlotSpec>& panels, const std::string& path) {
  std::ofstream out(path, std::ios::trunc);
  out << RenderSvg(panels);
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

absl::Status PngWriterAvailable() {
  const char* path = std::getenv("PATH");
  for (absl::string_view dir : absl::StrSplit(path != nullptr ? path : "", ':')) {
    if (dir.empty()) continue;
    if (::access(absl::StrCat(dir, "/", kPngWriter).c_str(), X_OK) == 0) return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("--png: ", kPngWriter, " was not found on PATH; install Debian's librsvg2-bin ",
                   "(deploy/setup-debian.sh does), or write --svg"));
}

absl::Status WritePng(const std::vector<PlotSpec>& panels, const std::string& path) {
  RETURN_IF_ERROR(PngWriterAvailable());
  // The SVG and rsvg-convert's messages go through temporary files, removed when done.
  const char* tmp = std::getenv("TMPDIR");
  const std::string dir = tmp != nullptr && *tmp != '\0' ? tmp : "/tmp";
  std::string svg_path = absl::StrCat(dir, "/kvc-plot-XXXXXX");
  const int svg_fd = ::mkstemp(svg_path.data());
  if (svg_fd < 0) {
    return absl::InternalError(
        absl::StrCat("png: temporary file in ", dir, ": ", std::strerror(errno)));
  }
  ::close(svg_fd);
  std::string err_path = svg_path + ".err";
  auto cleanup = absl::MakeCleanup([&] {
    std::remove(svg_path.c_str());
    std::remove(err_path.c_str());
  });
  RETURN_IF_ERROR(WriteSvg(panels, svg_path));
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, err_path.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
  std::vector<std::string> args = {kPngWriter, "--format=png", "--output=" + path, svg_path};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, kPngWriter, &actions, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) {
    return absl::InternalError(
        absl::StrCat("png: cannot run ", kPngWriter, ": ", std::strerror(spawned)));
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return absl::OkStatus();
  std::ifstream err(err_path);
  std::string message;
  std::getline(err, message);
  return absl::InternalError(absl::StrCat(
      "cannot write '", path, "' with ", kPngWriter, " (",
      WIFEXITED(status) ? absl::StrCat("exit code ", WEXITSTATUS(status)) : std::string("killed"),
      message.empty() ? "" : ": ", message, ")"));
}

std::vector<PlotSpec> AgreementPlots(const std::vector<SweepResult>& results,
                                     const std::string& title) {
  std::vector<Scenario> scenarios;
  for (const SweepResult& r : results) {
    if (std::find(scenarios.begin(), scenarios.end(), r.scenario) == scenarios.end()) {
      scenarios.push_back(r.scenario);
    }
  }
  std::vector<PlotSpec> panels;
  for (Scenario scenario : scenarios) {
    PlotSpec spec;
    spec.title = absl::StrCat(title, ", question ", ScenarioName(scenario),
                              scenario == Scenario::kInside ? " the prompt" : " compression");
    spec.x_label = "size (compact / full bytes)";
    spec.y_label = "top-1 agreement";
    double y_lo = 1, y_hi = 0, x_hi = 0;
    std::vector<std::string> order;
    std::map<std::string, std::vector<std::pair<std::pair<double, double>, Interval>>> by_series;
    for (const SweepResult& r : results) {
      if (r.scenario != scenario) continue;
      const std::string& name = r.entry.series.empty() ? r.entry.label : r.entry.series;
      if (!by_series.count(name)) order.push_back(name);
      const double y = r.metrics.top1_agreement;
      Interval ci = r.top1_ci;
      if (ci.lo == 0 && ci.hi == 0) ci = {y, y};
      by_series[name].push_back({{r.metrics.size_ratio, y}, ci});
      y_lo = std::min({y_lo, y, ci.lo});
      y_hi = std::max({y_hi, y, ci.hi});
      x_hi = std::max(x_hi, r.metrics.size_ratio);
    }
    spec.y_min = std::max(0.0, std::floor(y_lo * 10 - 1e-9) / 10);
    spec.y_max = std::min(1.0, std::ceil(y_hi * 10 + 1e-9) / 10);
    if (spec.y_max - spec.y_min < 0.1) spec.y_max = std::min(1.0, spec.y_min + 0.1);
    if (spec.y_max - spec.y_min < 0.1) spec.y_min = spec.y_max - 0.1;
    const double y_step = spec.y_max - spec.y_min > 0.5 ? 0.1 : 0.05;
    for (double t = spec.y_min; t <= spec.y_max + 1e-9; t += y_step) spec.y_ticks.push_back(t);
    spec.x_min = 0;
    spec.x_max = std::max(0.2, std::ceil(x_hi * 10 + 1e-9) / 10);
    for (double t = 0; t <= spec.x_max + 1e-9; t += spec.x_max > 0.6 ? 0.2 : 0.1) {
      spec.x_ticks.push_back(t);
    }
    for (const std::string& name : order) {
      auto points = by_series[name];
      std::sort(points.begin(), points.end(),
                [](const auto& a, const auto& b) { return a.first < b.first; });
      Series s;
      s.name = name;
      for (const auto& [xy, ci] : points) {
        s.points.push_back(xy);
        s.errors.emplace_back(ci.lo, ci.hi);
      }
      spec.series.push_back(std::move(s));
    }
    spec.height = std::max(spec.height, PanelHeight(spec));
    panels.push_back(std::move(spec));
  }
  return panels;
}

}  // namespace kvc::fidelity

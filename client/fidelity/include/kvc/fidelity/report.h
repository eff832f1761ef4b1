// Reports of a fidelity sweep: a text table (streamed row by row), CSV, and plots of top-1
// agreement against stored size, one panel per scenario, as SVG, and as PNG converted from the
// SVG by librsvg's rsvg-convert.
#ifndef KVC_FIDELITY_REPORT_H_
#define KVC_FIDELITY_REPORT_H_

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/fidelity/stats.h"

namespace kvc::fidelity {

struct SweepResult {
  SweepEntry entry;
  Metrics metrics;  // pooled over seeds (one seed: that seed's metrics)
  Scenario scenario = Scenario::kInside;
  int seeds = 1;
  double top1_sd = 0, kl_sd = 0;  // across seeds
  Interval top1_ci, kl_ci;        // bootstrap 95% over sequences; {0, 0} when not computed
};

// A result from a row's per-seed metrics (Summarize).
SweepResult MakeResult(const SweepEntry& entry, Scenario scenario,
                       const std::vector<Metrics>& per_seed);

// Fixed-width table: config, scenario, W sent, size ratio, compact bytes per sequence, top-1 and
// mean KL each with "±" spread across seeds and [bootstrap 95% interval], max KL, attention
// error (mean, then per layer). Header and rows separately, so rows can be printed as they finish.
std::string FormatTableHeader(int layers);
std::string FormatTableRow(const SweepResult& result);
std::string FormatTable(const std::vector<SweepResult>& results);

// CSV: a header line, then one line per result; per-layer errors as attn_err_l0..l{layers-1}
// (NaN where a result has fewer); fields holding ',' or '"' are quoted.
std::string FormatCsvHeader(int layers);
std::string FormatCsvRow(const SweepResult& result, int layers);
std::string FormatCsv(const std::vector<SweepResult>& results);

// Fails with INVALID_ARGUMENT naming `flag` and the path when `path` cannot be opened for
// writing; leaves an existing file as it was and removes one it had to create.
absl::Status CheckWritable(const std::string& path, absl::string_view flag);

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), drawn in the given order
  // Optional, one per point when not empty: the interval drawn as a vertical error bar.
  std::vector<std::pair<double, double>> errors;
};

struct PlotSpec {
  std::string title, x_label, y_label;
  double x_min = 0, x_max = 1, y_min = 0, y_max = 1;  // x_max > x_min, y_max > y_min
  std::vector<double> x_ticks, y_ticks;
  std::vector<Series> series;     // 8 colors, then the same colors with other markers
  int width = 820, height = 520;  // the height grows when the legend needs more
};

// Axes with ticks and grid, one colored polyline with markers (and error bars) per series, a
// legend on the right listing every series, the title on top; the panels one above the other.
// Points outside the ranges are drawn on the border; a panel with an empty range shows only its
// title.
// The same plots as an SVG document (real fonts; scales without blur).
std::string RenderSvg(const std::vector<PlotSpec>& panels);
// INTERNAL naming the path when it cannot be written.
absl::Status WriteSvg(const std::vector<PlotSpec>& panels, const std::string& path);
// The same plots as PNG, rendered from the SVG by rsvg-convert (librsvg, Debian package
// librsvg2-bin). FAILED_PRECONDITION saying so when rsvg-convert is not on PATH
// (PngWriterAvailable, to check before a long run); INTERNAL naming the path and rsvg-convert's
// message when it fails (e.g. the path cannot be written).
absl::Status PngWriterAvailable();
absl::Status WritePng(const std::vector<PlotSpec>& panels, const std::string& path);

// One panel per scenario present, in order of first appearance: top-1 agreement against size
// ratio (compact / full bytes), every row drawn (eviction, ThinK, quantization, combined), rows
// of one SweepEntry::series joined by a line, bootstrap intervals as error bars. The y-axis
// spans the data and intervals, rounded out to 0.1.
std::vector<PlotSpec> AgreementPlots(const std::vector<SweepResult>& results,
                                     const std::string& title);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_REPORT_H_

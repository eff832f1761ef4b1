// Reports of a fidelity sweep: a text table, CSV, and a line plot (PNG) of top-1 agreement
// against keep ratio, one line per eviction policy.
#ifndef KVC_FIDELITY_REPORT_H_
#define KVC_FIDELITY_REPORT_H_

#include <string>
#include <utility>
#include <vector>

#include "kvc/fidelity/fidelity.h"
#include "kvc/fidelity/png.h"

namespace kvc::fidelity {

struct SweepResult {
  SweepEntry entry;
  Metrics metrics;
};

// Fixed-width table, one row per result: config, size ratio, agreement, mean/max KL, attention
// relative error (mean and per layer).
std::string FormatTable(const std::vector<SweepResult>& results);
// Header line plus one line per result; per-layer errors as attn_err_l0..attn_err_l{L-1}.
std::string FormatCsv(const std::vector<SweepResult>& results);

struct Series {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (x, y), drawn in the given order
};

struct PlotSpec {
  std::string title, x_label, y_label;
  double x_min = 0, x_max = 1, y_min = 0, y_max = 1;  // x_max > x_min, y_max > y_min
  std::vector<double> x_ticks, y_ticks;
  std::vector<Series> series;  // up to 8 distinct colors, then they repeat
  int width = 820, height = 520;
};

// Axes with ticks and grid, one colored polyline with square markers per series, a legend on the
// right, the title on top. Points outside the ranges are clipped.
Image RenderLinePlot(const PlotSpec& spec);

// Agreement vs keep ratio for the "eviction" entries of a sweep, one series per policy.
PlotSpec AgreementPlot(const std::vector<SweepResult>& results, const std::string& title);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_REPORT_H_

// Spread and intervals of fidelity metrics across seeds and sequences.
#ifndef KVC_FIDELITY_STATS_H_
#define KVC_FIDELITY_STATS_H_

#include <cstdint>
#include <vector>

#include "kvc/fidelity/fidelity.h"

namespace kvc::fidelity {

struct Interval {
  double lo = 0, hi = 0;
};

// Sample standard deviation (n - 1 in the denominator); 0 for fewer than two values.
double SampleStdDev(const std::vector<double>& values);

inline constexpr int kBootstrapResamples = 2000;

// Percentile bootstrap 95% interval of the mean: `resamples` means of len(values) values drawn
// with replacement (a fixed-seed splitmix64 generator, so the same values give the same
// interval), then their 2.5th and 97.5th percentiles (nearest rank). {v, v} for one value,
// {0, 0} for none.
Interval BootstrapMeanInterval(const std::vector<double>& values,
                               int resamples = kBootstrapResamples, uint64_t seed = 1);

// One row over several seeds: each seed's Metrics (different sequences and policy noise).
struct SeedStats {
  int seeds = 0;
  Metrics pooled;  // every seed's steps together: means over all, max over all, bytes summed
  double top1_sd = 0, kl_sd = 0;  // spread: sample std dev of the per-seed means
  Interval top1_ci, kl_ci;        // bootstrap 95% of the mean over all sequences of all seeds
};

// Pools per-seed metrics (non-empty, same layer count). Sequences weigh equally: every sequence
// has the same number of scored steps.
SeedStats Summarize(const std::vector<Metrics>& per_seed);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_STATS_H_

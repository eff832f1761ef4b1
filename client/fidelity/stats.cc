#include "kvc/fidelity/stats.h"

#include <algorithm>
#include <cmath>

namespace kvc::fidelity {
namespace {

uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

double Mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0 : s / static_cast<double>(v.size());
}

}  // namespace

double SampleStdDev(const std::vector<double>& values) {
  if (values.size() < 2) return 0;
  const double mean = Mean(values);
  double ss = 0;
  for (double x : values) ss += (x - mean) * (x - mean);
  return std::sqrt(ss / static_cast<double>(values.size() - 1));
}

Interval BootstrapMeanInterval(const std::vector<double>& values, int resamples, uint64_t seed) {
  if (values.empty()) return {};
  if (values.size() == 1 || resamples < 1) return {values[0], values[0]};
  const size_t n = values.size();
  std::vector<double> means(static_cast<size_t>(resamples));
  uint64_t state = seed;
  for (double& mean : means) {
    double sum = 0;
    // Modulo bias is below 2^-40 for any realistic n: negligible next to the resampling noise.
    for (size_t j = 0; j < n; ++j) sum += values[SplitMix64(state) % n];
    mean = sum / static_cast<double>(n);
  }
  std::sort(means.begin(), means.end());
  auto rank = [&](double p) {
    const auto r = static_cast<size_t>(std::ceil(p * static_cast<double>(means.size())));
    return means[std::clamp<size_t>(r, 1, means.size()) - 1];
  };
  return {rank(0.025), rank(0.975)};
}

SeedStats Summarize(const std::vector<Metrics>& per_seed) {
  SeedStats s;
  s.seeds = static_cast<int>(per_seed.size());
  if (per_seed.empty()) return s;
  Metrics& p = s.pooled;
  const size_t layers = per_seed[0].attn_rel_err.size();
  p.attn_rel_err.assign(layers, 0.0);
  std::vector<double> top1, kl;
  double agree = 0, kl_sum = 0;
  for (const Metrics& m : per_seed) {
    p.steps += m.steps;
    agree += m.top1_agreement * m.steps;
    kl_sum += m.mean_kl * m.steps;
    p.max_kl = std::max(p.max_kl, m.max_kl);
    for (size_t l = 0; l < layers && l < m.attn_rel_err.size(); ++l) {
      p.attn_rel_err[l] += m.attn_rel_err[l] / static_cast<double>(per_seed.size());
    }
    p.compact_bytes += m.compact_bytes;
    p.full_bytes += m.full_bytes;
    p.obs_window = m.obs_window;
    p.seq_top1.insert(p.seq_top1.end(), m.seq_top1.begin(), m.seq_top1.end());
    p.seq_kl.insert(p.seq_kl.end(), m.seq_kl.begin(), m.seq_kl.end());
    top1.push_back(m.top1_agreement);
    kl.push_back(m.mean_kl);
  }
  p.top1_agreement = p.steps > 0 ? agree / p.steps : 0;
  p.mean_kl = p.steps > 0 ? kl_sum / p.steps : 0;
  for (double e : p.attn_rel_err) p.mean_attn_rel_err += e / static_cast<double>(layers);
  p.size_ratio = p.full_bytes > 0 ? static_cast<double>(p.compact_bytes) / p.full_bytes : 0;
  s.top1_sd = SampleStdDev(top1);
  s.kl_sd = SampleStdDev(kl);
  s.top1_ci = BootstrapMeanInterval(p.seq_top1);
  s.kl_ci = BootstrapMeanInterval(p.seq_kl);
  return s;
}

}  // namespace kvc::fidelity

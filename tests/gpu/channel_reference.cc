#include "channel_reference.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace kvc::gpu_testing {
namespace {

double At(const Layer& l, const std::vector<uint8_t>& buf, int heads, int tokens, int h, int t,
          int c) {
  return LoadAsFloat(buf.data(), l.dtype,
                     ElementOffset(l.layout, heads, tokens, l.shape.head_dim, h, t, c));
}

}  // namespace

std::vector<double> ReferenceChannelScores(const Layer& layer, const CompressionSpec& spec,
                                           const CompactLayerView& view, int h, bool values) {
  const LayerShape& sh = layer.shape;
  const int d = sh.head_dim, s = sh.seq_len, w = sh.obs_window, g = sh.group_size();
  const int hkv = sh.num_kv_heads, hq = sh.num_q_heads;
  const CompactHead hd = view.head(h);
  const int n = hd.n_kept, m = hd.n_kept - hd.n_recent;
  const int32_t* pos = hd.positions;
  std::vector<double> score(d, 0.0);
  if (!values) {
    const ChannelPolicy p = spec.channels.key_policy;
    for (int c = 0; c < d; ++c) {
      double acc = 0;
      for (int j = 0; j < m; ++j) {
        const double x = At(layer, layer.k, hkv, s, h, pos[j], c);
        acc += p == ChannelPolicy::kL1 ? std::fabs(x) : x * x;
      }
      if (p == ChannelPolicy::kL2) acc = std::sqrt(acc);
      if (p == ChannelPolicy::kThink) {
        double q2 = 0;
        for (int gi = 0; gi < g; ++gi) {
          for (int t = 0; t < w; ++t) {
            const double x = At(layer, layer.q, hq, w, h * g + gi, t, c);
            q2 += x * x;
          }
        }
        acc = m > 0 ? acc * q2 / (static_cast<double>(g) * w * m) : 0.0;
      }
      score[c] = acc;
    }
    return score;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> p(n);
  for (int gi = 0; gi < g; ++gi) {
    for (int t = 0; t < w; ++t) {
      const int qh = h * g + gi, limit = s - w + t;
      double mx = -INFINITY;
      for (int j = 0; j < n; ++j) {
        if (pos[j] > limit) {
          p[j] = -INFINITY;
          continue;
        }
        double dot = 0;
        for (int c = 0; c < d; ++c) {
          dot += At(layer, layer.q, hq, w, qh, t, c) * At(layer, layer.k, hkv, s, h, pos[j], c);
        }
        p[j] = dot * scale;
        mx = std::max(mx, p[j]);
      }
      if (mx == -INFINITY) continue;
      double sum = 0;
      for (int j = 0; j < n; ++j) {
        p[j] = p[j] == -INFINITY ? 0.0 : std::exp(p[j] - mx);
        sum += p[j];
      }
      for (int c = 0; c < d; ++c) {
        double o = 0;
        for (int j = 0; j < m; ++j) o += p[j] / sum * At(layer, layer.v, hkv, s, h, pos[j], c);
        score[c] += o * o;
      }
    }
  }
  return score;
}

bool ChannelDifferencesAreTies(const int32_t* a, const int32_t* b, int n,
                               const std::vector<double>& score, std::string* why) {
  std::vector<int32_t> only_a, only_b;
  std::set_difference(a, a + n, b, b + n, std::back_inserter(only_a));
  std::set_difference(b, b + n, a, a + n, std::back_inserter(only_b));
  double mx = 0;
  for (double x : score) mx = std::max(mx, std::fabs(x));
  const double tol = 1e-4 * mx + 1e-12;
  for (int32_t x : only_a) {
    for (int32_t y : only_b) {
      if (std::fabs(score[x] - score[y]) > tol) {
        *why = absl::StrCat("channel ", x, " (", score[x], ") vs ", y, " (", score[y],
                            "), tolerance ", tol);
        return false;
      }
    }
  }
  return true;
}

}  // namespace kvc::gpu_testing

// A plain Llama forward pass for tests and as the benchmark's baseline: scalar loops, one position
// at a time, dot products accumulated in double, RoPE frequencies computed here from the config
// (not through kvc::model's functions). It shares nothing with Transformer::Forward but the weights,
// so agreement between the two checks the BLAS, blocked-attention and RoPE-table code.
#ifndef KVC_TESTS_FIDELITY_REFERENCE_MODEL_H_
#define KVC_TESTS_FIDELITY_REFERENCE_MODEL_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numbers>
#include <vector>

#include "kvc/model/checkpoint.h"

namespace kvc::testing {

// Rotary angle per position of pair i, with the config's scaling (Hugging Face's formulas).
inline std::vector<double> ReferenceInvFreq(const model::RopeConfig& r, int head_dim) {
  std::vector<double> inv(head_dim / 2);
  for (int i = 0; i < head_dim / 2; ++i) {
    const double base = 1.0 / std::pow(r.theta, static_cast<double>(2 * i) / head_dim);
    double f = base;
    if (r.scaling == model::RopeScaling::kLinear) f = base / r.factor;
    if (r.scaling == model::RopeScaling::kLlama3) {
      const double wavelen = 2 * std::numbers::pi / base;
      const double low_wavelen = r.original_max_positions / r.low_freq_factor;
      const double high_wavelen = r.original_max_positions / r.high_freq_factor;
      if (wavelen > low_wavelen) {
        f = base / r.factor;
      } else if (wavelen >= high_wavelen) {
        const double smooth = (r.original_max_positions / wavelen - r.low_freq_factor) /
                              (r.high_freq_factor - r.low_freq_factor);
        f = (1 - smooth) * base / r.factor + smooth * base;
      }
    }
    inv[i] = f;
  }
  return inv;
}

// Logits [tokens.size(), vocab] of a causal pass over `tokens`, for `config` (its RoPE pairs and
// scaling, which may differ from the checkpoint's own config) and the checkpoint's weights.
inline std::vector<float> ReferenceLogits(const model::Checkpoint& ck, const model::LlamaConfig& c,
                                          const std::vector<int32_t>& tokens) {
  const int s = static_cast<int>(tokens.size()), dim = c.dim, hd = c.head_dim();
  const int qd = c.q_dim(), kvd = c.kv_dim(), ffn = c.hidden_dim, g = c.group_size();
  auto matvec = [](const float* w, const std::vector<float>& x, int out, int in) {
    std::vector<float> y(out);
    for (int o = 0; o < out; ++o) {
      double acc = 0;
      for (int i = 0; i < in; ++i)
        acc += static_cast<double>(w[static_cast<size_t>(o) * in + i]) * x[i];
      y[o] = static_cast<float>(acc);
    }
    return y;
  };
  auto rmsnorm = [&](const std::vector<float>& x, const float* w) {
    double ss = 0;
    for (float v : x) ss += static_cast<double>(v) * v;
    const double inv = 1.0 / std::sqrt(ss / x.size() + c.rms_norm_eps);
    std::vector<float> out(x.size());
    for (size_t i = 0; i < x.size(); ++i) out[i] = static_cast<float>(w[i] * (x[i] * inv));
    return out;
  };
  const std::vector<double> inv_freq = ReferenceInvFreq(c.rope, hd);
  auto rope = [&](std::vector<float>& x, int heads, int pos) {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < hd / 2; ++i) {
        const bool split = c.rope.pairs == model::RopePairs::kHalfSplit;
        float& a = x[h * hd + (split ? i : 2 * i)];
        float& b = x[h * hd + (split ? i + hd / 2 : 2 * i + 1)];
        const double ang = pos * inv_freq[i], a0 = a, b0 = b;
        a = static_cast<float>(a0 * std::cos(ang) - b0 * std::sin(ang));
        b = static_cast<float>(a0 * std::sin(ang) + b0 * std::cos(ang));
      }
    }
  };
  std::vector<std::vector<float>> x(s);
  for (int t = 0; t < s; ++t) {
    const float* e = ck.token_embedding() + static_cast<size_t>(tokens[t]) * dim;
    x[t].assign(e, e + dim);
  }
  std::vector<std::vector<float>> keys(s), values(s);
  for (int l = 0; l < c.n_layers; ++l) {
    std::vector<std::vector<float>> queries(s);
    for (int t = 0; t < s; ++t) {
      const std::vector<float> xn = rmsnorm(x[t], ck.attn_norm(l));
      queries[t] = matvec(ck.wq(l), xn, qd, dim);
      keys[t] = matvec(ck.wk(l), xn, kvd, dim);
      values[t] = matvec(ck.wv(l), xn, kvd, dim);
      rope(queries[t], c.n_heads, t);
      rope(keys[t], c.n_kv_heads, t);
    }
    for (int t = 0; t < s; ++t) {
      std::vector<float> att(qd);
      for (int h = 0; h < c.n_heads; ++h) {
        const int kvh = h / g;
        std::vector<double> w(t + 1);
        double mx = -INFINITY;
        for (int j = 0; j <= t; ++j) {
          double dot = 0;
          for (int d = 0; d < hd; ++d) {
            dot += static_cast<double>(queries[t][h * hd + d]) * keys[j][kvh * hd + d];
          }
          w[j] = dot / std::sqrt(static_cast<double>(hd));
          mx = std::max(mx, w[j]);
        }
        double sum = 0;
        for (double& v : w) sum += (v = std::exp(v - mx));
        for (int d = 0; d < hd; ++d) {
          double acc = 0;
          for (int j = 0; j <= t; ++j) acc += w[j] / sum * values[j][kvh * hd + d];
          att[h * hd + d] = static_cast<float>(acc);
        }
      }
      const std::vector<float> o = matvec(ck.wo(l), att, dim, qd);
      for (int i = 0; i < dim; ++i) x[t][i] += o[i];
      const std::vector<float> xn = rmsnorm(x[t], ck.ffn_norm(l));
      std::vector<float> h1 = matvec(ck.w1(l), xn, ffn, dim);
      const std::vector<float> h3 = matvec(ck.w3(l), xn, ffn, dim);
      for (int i = 0; i < ffn; ++i) {
        const double a = h1[i];
        h1[i] = static_cast<float>(a / (1.0 + std::exp(-a)) * h3[i]);
      }
      const std::vector<float> y = matvec(ck.w2(l), h1, dim, ffn);
      for (int i = 0; i < dim; ++i) x[t][i] += y[i];
    }
  }
  std::vector<float> logits(static_cast<size_t>(s) * c.vocab_size);
  for (int t = 0; t < s; ++t) {
    const std::vector<float> row =
        matvec(ck.classifier(), rmsnorm(x[t], ck.final_norm()), c.vocab_size, dim);
    std::copy(row.begin(), row.end(), logits.begin() + static_cast<size_t>(t) * c.vocab_size);
  }
  return logits;
}

}  // namespace kvc::testing

#endif  // KVC_TESTS_FIDELITY_REFERENCE_MODEL_H_

#include "kvc/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "kvc/status_macros.h"

namespace kvc::model {
namespace {

// y[o] = sum_i w[o, i] x[i] for w [out, in] row-major.
void MatVec(const float* w, const float* x, int out, int in, float* y) {
  for (int o = 0; o < out; ++o) {
    const float* row = w + static_cast<size_t>(o) * in;
    float acc = 0;
    for (int i = 0; i < in; ++i) acc += row[i] * x[i];
    y[o] = acc;
  }
}

// Y [rows, out] = X [rows, in] W^T, W [out, in].
void MatMul(const float* x, const float* w, int rows, int out, int in, float* y) {
  for (int r = 0; r < rows; ++r) {
    MatVec(w, x + static_cast<size_t>(r) * in, out, in, y + static_cast<size_t>(r) * out);
  }
}

void RmsNorm(const float* x, const float* weight, int n, float* out) {
  float ss = 0;
  for (int i = 0; i < n; ++i) ss += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(ss / n + kRmsNormEps);
  for (int i = 0; i < n; ++i) out[i] = x[i] * inv * weight[i];
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// SwiGLU FFN with residual: x += w2 (silu(w1 xn) * (w3 xn)).
void FeedForward(const Checkpoint& ck, int layer, float* x, std::vector<float>& xn,
                 std::vector<float>& h1, std::vector<float>& h3, std::vector<float>& y) {
  const LlamaConfig& c = ck.config();
  RmsNorm(x, ck.ffn_norm(layer), c.dim, xn.data());
  MatVec(ck.w1(layer), xn.data(), c.hidden_dim, c.dim, h1.data());
  MatVec(ck.w3(layer), xn.data(), c.hidden_dim, c.dim, h3.data());
  for (int i = 0; i < c.hidden_dim; ++i) h1[i] = Silu(h1[i]) * h3[i];
  MatVec(ck.w2(layer), h1.data(), c.dim, c.hidden_dim, y.data());
  for (int i = 0; i < c.dim; ++i) x[i] += y[i];
}

}  // namespace

void ApplyRope(float* x, int heads, int head_dim, int pos, RopePairs pairs) {
  const int half = head_dim / 2;
  for (int i = 0; i < half; ++i) {
    // Angles in double: positions up to a few thousand times frequencies near 1 lose several
    // digits in float.
    const double freq = std::pow(10000.0, -2.0 * i / head_dim);
    const double angle = pos * freq;
    const float cs = static_cast<float>(std::cos(angle));
    const float sn = static_cast<float>(std::sin(angle));
    for (int h = 0; h < heads; ++h) {
      float* p = x + static_cast<size_t>(h) * head_dim;
      float& a = p[pairs == RopePairs::kHalfSplit ? i : 2 * i];
      float& b = p[pairs == RopePairs::kHalfSplit ? i + half : 2 * i + 1];
      const float a0 = a, b0 = b;
      a = a0 * cs - b0 * sn;
      b = a0 * sn + b0 * cs;
    }
  }
}

Sampler::Sampler(float temperature, uint64_t seed)
    : temperature_(temperature), state_(seed ^ 0x9e3779b97f4a7c15ull) {}

double Sampler::Uniform() {
  // splitmix64: a fixed, portable sequence for a given seed.
  uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}

int32_t Sampler::Sample(absl::Span<const float> logits) {
  const int n = static_cast<int>(logits.size());
  int best = 0;
  for (int i = 1; i < n; ++i) {
    if (logits[i] > logits[best]) best = i;
  }
  if (temperature_ <= 0.0f) return best;
  std::vector<double> p(n);
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    p[i] = std::exp((static_cast<double>(logits[i]) - logits[best]) / temperature_);
    sum += p[i];
  }
  const double u = Uniform() * sum;
  double acc = 0;
  for (int i = 0; i < n; ++i) {
    acc += p[i];
    if (u < acc) return i;
  }
  return n - 1;  // rounding at the top end
}

absl::StatusOr<Transformer> Transformer::Load(const std::string& path) {
  ASSIGN_OR_RETURN(Checkpoint ck, Checkpoint::Load(path));
  return Transformer(std::move(ck));
}

absl::Status Transformer::CheckTokens(absl::Span<const int32_t> tokens) const {
  const LlamaConfig& c = config();
  if (tokens.empty()) return absl::InvalidArgumentError("tokens: empty");
  if (static_cast<int64_t>(tokens.size()) > c.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokens: ", tokens.size(), " exceed the model's seq_len ", c.seq_len));
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokens[", i, "]: ", tokens[i], " is outside [0, ", c.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ForwardOutput> Transformer::Forward(absl::Span<const int32_t> tokens) const {
  RETURN_IF_ERROR(CheckTokens(tokens));
  const LlamaConfig& c = config();
  const int s_len = static_cast<int>(tokens.size());
  const int dim = c.dim, hd = c.head_dim(), kv_dim = c.kv_dim(), g = c.group_size();
  const size_t sd = static_cast<size_t>(s_len) * dim;
  std::vector<float> x(sd), xn(sd), q(sd), k(static_cast<size_t>(s_len) * kv_dim),
      v(static_cast<size_t>(s_len) * kv_dim), att(sd), proj(sd), h1(c.hidden_dim), h3(c.hidden_dim),
      ffn_xn(dim), ffn_y(dim), scores(s_len);
  for (int t = 0; t < s_len; ++t) {
    std::memcpy(&x[static_cast<size_t>(t) * dim],
                ck_.token_embedding() + static_cast<size_t>(tokens[t]) * dim, dim * sizeof(float));
  }
  ForwardOutput result;
  result.seq_len = s_len;
  result.vocab_size = c.vocab_size;
  result.layers.resize(c.n_layers);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int l = 0; l < c.n_layers; ++l) {
    for (int t = 0; t < s_len; ++t) {
      RmsNorm(&x[static_cast<size_t>(t) * dim], ck_.attn_norm(l), dim,
              &xn[static_cast<size_t>(t) * dim]);
    }
    MatMul(xn.data(), ck_.wq(l), s_len, dim, dim, q.data());
    MatMul(xn.data(), ck_.wk(l), s_len, kv_dim, dim, k.data());
    MatMul(xn.data(), ck_.wv(l), s_len, kv_dim, dim, v.data());
    for (int t = 0; t < s_len; ++t) {
      ApplyRope(&q[static_cast<size_t>(t) * dim], c.n_heads, hd, t, pairs_);
      ApplyRope(&k[static_cast<size_t>(t) * kv_dim], c.n_kv_heads, hd, t, pairs_);
    }
    // Causal attention, position by position, straight from the [S, heads*hd] projections.
    for (int h = 0; h < c.n_heads; ++h) {
      const int kvh = h / g;
      for (int i = 0; i < s_len; ++i) {
        const float* qi = &q[static_cast<size_t>(i) * dim + h * hd];
        float max_score = -INFINITY;
        for (int j = 0; j <= i; ++j) {
          const float* kj = &k[static_cast<size_t>(j) * kv_dim + kvh * hd];
          float dot = 0;
          for (int d = 0; d < hd; ++d) dot += qi[d] * kj[d];
          scores[j] = dot * scale;
          max_score = std::max(max_score, scores[j]);
        }
        float sum = 0;
        for (int j = 0; j <= i; ++j) {
          scores[j] = std::exp(scores[j] - max_score);
          sum += scores[j];
        }
        float* o = &att[static_cast<size_t>(i) * dim + h * hd];
        std::fill(o, o + hd, 0.0f);
        for (int j = 0; j <= i; ++j) {
          const float w = scores[j] / sum;
          const float* vj = &v[static_cast<size_t>(j) * kv_dim + kvh * hd];
          for (int d = 0; d < hd; ++d) o[d] += w * vj[d];
        }
      }
    }
    // Export in HND.
    LayerProjections& out = result.layers[l];
    out.q.resize(sd);
    out.k.resize(k.size());
    out.v.resize(v.size());
    for (int t = 0; t < s_len; ++t) {
      for (int h = 0; h < c.n_heads; ++h) {
        std::memcpy(&out.q[(static_cast<size_t>(h) * s_len + t) * hd],
                    &q[static_cast<size_t>(t) * dim + h * hd], hd * sizeof(float));
      }
      for (int h = 0; h < c.n_kv_heads; ++h) {
        const size_t dst = (static_cast<size_t>(h) * s_len + t) * hd;
        const size_t src = static_cast<size_t>(t) * kv_dim + h * hd;
        std::memcpy(&out.k[dst], &k[src], hd * sizeof(float));
        std::memcpy(&out.v[dst], &v[src], hd * sizeof(float));
      }
    }
    MatMul(att.data(), ck_.wo(l), s_len, dim, dim, proj.data());
    for (size_t i = 0; i < sd; ++i) x[i] += proj[i];
    for (int t = 0; t < s_len; ++t) {
      FeedForward(ck_, l, &x[static_cast<size_t>(t) * dim], ffn_xn, h1, h3, ffn_y);
    }
  }
  result.logits.resize(static_cast<size_t>(s_len) * c.vocab_size);
  for (int t = 0; t < s_len; ++t) {
    RmsNorm(&x[static_cast<size_t>(t) * dim], ck_.final_norm(), dim, xn.data());
    MatVec(ck_.classifier(), xn.data(), c.vocab_size, dim,
           &result.logits[static_cast<size_t>(t) * c.vocab_size]);
  }
  return result;
}

absl::Status Transformer::DecodeStep(int32_t token, KvCache* cache, absl::Span<float> logits,
                                     std::vector<float>* attn_out) const {
  const LlamaConfig& c = config();
  if (token < 0 || token >= c.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("token: ", token, " is outside [0, ", c.vocab_size, ")"));
  }
  if (static_cast<int>(logits.size()) != c.vocab_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("logits: size ", logits.size(), ", expected vocab_size ", c.vocab_size));
  }
  if (cache == nullptr || !cache->CanAppend()) {
    return absl::ResourceExhaustedError("cache: null or full");
  }
  const int dim = c.dim, hd = c.head_dim(), kv_dim = c.kv_dim(), pos = cache->position();
  std::vector<float> x(ck_.token_embedding() + static_cast<size_t>(token) * dim,
                       ck_.token_embedding() + static_cast<size_t>(token + 1) * dim);
  std::vector<float> xn(dim), q(dim), k(kv_dim), v(kv_dim), att(dim), proj(dim), h1(c.hidden_dim),
      h3(c.hidden_dim), ffn_y(dim);
  if (attn_out != nullptr) attn_out->assign(static_cast<size_t>(c.n_layers) * dim, 0.0f);
  for (int l = 0; l < c.n_layers; ++l) {
    RmsNorm(x.data(), ck_.attn_norm(l), dim, xn.data());
    MatVec(ck_.wq(l), xn.data(), dim, dim, q.data());
    MatVec(ck_.wk(l), xn.data(), kv_dim, dim, k.data());
    MatVec(ck_.wv(l), xn.data(), kv_dim, dim, v.data());
    ApplyRope(q.data(), c.n_heads, hd, pos, pairs_);
    ApplyRope(k.data(), c.n_kv_heads, hd, pos, pairs_);
    RETURN_IF_ERROR(cache->AppendAndAttend(l, q.data(), k.data(), v.data(), att.data()));
    if (attn_out != nullptr) {
      std::copy(att.begin(), att.end(), attn_out->begin() + static_cast<size_t>(l) * dim);
    }
    MatVec(ck_.wo(l), att.data(), dim, dim, proj.data());
    for (int i = 0; i < dim; ++i) x[i] += proj[i];
    FeedForward(ck_, l, x.data(), xn, h1, h3, ffn_y);
  }
  cache->Advance();
  RmsNorm(x.data(), ck_.final_norm(), dim, xn.data());
  MatVec(ck_.classifier(), xn.data(), c.vocab_size, dim, logits.data());
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> Transformer::Generate(absl::Span<const int32_t> prompt,
                                                           int n_new, Sampler* sampler) const {
  RETURN_IF_ERROR(CheckTokens(prompt));
  const int total = static_cast<int>(prompt.size()) + n_new;
  if (n_new < 0 || total > config().seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("n_new: ", n_new, " with a prompt of ",
                                                   prompt.size(), " exceeds seq_len ",
                                                   config().seq_len));
  }
  if (sampler == nullptr) return absl::InvalidArgumentError("sampler: null");
  ASSIGN_OR_RETURN(std::unique_ptr<FullKvCache> cache, FullKvCache::Create(config(), total));
  std::vector<int32_t> out(prompt.begin(), prompt.end());
  std::vector<float> logits(config().vocab_size);
  for (size_t i = 0; i + 1 < prompt.size(); ++i) {
    RETURN_IF_ERROR(DecodeStep(prompt[i], cache.get(), absl::MakeSpan(logits)));
  }
  for (int i = 0; i < n_new; ++i) {
    RETURN_IF_ERROR(DecodeStep(out.back(), cache.get(), absl::MakeSpan(logits)));
    out.push_back(sampler->Sample(logits));
  }
  return out;
}

absl::StatusOr<double> Transformer::MeanNll(absl::Span<const int32_t> tokens) const {
  if (tokens.size() < 2) return absl::InvalidArgumentError("tokens: need at least 2");
  ASSIGN_OR_RETURN(ForwardOutput fwd, Forward(tokens));
  double total = 0;
  for (size_t t = 0; t + 1 < tokens.size(); ++t) {
    const float* row = fwd.logits_at(static_cast<int>(t));
    const float max_logit = *std::max_element(row, row + fwd.vocab_size);
    double sum = 0;
    for (int i = 0; i < fwd.vocab_size; ++i)
      sum += std::exp(static_cast<double>(row[i]) - max_logit);
    total += -(row[tokens[t + 1]] - max_logit - std::log(sum));
  }
  return total / static_cast<double>(tokens.size() - 1);
}

}  // namespace kvc::model

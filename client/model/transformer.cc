#include "kvc/model/transformer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "kvc/status_macros.h"
#include "ops.h"

namespace kvc::model {
namespace {

using internal::MatMulT;
using internal::RmsNormRows;

}  // namespace

void ApplyRope(float* x, int heads, int head_dim, int pos, RopePairs pairs) {
  RopeConfig rope;
  rope.pairs = pairs;
  ApplyRope(x, heads, head_dim, pos, rope);
}

void ApplyRope(float* x, int heads, int head_dim, int pos, const RopeConfig& rope) {
  internal::RopeTable(rope, head_dim, pos, 1).Apply(x, heads, head_dim, pos);
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

absl::StatusOr<ForwardOutput> Transformer::Forward(absl::Span<const int32_t> tokens,
                                                   const ForwardOptions& options) const {
  RETURN_IF_ERROR(CheckTokens(tokens));
  if (options.last_logits < -1) {
    return absl::InvalidArgumentError(
        absl::StrCat("last_logits: ", options.last_logits, " must be >= -1"));
  }
  const LlamaConfig& c = config();
  const int s_len = static_cast<int>(tokens.size());
  const int dim = c.dim, hd = c.head_dim(), q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const size_t s = s_len;
  ForwardOutput result;
  result.seq_len = s_len;
  result.vocab_size = c.vocab_size;
  result.logits_first = options.last_logits < 0 ? 0 : s_len - std::min(options.last_logits, s_len);
  std::vector<float> x, xn, q, k, v, att, h1, h3;
  try {
    x.resize(s * dim);
    xn.resize(s * dim);
    q.resize(s * q_dim);
    k.resize(s * kv_dim);
    v.resize(s * kv_dim);
    att.resize(s * q_dim);
    h1.resize(s * c.hidden_dim);
    h3.resize(s * c.hidden_dim);
    result.logits.resize((s - result.logits_first) * c.vocab_size);
    if (options.keep_layers) result.layers.resize(c.n_layers);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("Forward: cannot allocate the buffers of a ", s_len, "-token pass"));
  }
  for (int t = 0; t < s_len; ++t) {
    std::memcpy(&x[t * static_cast<size_t>(dim)],
                ck_.token_embedding() + static_cast<size_t>(tokens[t]) * dim, dim * sizeof(float));
  }
  const internal::RopeTable rope(c.rope, hd, 0, s_len);
  for (int l = 0; l < c.n_layers; ++l) {
    RmsNormRows(x.data(), ck_.attn_norm(l), s_len, dim, c.rms_norm_eps, xn.data());
    MatMulT(xn.data(), ck_.wq(l), s_len, q_dim, dim, q.data());
    MatMulT(xn.data(), ck_.wk(l), s_len, kv_dim, dim, k.data());
    MatMulT(xn.data(), ck_.wv(l), s_len, kv_dim, dim, v.data());
    for (int t = 0; t < s_len; ++t) {
      rope.Apply(&q[t * static_cast<size_t>(q_dim)], c.n_heads, hd, t);
      rope.Apply(&k[t * static_cast<size_t>(kv_dim)], c.n_kv_heads, hd, t);
    }
    internal::CausalAttention(q.data(), k.data(), v.data(), s_len, c.n_heads, c.n_kv_heads, hd,
                              att.data());
    if (options.keep_layers) {  // export in HND
      LayerProjections& out = result.layers[l];
      try {
        out.q.resize(q.size());
        out.k.resize(k.size());
        out.v.resize(v.size());
      } catch (const std::bad_alloc&) {
        return absl::ResourceExhaustedError(
            absl::StrCat("Forward: cannot allocate layer ", l, "'s projections"));
      }
      for (int t = 0; t < s_len; ++t) {
        for (int h = 0; h < c.n_heads; ++h) {
          std::memcpy(&out.q[(h * s + t) * hd], &q[t * static_cast<size_t>(q_dim) + h * hd],
                      hd * sizeof(float));
        }
        for (int h = 0; h < c.n_kv_heads; ++h) {
          const size_t dst = (h * s + t) * hd;
          const size_t src = t * static_cast<size_t>(kv_dim) + h * hd;
          std::memcpy(&out.k[dst], &k[src], hd * sizeof(float));
          std::memcpy(&out.v[dst], &v[src], hd * sizeof(float));
        }
      }
    }
    MatMulT(att.data(), ck_.wo(l), s_len, dim, q_dim, xn.data());
    for (size_t i = 0; i < s * dim; ++i) x[i] += xn[i];
    // SwiGLU FFN with residual: x += w2 (silu(w1 xn) * (w3 xn)).
    RmsNormRows(x.data(), ck_.ffn_norm(l), s_len, dim, c.rms_norm_eps, xn.data());
    MatMulT(xn.data(), ck_.w1(l), s_len, c.hidden_dim, dim, h1.data());
    MatMulT(xn.data(), ck_.w3(l), s_len, c.hidden_dim, dim, h3.data());
    internal::SwiGlu(h1.data(), h3.data(), h1.size());
    MatMulT(h1.data(), ck_.w2(l), s_len, dim, c.hidden_dim, xn.data());
    for (size_t i = 0; i < s * dim; ++i) x[i] += xn[i];
  }
  const int first = result.logits_first, rows = s_len - first;
  if (rows > 0) {
    const float* xf = &x[static_cast<size_t>(first) * dim];
    RmsNormRows(xf, ck_.final_norm(), rows, dim, c.rms_norm_eps, xn.data());
    MatMulT(xn.data(), ck_.classifier(), rows, c.vocab_size, dim, result.logits.data());
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
  const int dim = c.dim, hd = c.head_dim(), q_dim = c.q_dim(), kv_dim = c.kv_dim();
  const int pos = cache->position();
  std::vector<float> x(ck_.token_embedding() + static_cast<size_t>(token) * dim,
                       ck_.token_embedding() + static_cast<size_t>(token + 1) * dim);
  std::vector<float> xn(dim), q(q_dim), k(kv_dim), v(kv_dim), att(q_dim), proj(dim),
      h1(c.hidden_dim), h3(c.hidden_dim);
  if (attn_out != nullptr) attn_out->assign(static_cast<size_t>(c.n_layers) * q_dim, 0.0f);
  const internal::RopeTable rope(c.rope, hd, pos, 1);
  for (int l = 0; l < c.n_layers; ++l) {
    RmsNormRows(x.data(), ck_.attn_norm(l), 1, dim, c.rms_norm_eps, xn.data());
    MatMulT(xn.data(), ck_.wq(l), 1, q_dim, dim, q.data());
    MatMulT(xn.data(), ck_.wk(l), 1, kv_dim, dim, k.data());
    MatMulT(xn.data(), ck_.wv(l), 1, kv_dim, dim, v.data());
    rope.Apply(q.data(), c.n_heads, hd, pos);
    rope.Apply(k.data(), c.n_kv_heads, hd, pos);
    RETURN_IF_ERROR(cache->AppendAndAttend(l, q.data(), k.data(), v.data(), att.data()));
    if (attn_out != nullptr) {
      std::copy(att.begin(), att.end(), attn_out->begin() + static_cast<size_t>(l) * q_dim);
    }
    MatMulT(att.data(), ck_.wo(l), 1, dim, q_dim, proj.data());
    for (int i = 0; i < dim; ++i) x[i] += proj[i];
    RmsNormRows(x.data(), ck_.ffn_norm(l), 1, dim, c.rms_norm_eps, xn.data());
    MatMulT(xn.data(), ck_.w1(l), 1, c.hidden_dim, dim, h1.data());
    MatMulT(xn.data(), ck_.w3(l), 1, c.hidden_dim, dim, h3.data());
    internal::SwiGlu(h1.data(), h3.data(), h1.size());
    MatMulT(h1.data(), ck_.w2(l), 1, dim, c.hidden_dim, proj.data());
    for (int i = 0; i < dim; ++i) x[i] += proj[i];
  }
  cache->Advance();
  RmsNormRows(x.data(), ck_.final_norm(), 1, dim, c.rms_norm_eps, xn.data());
  MatMulT(xn.data(), ck_.classifier(), 1, c.vocab_size, dim, logits.data());
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
  ForwardOptions options;
  options.keep_layers = false;
  ASSIGN_OR_RETURN(ForwardOutput fwd, Forward(tokens, options));
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

#include "kvc/fidelity/fidelity.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kvc/status_macros.h"
#include "tensor_rows.h"

namespace kvc::fidelity {
namespace {

// log-softmax in double: KL of nearly equal distributions needs the extra digits.
void LogSoftmax(const float* logits, int n, double* out) {
  const float max_logit = *std::max_element(logits, logits + n);
  double sum = 0;
  for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(logits[i]) - max_logit);
  const double log_sum = std::log(sum);
  for (int i = 0; i < n; ++i) out[i] = static_cast<double>(logits[i]) - max_logit - log_sum;
}

// Position `pos` of an HND tensor [heads, S, D], as [heads, D].
void Gather(const std::vector<float>& x, int heads, int S, int D, int pos, float* out) {
  for (int h = 0; h < heads; ++h) {
    std::memcpy(out + static_cast<size_t>(h) * D, &x[(static_cast<size_t>(h) * S + pos) * D],
                static_cast<size_t>(D) * sizeof(float));
  }
}

}  // namespace

absl::Status ValidateRunOptions(const RunOptions& o, const model::LlamaConfig& config) {
  if (o.num_sequences < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_sequences: ", o.num_sequences, " must be >= 1"));
  }
  if (o.prefix_len < 1) {
    return absl::InvalidArgumentError(absl::StrCat("prefix_len: ", o.prefix_len, " must be >= 1"));
  }
  if (o.continuation < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("continuation: ", o.continuation, " must be >= 1"));
  }
  if (o.obs_window < 0 || o.obs_window > o.prefix_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "obs_window: ", o.obs_window, " is outside [0, prefix_len ", o.prefix_len, "]"));
  }
  if (static_cast<int64_t>(o.prefix_len) + o.continuation > config.seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_len + continuation: ", o.prefix_len, " + ", o.continuation,
                     " exceeds the model's seq_len ", config.seq_len));
  }
  if (!(o.temperature >= 0.0f)) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature: ", o.temperature, " must be >= 0"));
  }
  if (!o.given_sequences.empty()) {
    if (static_cast<int>(o.given_sequences.size()) != o.num_sequences) {
      return absl::InvalidArgumentError(absl::StrCat("sequences: ", o.given_sequences.size(),
                                                     " given, num_sequences is ", o.num_sequences));
    }
    for (size_t i = 0; i < o.given_sequences.size(); ++i) {
      const std::vector<int32_t>& seq = o.given_sequences[i];
      if (static_cast<int64_t>(seq.size()) < int64_t{o.prefix_len} + o.continuation) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequences: sequence ", i, " has ", seq.size(),
            " tokens, prefix_len + continuation needs ", o.prefix_len + o.continuation));
      }
      for (int32_t t : seq) {
        if (t < 0 || t >= config.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat("sequences: sequence ", i, " has token ",
                                                         t, " outside [0, vocab ",
                                                         config.vocab_size, ")"));
        }
      }
    }
  }
  return CheckKVzipPrompts(config, o.kvzip);
}

absl::string_view ScenarioName(Scenario s) { return s == Scenario::kInside ? "inside" : "after"; }

absl::StatusOr<std::vector<Scenario>> ParseScenarios(absl::string_view text) {
  std::vector<Scenario> out;
  auto add = [&out, text](Scenario s) -> absl::Status {
    if (std::find(out.begin(), out.end(), s) != out.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("scenarios: '", text, "' names ", ScenarioName(s), " twice"));
    }
    out.push_back(s);
    return absl::OkStatus();
  };
  for (absl::string_view item : absl::StrSplit(text, ',')) {
    item = absl::StripAsciiWhitespace(item);
    if (item == "inside") {
      RETURN_IF_ERROR(add(Scenario::kInside));
    } else if (item == "after") {
      RETURN_IF_ERROR(add(Scenario::kAfter));
    } else if (item == "both") {
      RETURN_IF_ERROR(add(Scenario::kInside));
      RETURN_IF_ERROR(add(Scenario::kAfter));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "scenarios: '", item, "' is not one of inside, after, both (comma-separated)"));
    }
  }
  return out;
}

LayerInput PrefixCache::Input(int layer) const {
  const model::LayerProjections& l = (*layers)[layer];
  LayerInput in;
  in.shape = shape();
  in.dtype = DType::kF32;
  in.layout = Layout::kHND;
  in.layer_index = layer;
  in.k = l.k.data();
  in.v = l.v.data();
  in.q_obs = obs_window > 0 ? l.q.data() : nullptr;
  in.rope = &rope;
  in.q_stats = q_stats ? (*q_stats)[layer].data() : nullptr;
  if (recon) {
    in.q_obs = recon->q[layer].data();
    in.q_stats = recon->log_mass[layer].data();
  }
  return in;
}

LayerShape PrefixCache::shape() const {
  LayerShape s;
  s.num_kv_heads = num_kv_heads;
  s.num_q_heads = num_q_heads;
  s.seq_len = prefix_len;
  s.head_dim = head_dim;
  s.obs_window = obs_window;
  return s;
}

uint64_t PrefixCache::full_bytes() const {
  return 2ull * num_layers() * num_kv_heads * prefix_len * head_dim * sizeof(float);
}

Compressor InProcessCompressor(Backend* backend) {
  return [backend](const PrefixCache& prefix, const CompressionSpec& spec,
                   int) -> absl::StatusOr<std::vector<CompactLayer>> {
    if (spec.eviction.layer_adaptive) {
      // Backend::Compress sees one layer: it would select per layer and say nothing.
      return absl::InvalidArgumentError(
          "spec: xlayer=1 selects over all layers at once, which kvcd does (it holds a request's "
          "layers); in-process compression runs one layer at a time");
    }
    std::vector<CompactLayer> out;
    for (int l = 0; l < prefix.num_layers(); ++l) {
      ASSIGN_OR_RETURN(CompactLayer layer, backend->Compress(prefix.Input(l), spec, nullptr));
      out.push_back(std::move(layer));
    }
    return out;
  };
}

bool NeedsQueries(const CompressionSpec& spec, LayerShape shape) {
  shape.obs_window = std::max(1, shape.obs_window);
  if (!ValidateSpec(spec, shape, 0).ok()) return false;
  shape.obs_window = 0;
  return !ValidateSpec(spec, shape, 0).ok();
}

absl::StatusOr<std::unique_ptr<FidelityEval>> FidelityEval::Create(const model::Transformer* model,
                                                                   const RunOptions& options,
                                                                   Backend* attention) {
  if (model == nullptr) return absl::InvalidArgumentError("model: null");
  RETURN_IF_ERROR(ValidateRunOptions(options, model->config()));
  ASSIGN_OR_RETURN(const RopeParams rope, model::EngineRope(model->config()));
  if (options.given_sequences.empty() && model->config().bos_token < 0) {
    return absl::InvalidArgumentError(
        "sequences: the model declares no BOS token to sample from; give the sequences");
  }
  std::unique_ptr<FidelityEval> eval(new FidelityEval(model, options, attention));
  eval->rope_ = rope;
  RETURN_IF_ERROR(eval->Prepare());
  return eval;
}

absl::Status FidelityEval::Prepare() {
  const int total = options_.prefix_len + options_.continuation;
  for (int i = 0; i < options_.num_sequences; ++i) {
    std::vector<int32_t> seq;
    if (!options_.given_sequences.empty()) {
      const std::vector<int32_t>& given = options_.given_sequences[i];
      seq.assign(given.begin(), given.begin() + total);
    } else {
      model::Sampler sampler(options_.temperature, options_.seed + static_cast<uint64_t>(i));
      const int32_t bos = model_->config().bos_token;
      ASSIGN_OR_RETURN(seq, model_->Generate({bos}, total - 1, &sampler));
    }
    RETURN_IF_ERROR(PrepareSequence(std::move(seq)));
  }
  options_.given_sequences.clear();  // kept in sequences_
  SetCalibrationStatistics();
  return absl::OkStatus();
}

// Leave-one-out: sequence i gets the mean and covariance of the un-rotated queries over the other
// sequences' prefixes (its own when it is the only one), in every scenario.
void FidelityEval::SetCalibrationStatistics() {
  const model::LlamaConfig& c = model_->config();
  const int n = static_cast<int>(query_sums_.size()), p = options_.prefix_len, hd = c.head_dim();
  const size_t per_head = hd + static_cast<size_t>(hd) * hd;
  const double count = static_cast<double>(n > 1 ? n - 1 : 1) * p;
  for (int i = 0; i < n; ++i) {
    auto stats = std::make_shared<std::vector<std::vector<float>>>(
        c.n_layers, std::vector<float>(static_cast<size_t>(c.n_heads) * per_head));
    std::vector<double> s(per_head);
    for (int l = 0; l < c.n_layers; ++l) {
      for (int h = 0; h < c.n_heads; ++h) {
        const size_t at = (static_cast<size_t>(l) * c.n_heads + h) * per_head;
        std::fill(s.begin(), s.end(), 0.0);
        for (int j = 0; j < n; ++j) {
          if (j == i && n > 1) continue;
          for (size_t e = 0; e < per_head; ++e) s[e] += query_sums_[j][at + e];
        }
        float* out = &(*stats)[l][static_cast<size_t>(h) * per_head];
        for (int a = 0; a < hd; ++a) out[a] = static_cast<float>(s[a] / count);
        for (int a = 0; a < hd; ++a) {
          for (int b = 0; b < hd; ++b) {
            out[hd + a * hd + b] =
                static_cast<float>(s[hd + a * hd + b] / count - s[a] / count * (s[b] / count));
          }
        }
      }
    }
    inside_[i].q_stats = stats;
    after_[i].q_stats = stats;
    after_no_queries_[i].q_stats = stats;
  }
  query_sums_.clear();
}

absl::Status FidelityEval::PrepareSequence(std::vector<int32_t> seq) {
  const model::LlamaConfig& c = model_->config();
  const int p = options_.prefix_len, n_cont = options_.continuation, w = options_.obs_window;
  const int total = p + n_cont, hd = c.head_dim(), vocab = c.vocab_size;
  model::ForwardOptions forward;
  forward.last_logits = 0;  // the reference logits come from decoding, below
  ASSIGN_OR_RETURN(model::ForwardOutput fwd, model_->Forward(seq, forward));

  // Reference: full-cache decoding of the continuation, and each layer's attention output for
  // the full model's own continuation queries (fed from the forward pass, so the compact side
  // below sees exactly the same q, k, v).
  ASSIGN_OR_RETURN(std::unique_ptr<model::FullKvCache> cache,
                   model::FullKvCache::FromPrefix(c, fwd.layers, total, p, total));
  ASSIGN_OR_RETURN(std::unique_ptr<model::FullKvCache> fed,
                   model::FullKvCache::FromPrefix(c, fwd.layers, total, p, total));
  std::vector<double> logp(static_cast<size_t>(n_cont) * vocab);
  std::vector<int32_t> top1(n_cont);
  std::vector<float> attn(static_cast<size_t>(n_cont) * c.n_layers * c.q_dim()), logits(vocab);
  std::vector<float> q(static_cast<size_t>(c.n_heads) * hd),
      k(static_cast<size_t>(c.n_kv_heads) * hd), v(k.size());
  for (int t = 0; t < n_cont; ++t) {
    RETURN_IF_ERROR(model_->DecodeStep(seq[p + t], cache.get(), absl::MakeSpan(logits)));
    LogSoftmax(logits.data(), vocab, &logp[static_cast<size_t>(t) * vocab]);
    top1[t] = ArgMax(logits.data(), vocab);
    for (int l = 0; l < c.n_layers; ++l) {
      const model::LayerProjections& lp = fwd.layers[l];
      Gather(lp.q, c.n_heads, total, hd, p + t, q.data());
      Gather(lp.k, c.n_kv_heads, total, hd, p + t, k.data());
      Gather(lp.v, c.n_kv_heads, total, hd, p + t, v.data());
      RETURN_IF_ERROR(
          fed->AppendAndAttend(l, q.data(), k.data(), v.data(),
                               &attn[(static_cast<size_t>(t) * c.n_layers + l) * c.q_dim()]));
    }
    fed->Advance();
  }

  // The prefixes each scenario compresses (HND copies), and the tail fed to the compact caches.
  auto slice = [&](int first, int count, int q_first, int q_count) {
    auto layers = std::make_shared<std::vector<model::LayerProjections>>();
    for (const model::LayerProjections& lp : fwd.layers) {
      layers->push_back({Rows(lp.q, c.n_heads, total, hd, q_first, q_count),
                         Rows(lp.k, c.n_kv_heads, total, hd, first, count),
                         Rows(lp.v, c.n_kv_heads, total, hd, first, count)});
    }
    return layers;
  };
  PrefixCache inside;
  inside.prefix_len = p;
  inside.obs_window = w;
  inside.num_kv_heads = c.n_kv_heads;
  inside.num_q_heads = c.n_heads;
  inside.head_dim = hd;
  inside.layers = slice(0, p, p - w, w);
  inside.rope = rope_;
  PrefixCache after = inside, after_no_queries = inside;
  if (p > w) {  // else kAfter is refused by Evaluate
    const int len = p - w, window = std::min(w, len);
    after.prefix_len = len;
    after.obs_window = window;
    after.layers = slice(0, len, len - window, window);
    after_no_queries = after;
    after_no_queries.obs_window = 0;
  }
  std::vector<model::LayerProjections> tail;
  for (const model::LayerProjections& lp : fwd.layers) {
    tail.push_back({Rows(lp.q, c.n_heads, total, hd, p - w, w + n_cont),
                    Rows(lp.k, c.n_kv_heads, total, hd, p - w, w + n_cont),
                    Rows(lp.v, c.n_kv_heads, total, hd, p - w, w + n_cont)});
  }

  // Sums of the un-rotated prefix queries and of their outer products, per layer and query head,
  // for the leave-one-out calibration statistics (Prepare).
  const size_t per_head = hd + static_cast<size_t>(hd) * hd;
  std::vector<double>& sum =
      query_sums_.emplace_back(static_cast<size_t>(c.n_layers) * c.n_heads * per_head, 0.0);
  std::vector<float> qu(hd);
  for (int l = 0; l < c.n_layers; ++l) {
    for (int h = 0; h < c.n_heads; ++h) {
      double* acc = &sum[(static_cast<size_t>(l) * c.n_heads + h) * per_head];
      for (int t = 0; t < p; ++t) {
        const float* src = &fwd.layers[l].q[(static_cast<size_t>(h) * total + t) * hd];
        std::copy(src, src + hd, qu.begin());
        RotateVector(inside.rope, hd, -t, qu.data());
        for (int a = 0; a < hd; ++a) {
          acc[a] += qu[a];
          for (int b = 0; b < hd; ++b) acc[hd + a * hd + b] += static_cast<double>(qu[a]) * qu[b];
        }
      }
    }
  }

  sequences_.push_back(std::move(seq));
  inside_.push_back(std::move(inside));
  after_.push_back(std::move(after));
  after_no_queries_.push_back(std::move(after_no_queries));
  tail_.push_back(std::move(tail));
  ref_logp_.push_back(std::move(logp));
  ref_top1_.push_back(std::move(top1));
  ref_attn_.push_back(std::move(attn));
  return absl::OkStatus();
}

absl::StatusOr<PrefixCache> FidelityEval::CompressedPrefix(int i, Scenario scenario,
                                                          const CompressionSpec& spec) {
  if (i < 0 || i >= options_.num_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("sequence: ", i, " is out of range"));
  }
  if (!NeedsReconstruction(spec)) {
    if (scenario == Scenario::kInside) return inside_[i];
    const PrefixCache& after = after_[i];
    return NeedsQueries(spec, after.shape()) ? after : after_no_queries_[i];
  }
  RETURN_IF_ERROR(CheckReconstructionSpec(spec));
  PrefixCache prefix = scenario == Scenario::kInside ? inside_[i] : after_no_queries_[i];
  if (recon_inside_.empty()) {
    recon_inside_.resize(options_.num_sequences);
    recon_after_.resize(options_.num_sequences);
  }
  std::shared_ptr<const ReconstructionPass>& pass =
      scenario == Scenario::kInside ? recon_inside_[i] : recon_after_[i];
  if (!pass) {
    const std::vector<int32_t>& seq = sequences_[i];
    ASSIGN_OR_RETURN(ReconstructionPass run,
                     RunReconstruction(*model_,
                                       absl::MakeConstSpan(seq.data(), prefix.prefix_len),
                                       options_.kvzip));
    pass = std::make_shared<const ReconstructionPass>(std::move(run));
  }
  prefix.recon = pass;
  prefix.obs_window = pass->rows;
  return prefix;
}

absl::StatusOr<std::vector<float>> FidelityEval::DecodeOnCompact(int i,
                                                                 std::vector<CompactLayer> layers) {
  if (i < 0 || i >= options_.num_sequences) {
    return absl::InvalidArgumentError(absl::StrCat("sequence: ", i, " is out of range"));
  }
  const model::LlamaConfig& c = model_->config();
  const int p = options_.prefix_len, n_cont = options_.continuation;
  ASSIGN_OR_RETURN(std::unique_ptr<model::CompactKvCache> cache,
                   model::CompactKvCache::Create(c, std::move(layers), attention_, n_cont));
  if (cache->position() != p) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers: blobs have seq_len ", cache->position(), ", the prefix has ", p));
  }
  std::vector<float> logits(static_cast<size_t>(n_cont) * c.vocab_size);
  for (int t = 0; t < n_cont; ++t) {
    RETURN_IF_ERROR(model_->DecodeStep(
        sequences_[i][p + t], cache.get(),
        absl::MakeSpan(&logits[static_cast<size_t>(t) * c.vocab_size], c.vocab_size)));
  }
  return logits;
}

absl::StatusOr<Metrics> FidelityEval::Evaluate(const CompressionSpec& spec,
                                               const Compressor& compressor, Scenario scenario) {
  const model::LlamaConfig& c = model_->config();
  const int p = options_.prefix_len, n_cont = options_.continuation, w = options_.obs_window;
  const int vocab = c.vocab_size, hd = c.head_dim();
  if (scenario == Scenario::kAfter && p <= w) {
    return absl::InvalidArgumentError(
        absl::StrCat("scenario after: the prefix before the question is empty (prefix_len ", p,
                     " <= obs_window ", w, ")"));
  }
  Metrics m;
  m.attn_rel_err.assign(c.n_layers, 0.0);
  std::vector<float> logits(vocab), attn(static_cast<size_t>(c.n_heads) * hd);
  std::vector<float> q(attn.size()), k(static_cast<size_t>(c.n_kv_heads) * hd), v(k.size());
  std::vector<double> logp(vocab);
  int agree = 0;
  double kl_sum = 0;
  for (int i = 0; i < options_.num_sequences; ++i) {
    ASSIGN_OR_RETURN(const PrefixCache prefix, CompressedPrefix(i, scenario, spec));
    m.obs_window = prefix.obs_window;
    // kvzip over several reconstruction passes: the spec names this prefix's passes.
    const CompressionSpec doc_spec = SpecForPasses(spec, prefix.recon.get());
    ASSIGN_OR_RETURN(std::vector<CompactLayer> layers, compressor(prefix, doc_spec, i));
    for (const CompactLayer& layer : layers) m.compact_bytes += layer.bytes.size();
    m.full_bytes += prefix.full_bytes();
    const int start = prefix.prefix_len, lead = p - start;  // question tokens decoded first
    ASSIGN_OR_RETURN(std::unique_ptr<model::CompactKvCache> fed,
                     model::CompactKvCache::Create(c, layers, attention_, lead + n_cont));
    ASSIGN_OR_RETURN(
        std::unique_ptr<model::CompactKvCache> cache,
        model::CompactKvCache::Create(c, std::move(layers), attention_, lead + n_cont));
    // New tokens' RoPE positions continue at the blobs' seq_len: it must be the prefix length.
    if (cache->position() != start) {
      return absl::InvalidArgumentError(absl::StrCat(
          "compressor: blobs have seq_len ", cache->position(), ", the prefix has ", start));
    }
    const int tail_first = p - w, tail_len = w + n_cont;
    int seq_agree = 0;
    double seq_kl = 0;
    for (int pos = start; pos < p + n_cont; ++pos) {
      RETURN_IF_ERROR(model_->DecodeStep(sequences_[i][pos], cache.get(), absl::MakeSpan(logits)));
      const int t = pos - p;  // scored step when >= 0
      for (int l = 0; l < c.n_layers; ++l) {
        const model::LayerProjections& lp = tail_[i][l];
        Gather(lp.q, c.n_heads, tail_len, hd, pos - tail_first, q.data());
        Gather(lp.k, c.n_kv_heads, tail_len, hd, pos - tail_first, k.data());
        Gather(lp.v, c.n_kv_heads, tail_len, hd, pos - tail_first, v.data());
        RETURN_IF_ERROR(fed->AppendAndAttend(l, q.data(), k.data(), v.data(), attn.data()));
        if (t < 0) continue;
        const float* ref = &ref_attn_[i][(static_cast<size_t>(t) * c.n_layers + l) * c.q_dim()];
        double diff = 0, norm = 0;
        for (int d = 0; d < c.q_dim(); ++d) {
          const double o_f = ref[d], o_c = attn[d];
          diff += (o_c - o_f) * (o_c - o_f);
          norm += o_f * o_f;
        }
        m.attn_rel_err[l] += norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
      }
      fed->Advance();
      if (t < 0) continue;
      LogSoftmax(logits.data(), vocab, logp.data());
      const double* ref = &ref_logp_[i][static_cast<size_t>(t) * vocab];
      double kl = 0;
      for (int x = 0; x < vocab; ++x) kl += std::exp(ref[x]) * (ref[x] - logp[x]);
      kl = std::max(kl, 0.0);  // rounding can make identical distributions -1e-17
      seq_kl += kl;
      m.max_kl = std::max(m.max_kl, kl);
      if (ArgMax(logits.data(), vocab) == ref_top1_[i][t]) ++seq_agree;
    }
    agree += seq_agree;
    kl_sum += seq_kl;
    m.seq_top1.push_back(static_cast<double>(seq_agree) / n_cont);
    m.seq_kl.push_back(seq_kl / n_cont);
  }
  m.steps = options_.num_sequences * n_cont;
  m.top1_agreement = static_cast<double>(agree) / m.steps;
  m.mean_kl = kl_sum / m.steps;
  for (double& e : m.attn_rel_err) {
    e /= m.steps;
    m.mean_attn_rel_err += e / c.n_layers;
  }
  m.size_ratio = m.full_bytes > 0 ? static_cast<double>(m.compact_bytes) / m.full_bytes : 0;
  return m;
}

}  // namespace kvc::fidelity

#include "kvc/fidelity/fidelity.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "kvc/status_macros.h"

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

int32_t ArgMax(const float* x, int n) {
  return static_cast<int32_t>(std::max_element(x, x + n) - x);  // first maximum on ties
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
  return absl::OkStatus();
}

LayerInput PrefixCache::Input(int layer) const {
  LayerInput in;
  in.shape.num_kv_heads = num_kv_heads;
  in.shape.num_q_heads = num_q_heads;
  in.shape.seq_len = prefix_len;
  in.shape.head_dim = head_dim;
  in.shape.obs_window = obs_window;
  in.dtype = DType::kF32;
  in.layout = Layout::kHND;
  in.layer_index = layer;
  in.k = layers[layer].k.data();
  in.v = layers[layer].v.data();
  in.q_obs = obs_window > 0 ? layers[layer].q.data() : nullptr;
  in.rope = &rope;
  in.q_stats = q_stats.empty() ? nullptr : q_stats[layer].data();
  return in;
}

uint64_t PrefixCache::full_bytes() const {
  return 2ull * layers.size() * num_kv_heads * prefix_len * head_dim * sizeof(float);
}

Compressor InProcessCompressor(Backend* backend) {
  return [backend](const PrefixCache& prefix, const CompressionSpec& spec,
                   int) -> absl::StatusOr<std::vector<CompactLayer>> {
    std::vector<CompactLayer> out;
    for (int l = 0; l < static_cast<int>(prefix.layers.size()); ++l) {
      ASSIGN_OR_RETURN(CompactLayer layer, backend->Compress(prefix.Input(l), spec, nullptr));
      out.push_back(std::move(layer));
    }
    return out;
  };
}

absl::StatusOr<std::unique_ptr<FidelityEval>> FidelityEval::Create(const model::Transformer* model,
                                                                   const RunOptions& options,
                                                                   Backend* attention) {
  if (model == nullptr) return absl::InvalidArgumentError("model: null");
  RETURN_IF_ERROR(ValidateRunOptions(options, model->config()));
  std::unique_ptr<FidelityEval> eval(new FidelityEval(model, options, attention));
  RETURN_IF_ERROR(eval->Prepare());
  return eval;
}

absl::Status FidelityEval::Prepare() {
  const model::LlamaConfig& c = model_->config();
  const int p = options_.prefix_len, n_cont = options_.continuation, w = options_.obs_window;
  const int hd = c.head_dim(), vocab = c.vocab_size;
  RopeParams rope;
  rope.half_split = model_->rope_pairs() == model::RopePairs::kHalfSplit;
  // Per sequence, layer and query head: sum of the un-rotated queries and of their outer
  // products over the whole prefix, for leave-one-out calibration statistics.
  const size_t per_head = hd + static_cast<size_t>(hd) * hd;
  std::vector<std::vector<double>> sums;
  for (int i = 0; i < options_.num_sequences; ++i) {
    model::Sampler sampler(options_.temperature, options_.seed + static_cast<uint64_t>(i));
    ASSIGN_OR_RETURN(std::vector<int32_t> seq,
                     model_->Generate({model::kBosToken}, p + n_cont - 1, &sampler));
    ASSIGN_OR_RETURN(model::ForwardOutput fwd,
                     model_->Forward(absl::MakeConstSpan(seq).subspan(0, p)));
    ASSIGN_OR_RETURN(std::unique_ptr<model::FullKvCache> cache,
                     model::FullKvCache::FromPrefix(c, fwd.layers, p, p, p + n_cont));
    std::vector<double> logp(static_cast<size_t>(n_cont) * vocab);
    std::vector<int32_t> top1(n_cont);
    std::vector<float> attn(static_cast<size_t>(n_cont) * c.n_layers * c.dim), logits(vocab),
        step_attn;
    for (int t = 0; t < n_cont; ++t) {
      RETURN_IF_ERROR(
          model_->DecodeStep(seq[p + t], cache.get(), absl::MakeSpan(logits), &step_attn));
      LogSoftmax(logits.data(), vocab, &logp[static_cast<size_t>(t) * vocab]);
      top1[t] = ArgMax(logits.data(), vocab);
      std::copy(step_attn.begin(), step_attn.end(), attn.begin() + t * step_attn.size());
    }
    // Keep only the observation queries: the engine never sees the others.
    PrefixCache prefix;
    prefix.prefix_len = p;
    prefix.obs_window = w;
    prefix.num_kv_heads = c.n_kv_heads;
    prefix.num_q_heads = c.n_heads;
    prefix.head_dim = hd;
    prefix.layers = std::move(fwd.layers);
    prefix.rope = rope;
    std::vector<double>& sum = sums.emplace_back(c.n_layers * c.n_heads * per_head, 0.0);
    std::vector<float> q(hd);
    for (int l = 0; l < c.n_layers; ++l) {
      for (int h = 0; h < c.n_heads; ++h) {
        double* acc = &sum[(static_cast<size_t>(l) * c.n_heads + h) * per_head];
        for (int t = 0; t < p; ++t) {
          const float* src = &prefix.layers[l].q[(static_cast<size_t>(h) * p + t) * hd];
          std::copy(src, src + hd, q.begin());
          RotateVector(rope, hd, -t, q.data());
          for (int a = 0; a < hd; ++a) {
            acc[a] += q[a];
            for (int b = 0; b < hd; ++b) acc[hd + a * hd + b] += static_cast<double>(q[a]) * q[b];
          }
        }
      }
    }
    for (model::LayerProjections& layer : prefix.layers) {
      std::vector<float> q_obs(static_cast<size_t>(c.n_heads) * w * hd);
      for (int h = 0; h < c.n_heads; ++h) {
        std::memcpy(&q_obs[static_cast<size_t>(h) * w * hd],
                    &layer.q[(static_cast<size_t>(h) * p + (p - w)) * hd],
                    static_cast<size_t>(w) * hd * sizeof(float));
      }
      layer.q = std::move(q_obs);
    }
    sequences_.push_back(std::move(seq));
    prefixes_.push_back(std::move(prefix));
    ref_logp_.push_back(std::move(logp));
    ref_top1_.push_back(std::move(top1));
    ref_attn_.push_back(std::move(attn));
  }
  // Leave-one-out: sequence i gets the mean and covariance over the other sequences' prefixes
  // (its own when it is the only one).
  const int n = options_.num_sequences;
  for (int i = 0; i < n; ++i) {
    const double count = static_cast<double>(n > 1 ? n - 1 : 1) * p;
    PrefixCache& prefix = prefixes_[i];
    prefix.q_stats.assign(c.n_layers, std::vector<float>(c.n_heads * per_head));
    for (int l = 0; l < c.n_layers; ++l) {
      for (int h = 0; h < c.n_heads; ++h) {
        const size_t at = (static_cast<size_t>(l) * c.n_heads + h) * per_head;
        std::vector<double> s(per_head, 0.0);
        for (int j = 0; j < n; ++j) {
          if (j == i && n > 1) continue;
          for (size_t e = 0; e < per_head; ++e) s[e] += sums[j][at + e];
        }
        float* out = &prefix.q_stats[l][static_cast<size_t>(h) * per_head];
        for (int a = 0; a < hd; ++a) out[a] = static_cast<float>(s[a] / count);
        for (int a = 0; a < hd; ++a) {
          for (int b = 0; b < hd; ++b) {
            out[hd + a * hd + b] =
                static_cast<float>(s[hd + a * hd + b] / count - s[a] / count * (s[b] / count));
          }
        }
      }
    }
  }
  return absl::OkStatus();
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
                                               const Compressor& compressor) {
  const model::LlamaConfig& c = model_->config();
  const int p = options_.prefix_len, n_cont = options_.continuation, vocab = c.vocab_size;
  Metrics m;
  m.attn_rel_err.assign(c.n_layers, 0.0);
  uint64_t packed = 0, full = 0;
  std::vector<float> logits(vocab), attn;
  std::vector<double> logp(vocab);
  int agree = 0;
  double kl_sum = 0;
  for (int i = 0; i < options_.num_sequences; ++i) {
    ASSIGN_OR_RETURN(std::vector<CompactLayer> layers, compressor(prefixes_[i], spec, i));
    for (const CompactLayer& layer : layers) packed += layer.bytes.size();
    full += prefixes_[i].full_bytes();
    ASSIGN_OR_RETURN(std::unique_ptr<model::CompactKvCache> cache,
                     model::CompactKvCache::Create(c, std::move(layers), attention_, n_cont));
    // New tokens' RoPE positions continue at the blobs' seq_len: it must be the prefix length.
    if (cache->position() != p) {
      return absl::InvalidArgumentError(absl::StrCat("compressor: blobs have seq_len ",
                                                     cache->position(), ", the prefix has ", p));
    }
    for (int t = 0; t < n_cont; ++t) {
      RETURN_IF_ERROR(
          model_->DecodeStep(sequences_[i][p + t], cache.get(), absl::MakeSpan(logits), &attn));
      LogSoftmax(logits.data(), vocab, logp.data());
      const double* ref = &ref_logp_[i][static_cast<size_t>(t) * vocab];
      double kl = 0;
      for (int v = 0; v < vocab; ++v) kl += std::exp(ref[v]) * (ref[v] - logp[v]);
      kl = std::max(kl, 0.0);  // rounding can make identical distributions -1e-17
      kl_sum += kl;
      m.max_kl = std::max(m.max_kl, kl);
      if (ArgMax(logits.data(), vocab) == ref_top1_[i][t]) ++agree;
      const float* ref_attn = &ref_attn_[i][static_cast<size_t>(t) * attn.size()];
      for (int l = 0; l < c.n_layers; ++l) {
        double diff = 0, norm = 0;
        for (int d = 0; d < c.dim; ++d) {
          const double o_f = ref_attn[l * c.dim + d], o_c = attn[l * c.dim + d];
          diff += (o_c - o_f) * (o_c - o_f);
          norm += o_f * o_f;
        }
        m.attn_rel_err[l] += norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
      }
    }
  }
  m.steps = options_.num_sequences * n_cont;
  m.top1_agreement = static_cast<double>(agree) / m.steps;
  m.mean_kl = kl_sum / m.steps;
  for (double& e : m.attn_rel_err) {
    e /= m.steps;
    m.mean_attn_rel_err += e / c.n_layers;
  }
  m.size_ratio = full > 0 ? static_cast<double>(packed) / full : 0;
  return m;
}

absl::StatusOr<int> ResolveQuantGroup(int requested, int head_dim) {
  if (requested < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quant_group: ", requested, " must be >= 0 (0 = the default)"));
  }
  const int group = requested > 0 ? requested : std::min(32, head_dim);
  if (group <= 0 || head_dim % group != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("quant_group: ", group, " must divide head_dim ", head_dim));
  }
  return group;
}

std::vector<SweepEntry> DefaultSweep(int quant_group) {
  std::vector<SweepEntry> out;
  const EvictionPolicy policies[] = {EvictionPolicy::kStreaming, EvictionPolicy::kH2O,
                                     EvictionPolicy::kSnapKV,    EvictionPolicy::kKeyformer,
                                     EvictionPolicy::kKNorm,     EvictionPolicy::kRandom};
  for (EvictionPolicy policy : policies) {
    for (double ratio : {1.0, 0.75, 0.5, 0.25}) {
      SweepEntry e;
      e.family = "eviction";
      e.policy = std::string(PolicyName(policy));
      e.keep_ratio = ratio;
      e.label = absl::StrFormat("%s@%.2f", e.policy, ratio);
      e.spec.eviction.policy = policy;
      e.spec.eviction.keep_ratio = ratio;
      out.push_back(e);
    }
  }
  for (double lambda : {0.25, 0.5}) {
    SweepEntry e;
    e.family = "think";
    e.policy = "snapkv";
    e.keep_ratio = 0.5;
    e.label = absl::StrFormat("snapkv@0.50+think%.2f", lambda);
    e.spec.eviction.policy = EvictionPolicy::kSnapKV;
    e.spec.eviction.keep_ratio = 0.5;
    e.spec.channels.key_policy = ChannelPolicy::kThink;
    e.spec.channels.key_lambda = lambda;
    out.push_back(e);
  }
  for (int bits : {4, 2}) {
    SweepEntry e;
    e.family = "quant";
    e.policy = "none";
    e.label = absl::StrFormat("quant%d/g%d", bits, quant_group);
    e.spec.quant.bits = bits;
    e.spec.quant.group_size = quant_group;
    out.push_back(e);
  }
  // Value-aware, expected-attention and query-agnostic scores. Labels are spec
  // strings; "stats=1" rows read calibration statistics instead of the observation queries.
  for (double ratio : {0.5, 0.25}) {
    for (const char* base : {"h2o", "snapkv", "keyformer"}) {
      for (const char* weight : {"mul", "add"}) {
        SweepEntry e;
        e.family = "scores";
        e.policy = base;
        e.keep_ratio = ratio;
        e.spec.eviction.policy = *ParseEvictionPolicy(base);
        e.spec.eviction.keep_ratio = ratio;
        e.spec.eviction.value_weight = *ParseValueWeight(weight);
        e.label = SpecString(e.spec);
        out.push_back(e);
      }
    }
    for (const char* extra : {"expected:%s", "expected:%s,stats=1", "keydiff:%s"}) {
      absl::StatusOr<CompressionSpec> spec =
          ParseSpecString(absl::StrReplaceAll(extra, {{"%s", absl::StrCat(ratio)}}));
      if (!spec.ok()) continue;
      SweepEntry e;
      e.family = "scores";
      e.policy = std::string(PolicyName(spec->eviction.policy));
      e.keep_ratio = ratio;
      e.spec = *spec;
      e.label = SpecString(e.spec);
      out.push_back(e);
    }
  }
  return out;
}

}  // namespace kvc::fidelity

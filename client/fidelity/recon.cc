#include "kvc/fidelity/recon.h"

#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <new>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kvc/status_macros.h"

namespace kvc::fidelity {

absl::Status CheckReconstructionFits(const model::LlamaConfig& config, int64_t context_len,
                                     int64_t prompt_len) {
  if (context_len < 1) {
    return absl::InvalidArgumentError("kvzip: the context to reconstruct is empty");
  }
  // Both lengths come from in-memory vectors or int flags: the sum cannot overflow 64 bits.
  const int64_t total = 2 * context_len + prompt_len;
  if (total > config.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kvzip: the reconstruction pass runs 2 x ", context_len, " context + ", prompt_len,
        " prompt = ", total, " positions, past the model's seq_len ", config.seq_len,
        " (use a shorter context)"));
  }
  return absl::OkStatus();
}

absl::Status CheckKVzipPrompt(const model::LlamaConfig& config, absl::Span<const int32_t> prompt) {
  for (int32_t t : prompt) {
    if (t < 0 || t >= config.vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("kvzip_prompt: token ", t,
                                                     " is outside [0, vocab ", config.vocab_size,
                                                     ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> ParseTokenIds(absl::string_view text, absl::string_view flag) {
  std::vector<int32_t> out;
  for (absl::string_view item : absl::StrSplit(text, absl::ByAnyChar(", \t"), absl::SkipEmpty())) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(item, &id) || id < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, ": '", item, "' is not a token id (a non-negative integer)"));
    }
    out.push_back(id);
  }
  return out;
}

bool NeedsReconstruction(const CompressionSpec& spec) {
  return spec.eviction.policy == EvictionPolicy::kKVzip;
}

absl::Status CheckReconstructionSpec(const CompressionSpec& spec) {
  if (NeedsReconstruction(spec) && !spec.eviction.pass_rows.empty()) {
    return absl::InvalidArgumentError(
        "spec: kvzip with passes=...: the fidelity tools run one reconstruction pass over the "
        "whole context; drop passes= (every row then sees all of the context's keys)");
  }
  return absl::OkStatus();
}

absl::StatusOr<ReconstructionPass> RunReconstruction(const model::Transformer& model,
                                                     absl::Span<const int32_t> context,
                                                     absl::Span<const int32_t> prompt) {
  const model::LlamaConfig& c = model.config();
  const int64_t s = static_cast<int64_t>(context.size());
  const int64_t total = 2 * s + static_cast<int64_t>(prompt.size());
  RETURN_IF_ERROR(CheckReconstructionFits(c, s, static_cast<int64_t>(prompt.size())));
  const int n = static_cast<int>(total), w = n - static_cast<int>(s), hd = c.head_dim();
  const int group = c.n_heads / c.n_kv_heads;
  std::vector<int32_t> tokens;
  tokens.reserve(n);
  tokens.insert(tokens.end(), context.begin(), context.end());
  tokens.insert(tokens.end(), prompt.begin(), prompt.end());
  tokens.insert(tokens.end(), context.begin(), context.end());
  model::ForwardOptions options;
  options.last_logits = 0;
  ASSIGN_OR_RETURN(model::ForwardOutput fwd, model.Forward(tokens, options));

  ReconstructionPass out;
  out.context_len = static_cast<int>(s);
  out.rows = w;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  constexpr int kBlock = 256;  // rows whose logits are computed at once (kBlock x W floats)
  try {
    out.q.resize(c.n_layers);
    out.log_mass.resize(c.n_layers);
    std::vector<float> logits(static_cast<size_t>(std::min(w, kBlock)) * w);
    for (int l = 0; l < c.n_layers; ++l) {
      const model::LayerProjections& lp = fwd.layers[l];
      std::vector<float>& q = out.q[l];
      std::vector<float>& mass = out.log_mass[l];
      q.resize(static_cast<size_t>(c.n_heads) * w * hd);
      mass.resize(static_cast<size_t>(c.n_heads) * w);
      for (int h = 0; h < c.n_heads; ++h) {
        const float* qh = &lp.q[(static_cast<size_t>(h) * n + s) * hd];
        std::copy(qh, qh + static_cast<size_t>(w) * hd, &q[static_cast<size_t>(h) * w * hd]);
        const float* kh = &lp.k[(static_cast<size_t>(h / group) * n + s) * hd];
        for (int r0 = 0; r0 < w; r0 += kBlock) {
          // Rows r0 .. r0 + nr - 1 (positions S + r) attend to the pass's keys S .. S + r: the
          // block's logits against the first r0 + nr keys, then each row's causal part.
          const int nr = std::min(kBlock, w - r0), keys = r0 + nr;
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, keys, hd, scale,
                      qh + static_cast<size_t>(r0) * hd, hd, kh, hd, 0.0f, logits.data(), keys);
          for (int i = 0; i < nr; ++i) {
            const float* row = &logits[static_cast<size_t>(i) * keys];
            const int seen = r0 + i + 1;
            const float peak = *std::max_element(row, row + seen);
            double sum = 0;
            for (int j = 0; j < seen; ++j) sum += std::exp(static_cast<double>(row[j]) - peak);
            mass[static_cast<size_t>(h) * w + r0 + i] = static_cast<float>(peak + std::log(sum));
          }
        }
      }
      std::vector<float>().swap(fwd.layers[l].q);  // done with this layer's projections
      std::vector<float>().swap(fwd.layers[l].k);
      std::vector<float>().swap(fwd.layers[l].v);
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kvzip: the reconstruction rows of ", s, " tokens cannot be allocated"));
  }
  return out;
}

}  // namespace kvc::fidelity

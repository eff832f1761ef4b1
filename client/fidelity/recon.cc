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

std::vector<ReconPassPlan> PlanReconstruction(absl::Span<const int32_t> context,
                                              const ReconPrompts& prompts) {
  const int s = static_cast<int>(context.size());
  std::vector<ReconPassPlan> out;
  if (prompts.chunk <= 0 || s <= prompts.chunk) {
    out.push_back({0, s, prompts.prompt});
    return out;
  }
  for (int start = 0; start < s; start += std::min(prompts.chunk, s - start)) {
    ReconPassPlan pass;
    pass.start = start;
    pass.end = start + std::min(prompts.chunk, s - start);
    if (start == 0) {
      pass.head = prompts.prompt;
    } else {
      pass.head = prompts.part_prompt;
      pass.head.insert(pass.head.end(), context.begin() + std::max(0, start - kReconOverlap),
                       context.begin() + start);
      pass.head.insert(pass.head.end(), prompts.part_suffix.begin(), prompts.part_suffix.end());
    }
    out.push_back(std::move(pass));
  }
  return out;
}

namespace {

// Tokens of the longest pass of a `context_len`-token context (its head and chunk).
int64_t LongestPass(int64_t context_len, const ReconPrompts& p) {
  if (p.chunk <= 0 || context_len <= p.chunk) {
    return static_cast<int64_t>(p.prompt.size()) + context_len;
  }
  // A later pass starts at a multiple of the chunk: its overlap is min(kReconOverlap, chunk).
  const int64_t later = static_cast<int64_t>(p.part_prompt.size()) +
                        std::min(kReconOverlap, p.chunk) +
                        static_cast<int64_t>(p.part_suffix.size());
  return std::max<int64_t>(static_cast<int64_t>(p.prompt.size()), later) + p.chunk;
}

absl::Status CheckIds(const model::LlamaConfig& config, absl::Span<const int32_t> ids,
                      absl::string_view what) {
  for (int32_t t : ids) {
    if (t < 0 || t >= config.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": token ", t, " is outside [0, vocab ", config.vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckReconstructionFits(const model::LlamaConfig& config, int64_t context_len,
                                     const ReconPrompts& prompts) {
  if (context_len < 1) {
    return absl::InvalidArgumentError("kvzip: the context to reconstruct is empty");
  }
  // The lengths come from in-memory vectors or int flags: the sums cannot overflow 64 bits.
  const int64_t pass = LongestPass(context_len, prompts), total = context_len + pass;
  if (total > config.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kvzip: a reconstruction pass runs ", context_len, " context + ", pass,
        " pass tokens = ", total, " positions, past the model's seq_len ", config.seq_len,
        " (use a shorter context", prompts.chunk > 0 ? " or a smaller --kvzip_chunk" : "", ")"));
  }
  return absl::OkStatus();
}

absl::Status CheckKVzipPrompts(const model::LlamaConfig& config, const ReconPrompts& prompts) {
  RETURN_IF_ERROR(CheckIds(config, prompts.prompt, "kvzip_prompt"));
  RETURN_IF_ERROR(CheckIds(config, prompts.part_prompt, "kvzip_part_prompt"));
  RETURN_IF_ERROR(CheckIds(config, prompts.part_suffix, "kvzip_part_suffix"));
  if (prompts.chunk < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("kvzip_chunk: ", prompts.chunk, " must be >= 0 (0: one pass)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<ReconPrompts> ParseReconPrompts(absl::string_view prompt,
                                               absl::string_view part_prompt,
                                               absl::string_view part_suffix, int chunk) {
  ReconPrompts out;
  ASSIGN_OR_RETURN(out.prompt, ParseTokenIds(prompt, "--kvzip_prompt"));
  ASSIGN_OR_RETURN(out.part_prompt, ParseTokenIds(part_prompt, "--kvzip_part_prompt"));
  ASSIGN_OR_RETURN(out.part_suffix, ParseTokenIds(part_suffix, "--kvzip_part_suffix"));
  if (chunk < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kvzip_chunk: ", chunk, " must be >= 0 (0: one pass)"));
  }
  out.chunk = chunk;
  return out;
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
        "spec: kvzip with passes=...: the fidelity tools plan each document's reconstruction "
        "passes themselves (--kvzip_chunk); drop passes= and chunk=");
  }
  return absl::OkStatus();
}

CompressionSpec SpecForPasses(const CompressionSpec& spec, const ReconstructionPass* pass) {
  CompressionSpec out = spec;
  if (pass != nullptr && !pass->pass_rows.empty()) {
    out.eviction.pass_rows = pass->pass_rows;
    out.eviction.pass_tokens = pass->pass_tokens;
  }
  return out;
}

absl::StatusOr<ReconstructionPass> RunReconstruction(const model::Transformer& model,
                                                     absl::Span<const int32_t> context,
                                                     const ReconPrompts& prompts) {
  const model::LlamaConfig& c = model.config();
  const int64_t s = static_cast<int64_t>(context.size());
  RETURN_IF_ERROR(CheckKVzipPrompts(c, prompts));
  RETURN_IF_ERROR(CheckReconstructionFits(c, s, prompts));
  const std::vector<ReconPassPlan> plan = PlanReconstruction(context, prompts);
  const int hd = c.head_dim(), group = c.n_heads / c.n_kv_heads;
  int w = 0;  // every pass fits the model: the sum of their rows cannot overflow an int
  for (const ReconPassPlan& p : plan) w += p.rows();

  ReconstructionPass out;
  out.context_len = static_cast<int>(s);
  out.rows = w;
  if (plan.size() > 1) {
    for (const ReconPassPlan& p : plan) {
      out.pass_rows.push_back(p.rows());
    }
    out.pass_tokens = prompts.chunk;
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  constexpr int kBlock = 256;  // rows whose logits are computed at once (kBlock x rows floats)
  try {
    out.q.resize(c.n_layers);
    out.log_mass.resize(c.n_layers);
    for (int l = 0; l < c.n_layers; ++l) {
      out.q[l].resize(static_cast<size_t>(c.n_heads) * w * hd);
      out.log_mass[l].resize(static_cast<size_t>(c.n_heads) * w);
    }
    std::vector<float> logits;
    int row0 = 0;  // the pass's first row among the W
    for (const ReconPassPlan& p : plan) {
      std::vector<int32_t> tokens(context.begin(), context.end());
      tokens.insert(tokens.end(), p.head.begin(), p.head.end());
      tokens.insert(tokens.end(), context.begin() + p.start, context.begin() + p.end);
      const int rows = p.rows(), n = static_cast<int>(s) + rows;
      model::ForwardOptions options;
      options.last_logits = 0;
      ASSIGN_OR_RETURN(model::ForwardOutput fwd, model.Forward(tokens, options));
      logits.resize(static_cast<size_t>(std::min(rows, kBlock)) * rows);
      for (int l = 0; l < c.n_layers; ++l) {
        const model::LayerProjections& lp = fwd.layers[l];
        for (int h = 0; h < c.n_heads; ++h) {
          const float* qh = &lp.q[(static_cast<size_t>(h) * n + s) * hd];
          std::copy(qh, qh + static_cast<size_t>(rows) * hd,
                    &out.q[l][(static_cast<size_t>(h) * w + row0) * hd]);
          float* mass = &out.log_mass[l][static_cast<size_t>(h) * w + row0];
          const float* kh = &lp.k[(static_cast<size_t>(h / group) * n + s) * hd];
          for (int r0 = 0; r0 < rows; r0 += kBlock) {
            // Rows r0 .. r0 + nr - 1 (positions S + r) attend to the pass's keys S .. S + r: the
            // block's logits against the first r0 + nr keys, then each row's causal part.
            const int nr = std::min(kBlock, rows - r0), keys = r0 + nr;
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, keys, hd, scale,
                        qh + static_cast<size_t>(r0) * hd, hd, kh, hd, 0.0f, logits.data(), keys);
            for (int i = 0; i < nr; ++i) {
              const float* row = &logits[static_cast<size_t>(i) * keys];
              const int seen = r0 + i + 1;
              const float peak = *std::max_element(row, row + seen);
              double sum = 0;
              for (int j = 0; j < seen; ++j) sum += std::exp(static_cast<double>(row[j]) - peak);
              mass[r0 + i] = static_cast<float>(peak + std::log(sum));
            }
          }
        }
        std::vector<float>().swap(fwd.layers[l].q);  // done with this layer's projections
        std::vector<float>().swap(fwd.layers[l].k);
        std::vector<float>().swap(fwd.layers[l].v);
      }
      row0 += rows;
    }
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat("kvzip: the reconstruction rows of ", s, " tokens cannot be allocated"));
  }
  return out;
}

}  // namespace kvc::fidelity

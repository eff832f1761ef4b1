// kvcfidelity: how much a compressed KV cache changes what a real model predicts. Samples
// sequences from a llama2.c checkpoint (or reads them), compresses each prefix's cache with every
// row's spec in two scenarios (question inside the compressed prompt, question after
// compression), decodes the continuation teacher-forced on the compact cache and compares with
// full-cache decoding (top-1 agreement, KL, per-layer attention error), over one or more seeds.
//
//   kvcfidelity --model stories260K.bin --csv out.csv --svg out.svg
//   kvcfidelity --model stories260K.bin --spec 'snapkv:0.5;keyformer:0.5+think:0.5+q4' --seeds 3
//   kvcfidelity --model stories260K.bin --via 127.0.0.1:50051   # through a running kvcd
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "kvc/backend.h"
#include "kvc/fidelity/backend_flags.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/fidelity/recon_flags.h"
#include "kvc/fidelity/report.h"
#include "kvc/fidelity/stats.h"
#include "kvc/fidelity/via_kvcd.h"
#include "kvc/model/transformer.h"
#include "kvc/status_macros.h"

ABSL_FLAG(std::string, model, "", "llama2.c checkpoint (required)");
ABSL_FLAG(std::string, spec, "",
          "rows to evaluate: spec strings separated by ';' (each may hold ',' and '+'), e.g. "
          "'snapkv:0.5;keyformer:0.5+think:0.5+q4;h2o@64,recent=0.25'. The item 'default' "
          "stands for the default sweep. Empty = the default sweep. 'q4' without a group gets "
          "--quant_group");
ABSL_FLAG(int, sequences, 16, "sequences per seed");
ABSL_FLAG(int, seeds, 1,
          "repeat every row over this many seeds: seed r samples its own sequences (sampling "
          "seeds seed + r*sequences + i) and advances the policies' noise seed by r");
ABSL_FLAG(std::string, scenarios, "both",
          "inside, after or both (comma-separated list). inside: the compressed prefix is the "
          "prompt s[0,P) and the observation window is its last W tokens (the question). after: "
          "only s[0,P-W) is compressed, with no queries when the spec can do without, else the "
          "queries of its own last W positions; the question s[P-W,P) is then decoded "
          "uncompressed. Both then score the same C steps s[P,P+C)");
ABSL_FLAG(int, prefix, 256, "P: prompt tokens before the scored continuation");
ABSL_FLAG(int, continuation, 64, "C: tokens decoded teacher-forced on the compressed cache");
ABSL_FLAG(int, window, 32,
          "W: observation window and question length (the last W prompt tokens); clamped to P. "
          "0: no queries at all; rows that need queries are skipped, and the scenarios coincide");
ABSL_FLAG(double, temperature, 1.0, "sampling temperature of the sequences");
ABSL_FLAG(uint64_t, seed, 1, "sampling seed of the first sequence");
ABSL_FLAG(int, quant_group, 0,
          "quantization group size; 0 = min(32, head_dim); must divide head_dim");
ABSL_FLAG(std::string, only, "",
          "comma-separated label prefixes or families (eviction, think, quant, combined) of the "
          "rows to run; matching nothing is an error");
ABSL_FLAG(std::string, csv, "", "write the results as CSV to this file (row by row)");
ABSL_FLAG(std::string, png, "",
          "write top-1 agreement vs size, one panel per scenario, to this PNG file (rendered "
          "from the SVG by rsvg-convert, Debian package librsvg2-bin)");
ABSL_FLAG(std::string, svg, "", "the same plot as SVG");
ABSL_FLAG(std::string, via, "",
          "kvcd address: compress through PutCache/GetCache(PACKED) as well as in-process, check "
          "that the numbers are equal, and report the served ones");
ABSL_FLAG(std::string, dump_sequences, "",
          "write the sequences used (every seed, in order: seed 0's first) to this file, one a "
          "line, token ids separated by spaces; --sequences_file reads it back");
ABSL_FLAG(std::string, tokens_out, "", "old name of --dump_sequences (same format)");
ABSL_FLAG(std::string, sequences_file, "",
          "evaluate these sequences instead of sampling: a file as --dump_sequences writes (at "
          "least seeds x sequences lines, each of at least P + C token ids; seed r uses lines "
          "r*sequences.. of it, extra lines and tokens are ignored)");
namespace kvc::fidelity {
namespace {

bool SameMetrics(const Metrics& a, const Metrics& b) {
  return a.steps == b.steps && a.top1_agreement == b.top1_agreement && a.mean_kl == b.mean_kl &&
         a.max_kl == b.max_kl && a.attn_rel_err == b.attn_rel_err &&
         a.mean_attn_rel_err == b.mean_attn_rel_err && a.compact_bytes == b.compact_bytes &&
         a.seq_top1 == b.seq_top1 && a.seq_kl == b.seq_kl;
}

absl::StatusOr<std::vector<std::vector<int32_t>>> ReadSequences(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    return absl::InvalidArgumentError(absl::StrCat("--sequences_file: cannot read '", path, "'"));
  std::vector<std::vector<int32_t>> out;
  std::string line;
  while (std::getline(in, line)) {
    std::vector<int32_t> seq;
    for (absl::string_view tok :
         absl::StrSplit(line, absl::ByAnyChar(" \t\r"), absl::SkipEmpty())) {
      int32_t id;
      if (!absl::SimpleAtoi(tok, &id)) {
        return absl::InvalidArgumentError(absl::StrCat("--sequences_file: line ", out.size() + 1,
                                                       ": '", tok, "' is not a token id"));
      }
      seq.push_back(id);
    }
    if (!seq.empty()) out.push_back(std::move(seq));
  }
  return out;
}

absl::StatusOr<std::vector<SweepEntry>> Rows(int group) {
  const std::string list = absl::GetFlag(FLAGS_spec);
  std::vector<SweepEntry> rows;
  if (list.empty()) {
    rows = DefaultSweep(group);
  } else {
    // "default" items expand to the default sweep, in place.
    std::vector<std::string> pending;
    auto flush = [&]() -> absl::Status {
      if (pending.empty()) return absl::OkStatus();
      ASSIGN_OR_RETURN(std::vector<SweepEntry> parsed,
                       ParseSpecList(absl::StrJoin(pending, ";"), group));
      rows.insert(rows.end(), parsed.begin(), parsed.end());
      pending.clear();
      return absl::OkStatus();
    };
    for (absl::string_view item : absl::StrSplit(list, ';', absl::SkipWhitespace())) {
      if (absl::StripAsciiWhitespace(item) == "default") {
        RETURN_IF_ERROR(flush());
        for (SweepEntry& e : DefaultSweep(group)) rows.push_back(std::move(e));
      } else {
        pending.emplace_back(item);
      }
    }
    RETURN_IF_ERROR(flush());
    if (rows.empty()) return absl::InvalidArgumentError("--spec: no spec strings in the list");
  }
  return FilterOnly(std::move(rows), absl::GetFlag(FLAGS_only));
}

absl::Status Run() {
  const std::string model_path = absl::GetFlag(FLAGS_model);
  if (model_path.empty()) return absl::InvalidArgumentError("--model: required");
  ASSIGN_OR_RETURN(model::Transformer model, model::Transformer::Load(model_path));
  const model::LlamaConfig& c = model.config();

  RunOptions options;
  options.num_sequences = absl::GetFlag(FLAGS_sequences);
  options.prefix_len = absl::GetFlag(FLAGS_prefix);
  options.continuation = absl::GetFlag(FLAGS_continuation);
  options.obs_window = std::min(absl::GetFlag(FLAGS_window), options.prefix_len);
  options.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
  options.seed = absl::GetFlag(FLAGS_seed);
  ASSIGN_OR_RETURN(options.kvzip, ReconPromptsFromFlags());
  RETURN_IF_ERROR(ValidateRunOptions(options, c));
  const int seeds = absl::GetFlag(FLAGS_seeds);
  if (seeds < 1)
    return absl::InvalidArgumentError(absl::StrCat("--seeds: ", seeds, " must be >= 1"));
  ASSIGN_OR_RETURN(const int group,
                   ResolveQuantGroup(absl::GetFlag(FLAGS_quant_group), c.head_dim()));
  ASSIGN_OR_RETURN(std::vector<Scenario> scenarios, ParseScenarios(absl::GetFlag(FLAGS_scenarios)));
  const int w = options.obs_window, p = options.prefix_len;
  std::vector<std::string> notes;
  if (w == 0 && scenarios.size() == 2) {
    scenarios = {Scenario::kInside};
    notes.push_back("W = 0: no question, the scenarios coincide; running 'inside' only");
  }
  for (Scenario s : scenarios) {
    if (s == Scenario::kAfter && p <= w) {
      return absl::InvalidArgumentError(
          absl::StrCat("--scenarios after: needs --prefix > --window (", p, " <= ", w, ")"));
    }
  }
  ASSIGN_OR_RETURN(std::vector<SweepEntry> rows, Rows(group));
  // kvzip rows are refused now, not after the others ran: the longest compressed prefix (P
  // inside, P - W after) and its longest reconstruction pass must fit the model.
  const bool inside =
      std::find(scenarios.begin(), scenarios.end(), Scenario::kInside) != scenarios.end();
  const absl::Status fits =
      CheckReconstructionFits(c, inside ? p : p - w, options.kvzip);
  for (const SweepEntry& entry : rows) {
    if (!NeedsReconstruction(entry.spec)) continue;
    for (const absl::Status& st : {CheckReconstructionSpec(entry.spec), fits}) {
      if (!st.ok()) return absl::Status(st.code(), absl::StrCat(entry.label, ": ", st.message()));
    }
  }

  // Every output path is checked before the run, not after it.
  std::string dump = absl::GetFlag(FLAGS_dump_sequences);
  if (dump.empty()) dump = absl::GetFlag(FLAGS_tokens_out);
  const std::string csv_path = absl::GetFlag(FLAGS_csv), png = absl::GetFlag(FLAGS_png),
                    svg = absl::GetFlag(FLAGS_svg);
  if (!png.empty()) {
    RETURN_IF_ERROR(CheckWritable(png, "--png"));
    RETURN_IF_ERROR(PngWriterAvailable());
  }
  if (!svg.empty()) RETURN_IF_ERROR(CheckWritable(svg, "--svg"));
  if (!dump.empty()) RETURN_IF_ERROR(CheckWritable(dump, "--dump_sequences"));
  std::ofstream csv;
  if (!csv_path.empty()) {
    csv.open(csv_path, std::ios::trunc);
    if (!csv) {
      return absl::InvalidArgumentError(absl::StrCat("--csv: cannot write '", csv_path, "'"));
    }
  }

  std::vector<std::vector<int32_t>> file_sequences;
  if (const std::string path = absl::GetFlag(FLAGS_sequences_file); !path.empty()) {
    ASSIGN_OR_RETURN(file_sequences, ReadSequences(path));
    const size_t need = static_cast<size_t>(seeds) * options.num_sequences;
    if (file_sequences.size() < need) {
      return absl::InvalidArgumentError(
          absl::StrCat("--sequences_file: '", path, "' has ", file_sequences.size(),
                       " sequences, --seeds x --sequences needs ", need));
    }
  }

  ASSIGN_OR_RETURN(const BackendOptions backend_options, BackendOptionsFromFlags());
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateCpuBackend(backend_options));

  std::printf("model %s: dim %d, layers %d, heads %d/%d (head_dim %d), vocab %d, context %d\n",
              model_path.c_str(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(),
              c.vocab_size, c.seq_len);
  std::printf(
      "%d seeds x %d sequences (%s), P=%d, C=%d, W=%d, quant group %d, %s\n", seeds,
      options.num_sequences,
      file_sequences.empty()
          ? absl::StrFormat(
                "sampled at T=%.2f, sampling seeds %llu..%llu", options.temperature,
                static_cast<unsigned long long>(options.seed),
                static_cast<unsigned long long>(options.seed + seeds * options.num_sequences - 1))
                .c_str()
          : absl::StrCat("from ", absl::GetFlag(FLAGS_sequences_file)).c_str(),
      p, options.continuation, w, group, backend->description().c_str());
  std::printf(
      "scenarios: inside = compress s[0,P), window = its last W queries (the question); after = "
      "compress s[0,P-W) (no queries unless the spec needs them, then its own last W), decode "
      "the question s[P-W,P) uncompressed; both score s[P,P+C)\n");
  std::printf(
      "top1/mean_KL: mean over all sequences; ±: sample std dev of the per-seed means; [95%% CI]: "
      "percentile bootstrap of the mean over sequences (%d resamples, all seeds pooled)\n",
      kBootstrapResamples);
  for (const std::string& note : notes) std::printf("note: %s\n", note.c_str());

  const auto start = std::chrono::steady_clock::now();
  std::vector<std::unique_ptr<FidelityEval>> evals;
  for (int r = 0; r < seeds; ++r) {
    RunOptions o = options;
    o.seed = options.seed + static_cast<uint64_t>(r) * options.num_sequences;
    if (!file_sequences.empty()) {
      o.given_sequences.assign(file_sequences.begin() + r * options.num_sequences,
                               file_sequences.begin() + (r + 1) * options.num_sequences);
    }
    ASSIGN_OR_RETURN(std::unique_ptr<FidelityEval> eval,
                     FidelityEval::Create(&model, o, backend.get()));
    evals.push_back(std::move(eval));
  }
  if (!dump.empty()) {
    std::ofstream out(dump, std::ios::trunc);
    for (const auto& eval : evals) {
      for (const std::vector<int32_t>& seq : eval->sequences()) {
        out << absl::StrJoin(seq, " ") << "\n";
      }
    }
    if (!out.flush()) {
      return absl::InvalidArgumentError(absl::StrCat("--dump_sequences: cannot write ", dump));
    }
  }

  const std::string via = absl::GetFlag(FLAGS_via);
  std::unique_ptr<Client> client;
  Compressor remote;
  if (!via.empty()) {
    ClientOptions client_options;
    client_options.target = via;
    ASSIGN_OR_RETURN(client, Client::Create(client_options));
    remote = KvcdCompressor(client.get(), absl::StrCat("kvcfidelity-", ::getpid()));
  }
  const Compressor local = InProcessCompressor(backend.get());
  LayerShape query_shape;  // for telling which rows need queries
  query_shape.num_kv_heads = c.n_kv_heads;
  query_shape.num_q_heads = c.n_heads;
  query_shape.seq_len = p;
  query_shape.head_dim = c.head_dim();
  query_shape.obs_window = 1;

  std::printf("\n%s\n", FormatTableHeader(c.n_layers).c_str());
  std::fflush(stdout);
  if (csv.is_open()) csv << FormatCsvHeader(c.n_layers) << "\n" << std::flush;
  std::vector<SweepResult> results;
  int mismatches = 0, skipped = 0;
  for (const SweepEntry& entry : rows) {
    if (w == 0 && NeedsQueries(entry.spec, query_shape) && !NeedsReconstruction(entry.spec)) {
      ++skipped;
      std::printf("%-30s skipped: needs observation queries and --window is 0\n",
                  entry.label.c_str());
      std::fflush(stdout);
      continue;
    }
    for (Scenario scenario : scenarios) {
      std::vector<Metrics> per_seed;
      for (int r = 0; r < seeds; ++r) {
        const CompressionSpec spec = ForSeed(entry.spec, r);
        const std::string where =
            absl::StrCat(entry.label, " (", ScenarioName(scenario), ", seed ", r, ")");
        absl::StatusOr<Metrics> m = evals[r]->Evaluate(spec, local, scenario);
        if (!m.ok()) {
          return absl::Status(m.status().code(), absl::StrCat(where, ": ", m.status().message()));
        }
        if (remote) {
          absl::StatusOr<Metrics> got = evals[r]->Evaluate(spec, remote, scenario);
          if (!got.ok()) {
            return absl::Status(got.status().code(),
                                absl::StrCat(where, " via kvcd: ", got.status().message()));
          }
          if (!SameMetrics(*m, *got)) {
            ++mismatches;
            std::printf("MISMATCH %s: in-process top1 %.6f KL %.6e, via kvcd top1 %.6f KL %.6e\n",
                        where.c_str(), m->top1_agreement, m->mean_kl, got->top1_agreement,
                        got->mean_kl);
          }
          m = got;  // report what decoding on the served blobs gave
        }
        per_seed.push_back(*std::move(m));
      }
      results.push_back(MakeResult(entry, scenario, per_seed));
      std::printf("%s\n", FormatTableRow(results.back()).c_str());
      std::fflush(stdout);
      if (csv.is_open()) csv << FormatCsvRow(results.back(), c.n_layers) << "\n" << std::flush;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "\nsize: compact bytes / full fp32 K+V bytes of the compressed prefix; bytes/seq: compact "
      "bytes per sequence (all layers); W: observation queries sent; top1: agreement of argmax "
      "with full-cache decoding; KL(full || compressed) in nats; attn_err: mean ||o_c - o_f|| / "
      "||o_f|| of each layer's attention output for the full model's continuation queries over "
      "the compressed vs the full cache (L0..: per layer)\n");
  if (skipped > 0) std::printf("%d rows skipped: they need queries and W = 0\n", skipped);
  if (!via.empty()) {
    std::printf("via kvcd %s: %zu rows x %d seeds, %d differ from in-process\n", via.c_str(),
                results.size(), seeds, mismatches);
  }
  std::printf("%.1f s\n", seconds);

  if (csv.is_open()) {
    csv.close();
    if (!csv) return absl::InternalError(absl::StrCat("--csv: cannot write '", csv_path, "'"));
  }
  const std::string title = absl::StrFormat("P=%d C=%d W=%d, %dx%d seqs", p, options.continuation,
                                            w, seeds, options.num_sequences);
  if (!png.empty()) RETURN_IF_ERROR(WritePng(AgreementPlots(results, title), png));
  if (!svg.empty()) RETURN_IF_ERROR(WriteSvg(AgreementPlots(results, title), svg));
  if (mismatches > 0) {
    return absl::InternalError(absl::StrCat(mismatches, " rows differ via kvcd"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvc::fidelity

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Fidelity of compressed KV caches on a llama2.c model. Example:\n"
      "  kvcfidelity --model stories260K.bin --seeds 3 --csv fidelity.csv --svg fidelity.svg\n"
      "  kvcfidelity --model stories260K.bin --spec 'default;keyformer:0.5+think:0.5+q4'");
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = kvc::fidelity::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "kvcfidelity: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

// kvcfidelity: how much a compressed KV cache changes what a real model predicts. Samples
// sequences from a llama2.c checkpoint, compresses each prefix's cache with every configuration of
// a sweep, decodes the continuation teacher-forced on the compact cache and compares with
// full-cache decoding (top-1 agreement, KL, attention-output error).
//
//   kvcfidelity --model stories260K.bin --csv out.csv --png out.png
//   kvcfidelity --model stories260K.bin --via 127.0.0.1:50051   # through a running kvcd
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvc/backend.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/fidelity/report.h"
#include "kvc/fidelity/via_kvcd.h"
#include "kvc/model/transformer.h"
#include "kvc/status_macros.h"

ABSL_FLAG(std::string, model, "", "llama2.c checkpoint (required)");
ABSL_FLAG(int, sequences, 16, "sequences sampled from BOS (seeds seed..seed+N-1)");
ABSL_FLAG(int, prefix, 256, "P: prefix tokens whose cache is compressed");
ABSL_FLAG(int, continuation, 64, "C: tokens decoded teacher-forced on the compressed cache");
ABSL_FLAG(int, window, 32, "W: observation window (last W prefix queries); clamped to P");
ABSL_FLAG(double, temperature, 1.0, "sampling temperature of the sequences");
ABSL_FLAG(uint64_t, seed, 1, "seed of the first sequence");
ABSL_FLAG(int, quant_group, 0,
          "quantization group size; 0 = min(32, head_dim); must divide head_dim");
ABSL_FLAG(std::string, only, "",
          "comma-separated config-label prefixes to run (e.g. 'snapkv,quant'); empty = all");
ABSL_FLAG(std::string, csv, "", "write the results as CSV to this file");
ABSL_FLAG(std::string, png, "", "write a plot of agreement vs keep ratio to this PNG file");
ABSL_FLAG(std::string, via, "",
          "kvcd address: compress through PutCache/GetCache(PACKED) instead of in-process, and "
          "check that the numbers equal the in-process ones");
ABSL_FLAG(int, threads, 1, "CPU backend threads (0 = all cores)");
ABSL_FLAG(std::string, tokens_out, "",
          "write the sampled sequences (prefix + continuation) to this file, one a line, token "
          "ids separated by spaces, so other implementations can evaluate the same sequences");

namespace kvc::fidelity {
namespace {

bool SameMetrics(const Metrics& a, const Metrics& b) {
  return a.steps == b.steps && a.top1_agreement == b.top1_agreement && a.mean_kl == b.mean_kl &&
         a.max_kl == b.max_kl && a.attn_rel_err == b.attn_rel_err &&
         a.mean_attn_rel_err == b.mean_attn_rel_err;
}

absl::Status WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
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
  RETURN_IF_ERROR(ValidateRunOptions(options, c));
  ASSIGN_OR_RETURN(const int group,
                   ResolveQuantGroup(absl::GetFlag(FLAGS_quant_group), c.head_dim()));

  BackendOptions backend_options;
  backend_options.num_threads = absl::GetFlag(FLAGS_threads);
  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateCpuBackend(backend_options));

  std::vector<SweepEntry> sweep = DefaultSweep(group);
  const std::string only = absl::GetFlag(FLAGS_only);
  if (!only.empty()) {
    std::vector<std::string> prefixes = absl::StrSplit(only, ',', absl::SkipEmpty());
    std::vector<SweepEntry> kept;
    for (SweepEntry& e : sweep) {
      for (const std::string& p : prefixes) {
        if (e.label.rfind(p, 0) == 0) {
          kept.push_back(e);
          break;
        }
      }
    }
    sweep = std::move(kept);
  }

  std::printf("model %s: dim %d, layers %d, heads %d/%d (head_dim %d), vocab %d, context %d\n",
              model_path.c_str(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(),
              c.vocab_size, c.seq_len);
  std::printf("sequences %d (T=%.2f, seeds %llu..), P=%d, C=%d, W=%d, quant group %d, %s\n",
              options.num_sequences, options.temperature,
              static_cast<unsigned long long>(options.seed), options.prefix_len,
              options.continuation, options.obs_window, group, backend->description().c_str());
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(std::unique_ptr<FidelityEval> eval,
                   FidelityEval::Create(&model, options, backend.get()));
  if (const std::string path = absl::GetFlag(FLAGS_tokens_out); !path.empty()) {
    std::ofstream out(path, std::ios::trunc);
    for (const std::vector<int32_t>& seq : eval->sequences()) {
      out << absl::StrJoin(seq, " ") << "\n";
    }
    if (!out.flush()) {
      return absl::InvalidArgumentError(absl::StrCat("--tokens_out: cannot write ", path));
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
  std::vector<SweepResult> results;
  int mismatches = 0;
  for (const SweepEntry& entry : sweep) {
    absl::StatusOr<Metrics> m = eval->Evaluate(entry.spec, local);
    if (!m.ok()) {
      return absl::Status(m.status().code(), absl::StrCat(entry.label, ": ", m.status().message()));
    }
    if (remote) {
      absl::StatusOr<Metrics> r = eval->Evaluate(entry.spec, remote);
      if (!r.ok()) {
        return absl::Status(r.status().code(),
                            absl::StrCat(entry.label, " via kvcd: ", r.status().message()));
      }
      if (!SameMetrics(*m, *r)) {
        ++mismatches;
        std::printf("MISMATCH %s: in-process top1 %.6f KL %.6e, via kvcd top1 %.6f KL %.6e\n",
                    entry.label.c_str(), m->top1_agreement, m->mean_kl, r->top1_agreement,
                    r->mean_kl);
      }
      m = r;  // report what decoding on the served blobs gave
    }
    results.push_back({entry, *m});
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("\n%s\n", FormatTable(results).c_str());
  std::printf(
      "size: compact bytes / full fp32 K+V bytes; top1: agreement of argmax with "
      "full-cache decoding; KL(full || compressed) in nats; attn_err: mean "
      "||o_c - o_f|| / ||o_f|| of attention outputs (L0..: per layer)\n");
  if (!via.empty()) {
    std::printf("via kvcd %s: %zu configs, %d differ from in-process\n", via.c_str(),
                results.size(), mismatches);
  }
  std::printf("%.1f s\n", seconds);

  if (const std::string csv = absl::GetFlag(FLAGS_csv); !csv.empty()) {
    RETURN_IF_ERROR(WriteFile(csv, FormatCsv(results)));
  }
  if (const std::string png = absl::GetFlag(FLAGS_png); !png.empty()) {
    const std::string title = absl::StrFormat(
        "top-1 agreement vs keep ratio (P=%d C=%d W=%d, %d seqs)", options.prefix_len,
        options.continuation, options.obs_window, options.num_sequences);
    RETURN_IF_ERROR(WritePng(RenderLinePlot(AgreementPlot(results, title)), png));
  }
  if (mismatches > 0) {
    return absl::InternalError(absl::StrCat(mismatches, " configs differ via kvcd"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvc::fidelity

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Fidelity of compressed KV caches on a llama2.c model. Example:\n"
      "  kvcfidelity --model stories260K.bin --csv fidelity.csv --png fidelity.png");
  absl::ParseCommandLine(argc, argv);
  const absl::Status status = kvc::fidelity::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "kvcfidelity: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

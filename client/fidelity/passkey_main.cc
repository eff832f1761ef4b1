// kvcpasskey: pass-key retrieval on compressed KV caches. Generates documents (prose lines with
// 1-4 "The pass key of <name> is <5 digits>." needles and a question about one of them at the
// end) for a byte-level model, or reads pre-tokenized documents (--documents_file, any model:
// kvc/fidelity/documents_file.h), and for every spec reports the fraction answered exactly
// (greedy) with the question inside the compressed prompt and with the question fed after
// compressing the haystack, next to the full-cache accuracy. Scenario definitions:
// kvc/fidelity/passkey.h.
//
//   kvcpasskey --model passkey4L.bin --csv passkey.csv
//   kvcpasskey --model passkey4L.bin --spec 'snapkv:0.25;h2o:0.25' --via 127.0.0.1:50051
//   kvcpasskey --model SmolLM2-135M-Instruct/ --documents_file docs.jsonl --csv out.csv
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
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kvc/backend.h"
#include "kvc/fidelity/backend_flags.h"
#include "kvc/fidelity/documents_file.h"
#include "kvc/fidelity/passkey.h"
#include "kvc/fidelity/recon_flags.h"
#include "kvc/fidelity/via_kvcd.h"
#include "kvc/model/transformer.h"
#include "kvc/spec.h"
#include "kvc/status_macros.h"

constexpr char kDefaultSpecs[] =
    "full;streaming:0.5;h2o:0.5;snapkv:0.5;keyformer:0.5;knorm:0.5;"
    "streaming:0.25;h2o:0.25;snapkv:0.25;keyformer:0.25;knorm:0.25";

ABSL_FLAG(std::string, model, "",
          "llama2.c checkpoint file (byte-level for generated documents, e.g. passkey4L.bin) or "
          "Hugging Face Llama directory (config.json + safetensors) (required)");
ABSL_FLAG(std::string, documents_file, "",
          "evaluate these pre-tokenized documents instead of generating byte documents: JSON "
          "Lines, one {\"prompt\": [ids], \"question_start\": n, \"answer\": [ids], \"id\": "
          "\"...\"} per line (docs/fidelity-real-model.md); all of them are used");
ABSL_FLAG(int, documents, 200, "documents generated (the same ones for every spec)");
ABSL_FLAG(uint64_t, seed, 1, "seed of the document generator");
ABSL_FLAG(std::string, filler, "/usr/share/common-licenses",
          "text file, or directory of text files, whose prose lines (20-90 bytes, mostly letters) "
          "fill the documents");
ABSL_FLAG(int, max_bytes, 384, "document size limit in bytes, question included");
ABSL_FLAG(int, window, 32,
          "W: observation queries, the last W compressed positions (inside: they cover the "
          "question)");
ABSL_FLAG(std::string, spec, kDefaultSpecs,
          "compression specs separated by ';' or whitespace (grammar: kvc/spec.h ParseSpecString, "
          "e.g. 'snapkv:0.25,kernel=7;keyformer:0.5+q4')");
ABSL_FLAG(std::string, scenarios, "inside,after", "scenarios to run: inside, after or both");
ABSL_FLAG(std::string, csv, "", "write the results as CSV to this file");
ABSL_FLAG(std::string, documents_out, "",
          "write the documents to this file (prompt bytes with \\n escaped, a tab, the answer), "
          "one a line");
ABSL_FLAG(std::string, via, "",
          "kvcd address: compress through PutCache/GetCache(PACKED) instead of in-process, and "
          "check that every answer equals the in-process one");
namespace kvc::fidelity {
namespace {

struct Row {
  std::string label;
  CompressionSpec spec;
};

absl::StatusOr<std::vector<Row>> ParseSpecs(const std::string& text) {
  std::vector<Row> rows;
  for (absl::string_view term :
       absl::StrSplit(text, absl::ByAnyChar("; \t\n"), absl::SkipEmpty())) {
    absl::StatusOr<CompressionSpec> spec =
        ParseSpecString(std::string_view(term.data(), term.size()));
    if (!spec.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--spec: '", term, "': ", spec.status().message()));
    }
    rows.push_back({SpecString(*spec), *spec});
  }
  if (rows.empty()) return absl::InvalidArgumentError("--spec: no spec given");
  return rows;
}

absl::StatusOr<std::vector<PasskeyScenario>> ParseScenarios(const std::string& text) {
  std::vector<PasskeyScenario> out;
  for (absl::string_view s : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    s = absl::StripAsciiWhitespace(s);
    if (s == "both") {
      out = {PasskeyScenario::kInside, PasskeyScenario::kAfter};
    } else if (s == "inside" && out.empty()) {
      out.push_back(PasskeyScenario::kInside);
    } else if (s == "after" && (out.empty() || out.back() == PasskeyScenario::kInside)) {
      out.push_back(PasskeyScenario::kAfter);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("--scenarios: '", text, "' must be inside, after, inside,after or both"));
    }
  }
  if (out.empty()) return absl::InvalidArgumentError("--scenarios: empty");
  return out;
}

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\\') {
      out += "\\\\";
    } else {
      out += c;
    }
  }
  return out;
}

std::string CsvField(const std::string& s) {
  if (s.find_first_of(",\"") == std::string::npos) return s;
  std::string out = "\"";
  for (char c : s) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

absl::Status Run() {
  const std::string model_path = absl::GetFlag(FLAGS_model);
  if (model_path.empty()) return absl::InvalidArgumentError("--model: required");
  const std::string documents_file = absl::GetFlag(FLAGS_documents_file);
  if (!documents_file.empty()) {
    // The generator's flags mean nothing for a file: refuse them rather than ignore them.
    for (const absl::CommandLineFlag* flag :
         {&absl::GetFlagReflectionHandle(FLAGS_documents),
          &absl::GetFlagReflectionHandle(FLAGS_seed), &absl::GetFlagReflectionHandle(FLAGS_filler),
          &absl::GetFlagReflectionHandle(FLAGS_max_bytes),
          &absl::GetFlagReflectionHandle(FLAGS_documents_out)}) {
      if (flag->CurrentValue() != flag->DefaultValue()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--", flag->Name(), ": generates documents; not used with --documents_file"));
      }
    }
  }
  const int n_docs = absl::GetFlag(FLAGS_documents);
  if (n_docs < 1) return absl::InvalidArgumentError(absl::StrCat("--documents: ", n_docs, " < 1"));
  ASSIGN_OR_RETURN(const BackendOptions backend_options, BackendOptionsFromFlags());
  PasskeyDocOptions doc_options;
  doc_options.max_bytes = absl::GetFlag(FLAGS_max_bytes);
  if (absl::Status s = ValidatePasskeyDocOptions(doc_options); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--max_bytes: ", s.message()));
  }
  ASSIGN_OR_RETURN(const std::vector<Row> rows, ParseSpecs(absl::GetFlag(FLAGS_spec)));
  ASSIGN_OR_RETURN(const std::vector<PasskeyScenario> scenarios,
                   ParseScenarios(absl::GetFlag(FLAGS_scenarios)));
  ASSIGN_OR_RETURN(ReconPrompts kvzip, ReconPromptsFromFlags());
  // Output files are opened before the run, so a bad path fails in a second, not after it.
  std::ofstream csv;
  if (const std::string path = absl::GetFlag(FLAGS_csv); !path.empty()) {
    csv.open(path, std::ios::trunc);
    if (!csv) return absl::InvalidArgumentError(absl::StrCat("--csv: cannot write '", path, "'"));
  }
  std::ofstream docs_out;
  if (const std::string path = absl::GetFlag(FLAGS_documents_out); !path.empty()) {
    docs_out.open(path, std::ios::trunc);
    if (!docs_out) {
      return absl::InvalidArgumentError(absl::StrCat("--documents_out: cannot write '", path, "'"));
    }
  }

  // Documents first: a malformed file fails in a second, before the model loads.
  std::vector<TokenDocument> token_docs;
  if (!documents_file.empty()) {
    absl::StatusOr<std::vector<TokenDocument>> read = ReadTokenDocuments(documents_file);
    if (!read.ok()) {
      return absl::Status(read.status().code(),
                          absl::StrCat("--documents_file: ", read.status().message()));
    }
    token_docs = *std::move(read);
  }
  ASSIGN_OR_RETURN(model::Transformer model, model::Transformer::Load(model_path));
  const model::LlamaConfig& c = model.config();
  std::vector<PasskeyDocument> docs;
  std::string source;
  if (documents_file.empty()) {
    ASSIGN_OR_RETURN(std::vector<std::string> filler, LoadFillerLines(absl::GetFlag(FLAGS_filler)));
    const uint64_t seed = absl::GetFlag(FLAGS_seed);
    ASSIGN_OR_RETURN(docs, GeneratePasskeyDocuments(filler, seed, n_docs, doc_options));
    if (docs_out.is_open()) {
      for (const PasskeyDocument& d : docs)
        docs_out << Escape(d.prompt) << "\t" << d.answer() << "\n";
      if (!docs_out.flush()) return absl::InternalError("--documents_out: write failed");
    }
    int needles = 0;
    for (const PasskeyDocument& d : docs) needles += static_cast<int>(d.needles.size());
    source = absl::StrFormat("generated, seed %llu, %zu filler lines, %.2f needles each",
                             static_cast<unsigned long long>(seed), filler.size(),
                             static_cast<double>(needles) / n_docs);
  } else {
    source = absl::StrCat("from ", documents_file);
  }

  // kvzip rows are refused now, before the documents' forward passes: the longest compressed
  // part (a prompt but its last token inside, a context after) must fit the model twice.
  int longest_part = 0;
  for (PasskeyScenario s : scenarios) {
    const bool inside = s == PasskeyScenario::kInside;
    for (const PasskeyDocument& d : docs) {
      longest_part = std::max(longest_part, inside ? static_cast<int>(d.prompt.size()) - 1
                                                   : d.question_offset);
    }
    for (const TokenDocument& d : token_docs) {
      longest_part = std::max(longest_part, inside ? static_cast<int>(d.prompt.size()) - 1
                                                   : d.question_start);
    }
  }
  for (const Row& row : rows) {
    if (!NeedsReconstruction(row.spec)) continue;
    absl::Status st = CheckReconstructionSpec(row.spec);
    st.Update(CheckReconstructionFits(c, longest_part, kvzip));
    if (!st.ok()) return absl::Status(st.code(), absl::StrCat(row.label, ": ", st.message()));
  }

  ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreateCpuBackend(backend_options));
  int len_min = c.seq_len, len_max = 0, count = 0;
  for (const PasskeyDocument& d : docs) {
    len_min = std::min(len_min, static_cast<int>(d.prompt.size()));
    len_max = std::max(len_max, static_cast<int>(d.prompt.size()));
    ++count;
  }
  for (const TokenDocument& d : token_docs) {
    len_min = std::min(len_min, static_cast<int>(d.prompt.size()));
    len_max = std::max(len_max, static_cast<int>(d.prompt.size()));
    ++count;
  }
  const int window = absl::GetFlag(FLAGS_window);
  std::printf("model %s: dim %d, layers %d, heads %d/%d (head_dim %d), vocab %d, context %d\n",
              model_path.c_str(), c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim(),
              c.vocab_size, c.seq_len);
  std::printf("%d documents (%s): %d-%d %s; W=%d; %s\n", count, source.c_str(), len_min, len_max,
              docs.empty() ? "tokens" : "bytes", window, backend->description().c_str());
  std::fflush(stdout);  // the documents' forward passes take a while

  const auto start = std::chrono::steady_clock::now();
  absl::StatusOr<std::unique_ptr<PasskeyEval>> created =
      docs.empty()
          ? PasskeyEval::CreateFromTokens(&model, std::move(token_docs), window, backend.get())
          : PasskeyEval::Create(&model, std::move(docs), window, backend.get());
  if (!created.ok()) {
    const absl::Status& s = created.status();
    // Name the flag for the option the user controls.
    if (absl::StartsWith(s.message(), "window")) {
      return absl::InvalidArgumentError(absl::StrCat("--", s.message()));
    }
    const std::string flag = documents_file.empty() ? "--max_bytes" : "--documents_file";
    if (absl::StrContains(s.message(), "seq_len") || absl::StartsWith(s.message(), "documents")) {
      return absl::Status(s.code(), absl::StrCat(flag, ": ", s.message()));
    }
    return s;
  }
  std::unique_ptr<PasskeyEval> eval = *std::move(created);
  RETURN_IF_ERROR(eval->SetKVzipPrompts(std::move(kvzip)));
  const PasskeyResult& full = eval->full_cache();
  std::printf("full cache: %d/%d exact, accuracy %s (Wilson 95%%)\n\n", full.correct,
              full.documents, FormatAccuracy(full).c_str());

  const std::string via = absl::GetFlag(FLAGS_via);
  std::unique_ptr<Client> client;
  Compressor remote;
  if (!via.empty()) {
    ClientOptions client_options;
    client_options.target = via;
    ASSIGN_OR_RETURN(client, Client::Create(client_options));
    remote = KvcdCompressor(client.get(), absl::StrCat("kvcpasskey-", ::getpid()));
  }
  const Compressor local = InProcessCompressor(backend.get());
  if (csv.is_open()) {
    csv << "spec,scenario,window,documents,correct,accuracy,ci95_lo,ci95_hi,size_ratio,"
           "full_accuracy\n";
    csv.flush();
  }
  std::string header = absl::StrFormat("%-28s %6s", "spec", "size");
  for (PasskeyScenario s : scenarios) {
    absl::StrAppend(&header, absl::StrFormat("  %-26s %3s", ScenarioName(s), "W"));
  }
  std::printf("%s\n", header.c_str());
  int mismatches = 0;
  for (const Row& row : rows) {
    std::string line = absl::StrFormat("%-28s", row.label);
    double size_ratio = 0;
    std::vector<PasskeyResult> results;
    for (PasskeyScenario s : scenarios) {
      absl::StatusOr<PasskeyResult> r = eval->Evaluate(row.spec, s, local);
      if (!r.ok()) {
        return absl::Status(r.status().code(), absl::StrCat(row.label, " (", ScenarioName(s),
                                                            "): ", r.status().message()));
      }
      if (remote) {
        absl::StatusOr<PasskeyResult> v = eval->Evaluate(row.spec, s, remote);
        if (!v.ok()) {
          return absl::Status(
              v.status().code(),
              absl::StrCat(row.label, " (", ScenarioName(s), ") via kvcd: ", v.status().message()));
        }
        if (v->answers != r->answers || v->size_ratio != r->size_ratio) {
          ++mismatches;
          std::printf("MISMATCH %s (%s): in-process %d correct, via kvcd %d\n", row.label.c_str(),
                      ScenarioName(s), r->correct, v->correct);
        }
        r = std::move(v);  // report what decoding on the served blobs gave
      }
      size_ratio = std::max(size_ratio, r->size_ratio);
      results.push_back(*std::move(r));
    }
    absl::StrAppend(&line, absl::StrFormat(" %6.3f", size_ratio));
    for (size_t k = 0; k < scenarios.size(); ++k) {
      const PasskeyResult& r = results[k];
      absl::StrAppend(&line, absl::StrFormat("  %-26s %3d", FormatAccuracy(r), r.obs_window));
      if (csv.is_open()) {
        csv << absl::StrFormat("%s,%s,%d,%d,%d,%.4f,%.4f,%.4f,%.4f,%.4f\n", CsvField(row.label),
                               ScenarioName(scenarios[k]), r.obs_window, r.documents, r.correct,
                               r.accuracy, r.interval.lo, r.interval.hi, r.size_ratio,
                               full.accuracy);
      }
    }
    std::printf("%s\n", line.c_str());
    std::fflush(stdout);
    if (csv.is_open() && !csv.flush()) return absl::InternalError("--csv: write failed");
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf(
      "\naccuracy: fraction of documents whose greedy answer is exactly %s "
      "[Wilson 95%% interval]; size: compact bytes / full fp32 K+V bytes; W: observation queries "
      "the compressor got (0 = none, query-agnostic)\n",
      documents_file.empty() ? "the pass key (5 bytes)" : "the document's answer tokens");
  if (!via.empty()) {
    std::printf("via kvcd %s: %zu specs, %d scenario runs differ from in-process\n", via.c_str(),
                rows.size(), mismatches);
  }
  std::printf("%.1f s\n", seconds);
  if (mismatches > 0) {
    return absl::InternalError(absl::StrCat(mismatches, " runs differ via kvcd"));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace kvc::fidelity

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Pass-key retrieval accuracy of compressed KV caches, on generated byte documents (a "
      "byte-level llama2.c model) or on pre-tokenized documents (any llama2.c or Hugging Face "
      "Llama model). Examples:\n  kvcpasskey --model passkey4L.bin --csv passkey.csv\n"
      "  kvcpasskey --model SmolLM2-135M-Instruct/ --documents_file docs.jsonl");
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() > 1) {
    std::fprintf(stderr, "kvcpasskey: unexpected argument '%s' (flags only; see --help)\n",
                 args[1]);
    return 1;
  }
  const absl::Status status = kvc::fidelity::Run();
  if (!status.ok()) {
    std::fprintf(stderr, "kvcpasskey: %s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}

// The kvcfidelity command line on the real model with tiny runs: errors that must come before any
// work (--only without a match, unwritable output paths, bad spec strings), --window=0 skipping
// only the rows that need queries, spec lists with combined specs, seeds, and sequences dumped
// and read back giving the same numbers.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "fidelity/model_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc::fidelity {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

// Runs kvcfidelity on the model with a tiny configuration plus `args`.
RunResult RunTool(const std::string& model, const std::string& args) {
  const std::string cmd =
      absl::StrCat(KVCFIDELITY_PATH, " --model '", model,
                   "' --sequences 1 --prefix 32 --continuation 4 --window 8 ", args, " 2>&1");
  RunResult r;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

std::string Temp(const std::string& name) {
  return ::testing::TempDir() + "kvc_tool_" + std::to_string(::getpid()) + "_" + name;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The table header line of a run: printed only once the evaluation starts.
constexpr char kTableHeader[] = "top1 ±sd [95% CI]";

TEST(ToolTest, OnlyWithoutAMatchIsAnError) {
  KVC_REQUIRE_MODEL(model);
  const RunResult r = RunTool(model, "--only nosuchpolicy");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--only 'nosuchpolicy' matches no row"));
  EXPECT_THAT(r.output, Not(HasSubstr(kTableHeader)));
}

// kvzip rows run the compressed prefix twice (recon.h): a prefix that does not fit the model
// twice is refused before the run, naming the row, unless --kvzip_chunk splits its copy; one that
// fits runs with W = its rows.
TEST(ToolTest, KVzipRowsReconstructTheirPrefix) {
  KVC_REQUIRE_MODEL(model);
  const RunResult too_long = RunTool(model, "--prefix 300 --spec 'full;kvzip:0.5'");
  EXPECT_EQ(too_long.exit_code, 1) << too_long.output;
  EXPECT_THAT(too_long.output,
              HasSubstr("kvzip:0.5: kvzip: a reconstruction pass runs 300 context + 300 pass"));
  EXPECT_THAT(too_long.output, Not(HasSubstr(kTableHeader)));
  // In chunks of 64 tokens it fits (300 + 8 overlap + 64 <= 512 positions) and runs.
  const RunResult chunked =
      RunTool(model, "--prefix 300 --window 16 --spec 'kvzip:0.5,stats=1' --kvzip_chunk 64");
  EXPECT_EQ(chunked.exit_code, 0) << chunked.output;
  EXPECT_THAT(chunked.output, HasSubstr("kvzip:0.5,stats=1"));
  const RunResult negative = RunTool(model, "--spec kvzip:0.5 --kvzip_chunk -3");
  EXPECT_EQ(negative.exit_code, 1) << negative.output;
  EXPECT_THAT(negative.output, HasSubstr("--kvzip_chunk: -3 must be >= 0"));
  const RunResult bad = RunTool(model, "--spec kvzip:0.5 --kvzip_prompt '3 -4'");
  EXPECT_EQ(bad.exit_code, 1) << bad.output;
  EXPECT_THAT(bad.output, HasSubstr("--kvzip_prompt: '-4'"));
  const RunResult passes = RunTool(model, "--spec 'kvzip:0.5,passes=20/20,chunk=16'");
  EXPECT_EQ(passes.exit_code, 1) << passes.output;
  EXPECT_THAT(passes.output, HasSubstr("passes"));
  // --window 0: no question, yet kvzip needs none of its queries and runs.
  const RunResult r =
      RunTool(model, "--window 0 --spec 'kvzip:0.5,stats=1;snapkv:0.5' --kvzip_prompt '3,4'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("snapkv:0.5                     skipped"));
  // The kvzip row ran with W = 32 + 2 reconstruction rows.
  bool found = false;
  for (absl::string_view line : absl::StrSplit(r.output, '\n')) {
    if (absl::StartsWith(line, "kvzip:0.5,stats=1")) {
      found = true;
      EXPECT_THAT(std::string(line), HasSubstr(" inside  34 ")) << line;
    }
  }
  EXPECT_TRUE(found) << r.output;
}

TEST(ToolTest, UnwritableOutputPathsFailBeforeTheRun) {
  KVC_REQUIRE_MODEL(model);
  for (const char* flag : {"--csv", "--png", "--svg", "--dump_sequences"}) {
    const RunResult r =
        RunTool(model, absl::StrCat("--only snapkv:0.5 ", flag, " /nonexistent-dir/out"));
    EXPECT_EQ(r.exit_code, 1) << flag << ": " << r.output;
    EXPECT_THAT(r.output, HasSubstr(absl::StrCat(flag, ": cannot write '/nonexistent-dir/out'")));
    EXPECT_THAT(r.output, Not(HasSubstr(kTableHeader))) << flag;
  }
}

TEST(ToolTest, BadSpecStringsNameTheItem) {
  KVC_REQUIRE_MODEL(model);
  const RunResult r = RunTool(model, "--spec 'snapkv:0.5;h2o:2'");
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--spec 'h2o:2'"));
  EXPECT_THAT(r.output, Not(HasSubstr(kTableHeader)));
}

TEST(ToolTest, WindowZeroSkipsOnlyTheRowsThatNeedQueries) {
  KVC_REQUIRE_MODEL(model);
  const RunResult r =
      RunTool(model, "--window 0 --spec 'snapkv:0.5;knorm:0.5;streaming:0.5+think:0.25;q4'");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("snapkv:0.5                     skipped: needs observation"));
  EXPECT_THAT(r.output, HasSubstr("streaming:0.5+think:0.25       skipped: needs observation"));
  EXPECT_THAT(r.output, HasSubstr("knorm:0.5                      inside"));
  EXPECT_THAT(r.output, HasSubstr("q4g8                           inside"));
  EXPECT_THAT(r.output, HasSubstr("2 rows skipped"));
  EXPECT_THAT(r.output, HasSubstr("the scenarios coincide"));
}

std::vector<std::map<std::string, std::string>> ParseCsv(const std::string& text) {
  std::vector<std::string> lines = absl::StrSplit(text, '\n', absl::SkipEmpty());
  std::vector<std::map<std::string, std::string>> rows;
  if (lines.empty()) return rows;
  const std::vector<std::string> header = absl::StrSplit(lines[0], ',');
  for (size_t i = 1; i < lines.size(); ++i) {
    const std::vector<std::string> fields = absl::StrSplit(lines[i], ',');
    std::map<std::string, std::string> row;
    for (size_t j = 0; j < header.size() && j < fields.size(); ++j) row[header[j]] = fields[j];
    rows.push_back(row);
  }
  return rows;
}

// --attention_math picks the decode arithmetic over quantized blocks: on this model's 8-channel
// heads `auto` stays fp32 (the same rows as `exact`), `integer` forces integer dot products
// (other, nearby numbers); an unknown name is refused before the run. r=0 quantizes every token
// (the default keeps the recent ones, here the whole 32-token prefix, in fp16).
TEST(ToolTest, AttentionMathChoosesTheQuantizedArithmetic) {
  KVC_REQUIRE_MODEL(model);
  std::map<std::string, std::vector<std::map<std::string, std::string>>> rows;
  for (const char* math : {"auto", "exact", "integer"}) {
    const std::string csv = Temp(absl::StrCat("math_", math, ".csv"));
    const RunResult r =
        RunTool(model, absl::StrCat("--spec 'q4+r=0;q2+r=0' --attention_math ", math,
                                    " --csv ", csv));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    rows[math] = ParseCsv(ReadAll(csv));
    std::remove(csv.c_str());
    ASSERT_EQ(rows[math].size(), 4u) << math;  // 2 specs x 2 scenarios
  }
  int differ = 0;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(rows["auto"][i].at("mean_kl"), rows["exact"][i].at("mean_kl")) << i;
    EXPECT_EQ(rows["auto"][i].at("bytes"), rows["integer"][i].at("bytes")) << i;
    const double exact = std::stod(rows["exact"][i].at("mean_kl"));
    const double integer = std::stod(rows["integer"][i].at("mean_kl"));
    differ += exact != integer;
    EXPECT_NEAR(integer, exact, 0.1 * exact + 1e-3) << i;
  }
  EXPECT_GT(differ, 0);
  const RunResult bad = RunTool(model, "--spec q4 --attention_math fast");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("--attention_math: unknown 'fast'"));
  EXPECT_THAT(bad.output, Not(HasSubstr(kTableHeader)));
}

// --scoring_math: this model's 8-channel heads are below the int8 path's 16, so `integer`
// scores exactly (the same rows as `exact`); an unknown name is refused before the run. (The
// int8 path's effect on a real model: docs/performance.md, kvcfidelity on SmolLM2.)
TEST(ToolTest, ScoringMathIsAFlag) {
  KVC_REQUIRE_MODEL(model);
  std::map<std::string, std::vector<std::map<std::string, std::string>>> rows;
  for (const char* math : {"exact", "integer"}) {
    const std::string csv = Temp(absl::StrCat("scoring_", math, ".csv"));
    const RunResult r =
        RunTool(model, absl::StrCat("--spec snapkv:0.5 --scoring_math ", math, " --csv ", csv));
    ASSERT_EQ(r.exit_code, 0) << r.output;
    rows[math] = ParseCsv(ReadAll(csv));
    std::remove(csv.c_str());
    ASSERT_EQ(rows[math].size(), 2u) << math;  // 1 spec x 2 scenarios
  }
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(rows["exact"][i].at("mean_kl"), rows["integer"][i].at("mean_kl")) << i;
  }
  const RunResult bad = RunTool(model, "--spec snapkv:0.5 --scoring_math fast");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_THAT(bad.output, HasSubstr("--scoring_math: unknown 'fast' (expected exact or integer)"));
  EXPECT_THAT(bad.output, Not(HasSubstr(kTableHeader)));
}

TEST(ToolTest, CombinedSpecsSeedsAndDumpedSequencesReproduce) {
  KVC_REQUIRE_MODEL(model);
  const std::string csv_a = Temp("a.csv"), csv_b = Temp("b.csv"), seqs = Temp("seqs.txt"),
                    svg = Temp("plot.svg");
  const std::string specs = "--spec 'keyformer:0.5+think:0.5+q4;random:0.5' --seeds 2 ";
  const RunResult a = RunTool(
      model, absl::StrCat(specs, "--csv ", csv_a, " --dump_sequences ", seqs, " --svg ", svg));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const auto rows = ParseCsv(ReadAll(csv_a));
  ASSERT_EQ(rows.size(), 4u);  // 2 specs x 2 scenarios
  EXPECT_EQ(rows[0].at("config"), "keyformer:0.5+think:0.5+q4g8");
  EXPECT_EQ(rows[0].at("family"), "combined");
  EXPECT_EQ(rows[0].at("scenario"), "inside");
  EXPECT_EQ(rows[1].at("scenario"), "after");
  EXPECT_EQ(rows[3].at("config"), "random:0.5");
  EXPECT_EQ(rows[3].at("obs_window"), "0");  // query-agnostic after compression: no queries
  for (const auto& row : rows) {
    EXPECT_EQ(row.at("seeds"), "2");
    EXPECT_EQ(row.at("sequences"), "2");
    EXPECT_EQ(row.at("steps"), "8");
    EXPECT_GT(std::stod(row.at("bytes")), 0);
    EXPECT_LE(std::stod(row.at("top1_ci_lo")), std::stod(row.at("top1_agreement")));
    EXPECT_GE(std::stod(row.at("top1_ci_hi")), std::stod(row.at("top1_agreement")));
  }
  const std::vector<std::string> lines = absl::StrSplit(ReadAll(seqs), '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 2u);  // one sequence per seed
  EXPECT_NE(lines[0], lines[1]);
  EXPECT_EQ(std::vector<std::string>(absl::StrSplit(lines[0], ' ')).size(), 36u);
  EXPECT_TRUE(absl::StartsWith(ReadAll(svg), "<svg"));

  // The dumped sequences read back (with another sampling seed, which they override) give the
  // same rows.
  const RunResult b =
      RunTool(model, absl::StrCat(specs, "--seed 77 --sequences_file ", seqs, " --csv ", csv_b));
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(ReadAll(csv_b), ReadAll(csv_a));
  const RunResult short_file =
      RunTool(model, absl::StrCat(specs, "--seeds 3 --sequences_file ", seqs));
  EXPECT_EQ(short_file.exit_code, 1);
  EXPECT_THAT(short_file.output, HasSubstr("has 2 sequences, --seeds x --sequences needs 3"));
  for (const std::string& p : {csv_a, csv_b, seqs, svg}) std::remove(p.c_str());
}

}  // namespace
}  // namespace kvc::fidelity

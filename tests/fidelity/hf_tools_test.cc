// The fidelity tools on a Hugging Face directory (a small random Llama written by the test):
// kvcfidelity with --sequences_file and with sampling from the config's BOS, the pass-key
// evaluation on pre-tokenized documents (PasskeyEval::CreateFromTokens and kvcpasskey
// --documents_file), and the errors for what the tools cannot use.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "fidelity/hf_model_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/fidelity/passkey.h"
#include "kvc/model/transformer.h"

namespace kvc::fidelity {
namespace {

using ::kvc::testing::ConfigJson;
using ::kvc::testing::FreshDir;
using ::kvc::testing::HfShape;
using ::kvc::testing::RandomLlamaTensors;
using ::kvc::testing::RemoveDir;
using ::kvc::testing::WriteHfDir;
using ::kvc::testing::WriteText;
using ::testing::HasSubstr;
using Json = nlohmann::json;

struct RunResult {
  int exit_code = -1;
  std::string output;
};

RunResult RunCommand(const std::string& cmd) {
  RunResult r;
  FILE* pipe = ::popen((cmd + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return r;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) r.output.append(buf, n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class HfToolsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new std::string(FreshDir("tools"));
    HfShape shape;
    shape.vocab = 96;
    shape.max_positions = 256;
    Json config = ConfigJson(shape);
    config["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 100000.0}};
    config.erase("rope_theta");
    ASSERT_TRUE(
        WriteHfDir(*dir_, config, RandomLlamaTensors(shape, 9, false), StDType::kBF16).ok());
  }
  static void TearDownTestSuite() {
    RemoveDir(*dir_);
    delete dir_;
  }
  static std::string Path(const std::string& name) { return *dir_ + "/" + name; }

  // Documents: prompts of 40..60 tokens starting with BOS, the question the last 6 tokens.
  static std::vector<TokenDocument> Documents(int count) {
    std::vector<TokenDocument> docs;
    for (int d = 0; d < count; ++d) {
      TokenDocument doc;
      doc.id = absl::StrCat("doc", d);
      const int n = 40 + (d * 7) % 21;
      doc.prompt.push_back(1);
      for (int t = 1; t < n; ++t) doc.prompt.push_back((t * 13 + d * 31) % 96);
      doc.question_start = n - 6;
      doc.answer = {5, 6, 7};
      docs.push_back(std::move(doc));
    }
    return docs;
  }

  static std::string DocumentsJsonl(const std::vector<TokenDocument>& docs) {
    std::string out;
    for (const TokenDocument& d : docs) {
      out += absl::StrCat("{\"id\": \"", d.id, "\", \"prompt\": [", absl::StrJoin(d.prompt, ", "),
                          "], \"question_start\": ", d.question_start, ", \"answer\": [",
                          absl::StrJoin(d.answer, ", "), "]}\n");
    }
    return out;
  }

  static std::string* dir_;
};
std::string* HfToolsTest::dir_ = nullptr;

TEST_F(HfToolsTest, FidelityRunsOnSequencesFromAFile) {
  std::string seqs;
  for (int i = 0; i < 2; ++i) {
    std::vector<int> s = {1};
    for (int t = 1; t < 40; ++t) s.push_back((t * 17 + i * 5) % 96);
    seqs += absl::StrJoin(s, " ") + "\n";
  }
  ASSERT_TRUE(WriteText(Path("seqs.txt"), seqs).ok());
  const std::string csv = Path("fid.csv");
  const RunResult r = RunCommand(
      absl::StrCat(KVCFIDELITY_PATH, " --model ", *dir_, " --sequences_file ", Path("seqs.txt"),
                   " --sequences 2 --prefix 32 --continuation 4 --window 8 --csv ", csv,
                   " --spec 'full;snapkv:0.5;expected:0.5;streaming:0.5'"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("layers 2, heads 4/2 (head_dim 8), vocab 96, context 256"));
  std::ifstream in(csv);
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    if (line.rfind("full,", 0) == 0) {
      // Keeping everything decodes exactly like the full cache: agreement 1.
      const std::vector<std::string> f = absl::StrSplit(line, ',');
      ASSERT_GT(f.size(), 14u);
      EXPECT_EQ(f[14], "1.000000") << line;  // top1_agreement
    }
    ++rows;
  }
  EXPECT_EQ(rows, 1 + 4 * 2);  // header + 4 specs x 2 scenarios
}

TEST_F(HfToolsTest, FidelitySamplesFromTheConfigsBosOrRefuses) {
  const std::string cmd = absl::StrCat(KVCFIDELITY_PATH, " --model ", *dir_,
                                       " --sequences 1 --prefix 16 --continuation 2 --window 4 "
                                       "--scenarios inside --spec snapkv:0.5");
  RunResult r = RunCommand(cmd);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // The same model without bos_token_id: nothing to sample from.
  const std::string other = FreshDir("nobos");
  HfShape shape;
  shape.vocab = 96;
  Json config = ConfigJson(shape);
  config.erase("bos_token_id");
  ASSERT_TRUE(WriteHfDir(other, config, RandomLlamaTensors(shape, 9, false), StDType::kF32).ok());
  r = RunCommand(absl::StrCat(KVCFIDELITY_PATH, " --model ", other,
                              " --sequences 1 --prefix 16 --continuation 2 --window 4"));
  RemoveDir(other);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("declares no BOS token to sample from"));
}

// Token documents end to end: answers set to what the full cache generates score 1 on the full
// cache and on a compact cache that keeps everything, in both scenarios.
TEST_F(HfToolsTest, TokenDocumentsScoreLikeTheFullCache) {
  absl::StatusOr<model::Transformer> model = model::Transformer::Load(*dir_);
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<Backend>> backend = CreateCpuBackend({});
  ASSERT_TRUE(backend.ok());
  std::vector<TokenDocument> docs = Documents(4);
  auto first = PasskeyEval::CreateFromTokens(&*model, docs, 8, backend->get());
  ASSERT_TRUE(first.ok()) << first.status();
  for (size_t i = 0; i < docs.size(); ++i) {
    docs[i].answer.clear();
    for (absl::string_view id : absl::StrSplit((*first)->full_cache().answers[i], ' ')) {
      docs[i].answer.push_back(std::stoi(std::string(id)));
    }
    ASSERT_EQ(docs[i].answer.size(), 3u);
  }
  auto eval = PasskeyEval::CreateFromTokens(&*model, docs, 8, backend->get());
  ASSERT_TRUE(eval.ok()) << eval.status();
  EXPECT_EQ((*eval)->full_cache().correct, 4);
  const Compressor local = InProcessCompressor(backend->get());
  for (PasskeyScenario s : {PasskeyScenario::kInside, PasskeyScenario::kAfter}) {
    absl::StatusOr<PasskeyResult> r = (*eval)->Evaluate(CompressionSpec{}, s, local);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->correct, 4) << ScenarioName(s);
    auto prefix = (*eval)->Prefix(0, s, 0);
    ASSERT_TRUE(prefix.ok());
    EXPECT_EQ(prefix->prefix_len, s == PasskeyScenario::kInside
                                      ? static_cast<int>(docs[0].prompt.size()) - 1
                                      : docs[0].question_start);
    EXPECT_EQ(prefix->rope.theta, 100000.0);
    EXPECT_TRUE(prefix->rope.half_split);
  }

  // Through the tool: the same documents from a file.
  ASSERT_TRUE(WriteText(Path("docs.jsonl"), DocumentsJsonl(docs)).ok());
  const std::string csv = Path("passkey.csv");
  const RunResult r = RunCommand(absl::StrCat(KVCPASSKEY_PATH, " --model ", *dir_,
                                              " --documents_file ", Path("docs.jsonl"),
                                              " --window 8 --spec 'full;snapkv:0.5' --csv ", csv));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("4 documents (from "));
  EXPECT_THAT(r.output, HasSubstr("full cache: 4/4 exact"));
  std::ifstream in(csv);
  std::string line;
  int full_rows = 0;
  while (std::getline(in, line)) {
    if (line.rfind("full,", 0) == 0) {
      EXPECT_THAT(line, HasSubstr(",4,4,1.0000,")) << line;  // documents, correct, accuracy
      ++full_rows;
    }
  }
  EXPECT_EQ(full_rows, 2);
}

TEST_F(HfToolsTest, PasskeyToolRefusesBadDocumentsFiles) {
  struct Case {
    std::string text;
    std::string flags;
    const char* message;
  };
  std::vector<TokenDocument> docs = Documents(2);
  const std::string good = DocumentsJsonl(docs);
  docs[1].prompt[3] = 96;
  const std::string out_of_vocab = DocumentsJsonl(docs);
  const Case cases[] = {
      {good + "{\"prompt\": [1, 2]}\n", "", "docs.jsonl:3: \"answer\" is missing"},
      {"garbage\n", "", "docs.jsonl:1: not a JSON object"},
      {out_of_vocab, "",
       "document 1 (doc1): prompt[3] = 96 is outside the model's vocabulary [0, 96)"},
      {good, "--window 40", "--window: 40 is outside [1, 34] (the shortest haystack)"},
      {good, "--documents 5", "--documents: generates documents; not used with --documents_file"},
      {good, "--seed 3", "--seed: generates documents"},
  };
  for (const Case& c : cases) {
    ASSERT_TRUE(WriteText(Path("docs.jsonl"), c.text).ok());
    const RunResult r =
        RunCommand(absl::StrCat(KVCPASSKEY_PATH, " --model ", *dir_, " --documents_file ",
                                Path("docs.jsonl"), " --window 4 --spec full ", c.flags));
    EXPECT_EQ(r.exit_code, 1) << c.message << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message));
    EXPECT_THAT(r.output, ::testing::Not(HasSubstr("full cache:")));
  }
  // Generated byte documents need a byte-level model.
  const RunResult r =
      RunCommand(absl::StrCat(KVCPASSKEY_PATH, " --model ", *dir_, " --documents 2"));
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.output, HasSubstr("needs a byte-level model"));
}

}  // namespace
}  // namespace kvc::fidelity

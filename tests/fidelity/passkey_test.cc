// The pass-key task: the document generator (format, sizes, determinism), exact-match scoring,
// Wilson intervals, the evaluator on the real byte-level model (full-cache accuracy, both
// scenarios' plumbing, kvcd equal to in-process) and the kvcpasskey tool's flag errors.
#include "kvc/fidelity/passkey.h"

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "fidelity/model_util.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/fidelity/via_kvcd.h"
#include "kvc/model/transformer.h"
#include "testing/kvcd_process.h"

namespace kvc::fidelity {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

// A small prose sample of our own, so the generator tests need no files.
constexpr char kProse[] = R"(   A SMALL NOTICE ABOUT SHARING
Anyone may copy this text and pass it on to other people, as long as
the notice above stays with every copy and nobody claims to have written it.
You may change the text, but a changed copy must say clearly that it was changed
and by whom, so that readers are not misled about where the words came from.
No promise is made that the text is useful for any purpose at all.
12345 67890 000
If a court decides that some part of these terms cannot be enforced,
the remaining parts still apply to everyone who received a copy.
short line
The people who wrote this text do not answer for any damage that follows
from reading it, printing it, or giving it to somebody else.
When you give a copy to another person, you give them the same freedom
you received, and you may not add conditions that take that freedom away.
This paragraph is intentionally long so that it exceeds the limit of ninety bytes for one filler line.
A translation counts as a changed copy and follows the same rules.
Nothing here limits the rights that the law already gives you as a reader.
)";

std::vector<std::string> Prose() { return FillerLinesFromText(kProse); }

// Document 1 of the prose sample: the generator is part of the published numbers, so a change
// to it must show here.
constexpr size_t kPinnedSize = 316;
constexpr char kPinnedAnswer[] = "81288";

std::string TempPath(const std::string& name) {
  return ::testing::TempDir() + "kvc_passkey_" + name + "_" + std::to_string(::getpid());
}

// Removes a temporary file or directory tree when the test ends, passed or failed.
struct RemovedAtEnd {
  std::string path;
  ~RemovedAtEnd() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

TEST(PasskeyFillerTest, KeepsProseLinesOnly) {
  EXPECT_TRUE(IsFillerLine("the notice above stays with every copy and nobody claims"));
  EXPECT_FALSE(IsFillerLine("short line"));                                  // < 20 bytes
  EXPECT_FALSE(IsFillerLine(std::string(91, 'a')));                          // > 90 bytes
  EXPECT_FALSE(IsFillerLine("12345 67890 000 11111 2222 333"));              // not mostly letters
  EXPECT_FALSE(IsFillerLine("tab\tinside a line of otherwise fine prose"));  // not printable
  EXPECT_FALSE(IsFillerLine(" leading space before the words here"));
  const std::vector<std::string> lines = Prose();
  ASSERT_EQ(lines.size(), 14u);
  EXPECT_EQ(lines.front(), "A SMALL NOTICE ABOUT SHARING");  // trimmed
  for (const std::string& l : lines) EXPECT_TRUE(IsFillerLine(l)) << l;
}

TEST(PasskeyFillerTest, LoadsFileAndDirectoryAndFailsClearly) {
  const std::string dir = TempPath("dir");
  const RemovedAtEnd remove_dir{dir};
  ASSERT_EQ(::mkdir(dir.c_str(), 0755), 0);
  { std::ofstream(dir + "/b.txt") << kProse; }
  { std::ofstream(dir + "/a.txt") << "Only this one line of prose is long enough.\nno\n"; }
  auto file = LoadFillerLines(dir + "/b.txt");
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(*file, Prose());
  auto all = LoadFillerLines(dir);
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), Prose().size() + 1);
  EXPECT_EQ(all->front(), "Only this one line of prose is long enough.");  // files sorted by name

  auto missing = LoadFillerLines(dir + "/nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nope' does not exist"));
  const std::string empty_dir = TempPath("empty");
  const RemovedAtEnd remove_empty_dir{empty_dir};
  ASSERT_EQ(::mkdir(empty_dir.c_str(), 0755), 0);
  { std::ofstream(empty_dir + "/x") << "too short\n1234567890 1234567890 12345\n"; }
  auto none = LoadFillerLines(empty_dir);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(none.status().message(), HasSubstr("no usable line"));
  EXPECT_THAT(none.status().message(), HasSubstr("20-90"));
}

// Parses a generated document back and checks every rule of the format.
void CheckDocument(const PasskeyDocument& d, const std::set<std::string>& filler, int max_bytes) {
  SCOPED_TRACE(d.prompt);
  ASSERT_LE(static_cast<int>(d.prompt.size()), max_bytes);
  ASSERT_GE(d.needles.size(), 1u);
  ASSERT_LE(d.needles.size(), 4u);
  ASSERT_GE(d.asked, 0);
  ASSERT_LT(d.asked, static_cast<int>(d.needles.size()));
  EXPECT_EQ(d.prompt.substr(d.question_offset),
            absl::StrCat("Q: pass key of ", d.needles[d.asked].name, "?\nA: "));
  EXPECT_EQ(d.answer(), d.needles[d.asked].key);
  std::set<std::string> names, keys;
  for (const PasskeyNeedle& n : d.needles) {
    EXPECT_GE(n.name.size(), 4u);
    EXPECT_LE(n.name.size(), 7u);
    for (char c : n.name) EXPECT_TRUE(c >= 'a' && c <= 'z') << n.name;
    ASSERT_EQ(n.key.size(), 5u);
    for (char c : n.key) EXPECT_TRUE(absl::ascii_isdigit(c)) << n.key;
    names.insert(n.name);
    keys.insert(n.key);
    const std::string line = absl::StrCat("The pass key of ", n.name, " is ", n.key, ".\n");
    EXPECT_EQ(d.prompt.substr(n.offset, line.size()), line);
  }
  EXPECT_EQ(names.size(), d.needles.size()) << "names must be distinct";
  EXPECT_EQ(keys.size(), d.needles.size()) << "keys must be distinct";
  // The haystack is whole lines: needles (at their offsets, in order) and filler lines.
  const std::string haystack = d.prompt.substr(0, d.question_offset);
  ASSERT_FALSE(haystack.empty());
  ASSERT_EQ(haystack.back(), '\n');
  size_t pos = 0, next_needle = 0;
  for (absl::string_view line : absl::StrSplit(haystack.substr(0, haystack.size() - 1), '\n')) {
    if (next_needle < d.needles.size() && static_cast<int>(pos) == d.needles[next_needle].offset) {
      ++next_needle;
    } else {
      EXPECT_TRUE(filler.count(std::string(line))) << "not a filler line: " << line;
    }
    pos += line.size() + 1;
  }
  EXPECT_EQ(next_needle, d.needles.size());
}

TEST(PasskeyGeneratorTest, FollowsTheFormat) {
  const std::vector<std::string> prose = Prose();
  const std::set<std::string> filler(prose.begin(), prose.end());
  PasskeyDocOptions options;
  auto docs = GeneratePasskeyDocuments(prose, 7, 300, options);
  ASSERT_TRUE(docs.ok()) << docs.status();
  std::set<size_t> counts;
  std::set<int> asked_index;
  int min_bytes = 1 << 20, filler_lines = 0;
  for (const PasskeyDocument& d : *docs) {
    CheckDocument(d, filler, options.max_bytes);
    if (HasFatalFailure()) return;
    counts.insert(d.needles.size());
    asked_index.insert(d.asked);
    min_bytes = std::min(min_bytes, static_cast<int>(d.prompt.size()));
    filler_lines += static_cast<int>(std::count(d.prompt.begin(), d.prompt.end(), '\n'));
  }
  EXPECT_EQ(counts, (std::set<size_t>{1, 2, 3, 4}));  // every needle count occurs
  EXPECT_EQ(asked_index, (std::set<int>{0, 1, 2, 3}));
  // Filled up to within one filler line (<= 91 bytes) of the limit.
  EXPECT_GT(min_bytes, options.max_bytes - 91);
  // Needles sit at the start, middle and end of haystacks.
  int at_start = 0, right_before_question = 0;
  for (const PasskeyDocument& d : *docs) {
    at_start += d.needles.front().offset == 0;
    const std::string& last = d.needles.back().name;
    right_before_question +=
        d.needles.back().offset + 27 + static_cast<int>(last.size()) == d.question_offset;
  }
  EXPECT_GT(at_start, 0);
  EXPECT_GT(right_before_question, 0);

  PasskeyDocOptions small;
  small.max_bytes = 200;
  small.max_needles = 2;
  auto short_docs = GeneratePasskeyDocuments(prose, 7, 50, small);
  ASSERT_TRUE(short_docs.ok()) << short_docs.status();
  for (const PasskeyDocument& d : *short_docs) {
    CheckDocument(d, filler, 200);
    EXPECT_LE(d.needles.size(), 2u);
  }
}

TEST(PasskeyGeneratorTest, IsDeterministicFromTheSeed) {
  const std::vector<std::string> prose = Prose();
  auto a = GeneratePasskeyDocuments(prose, 42, 20, {});
  auto b = GeneratePasskeyDocuments(prose, 42, 30, {});
  auto c = GeneratePasskeyDocuments(prose, 43, 20, {});
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  std::set<std::string> distinct;
  int same_as_other_seed = 0;
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ((*a)[i].prompt, (*b)[i].prompt) << i;  // a longer run starts with the shorter one
    EXPECT_EQ((*a)[i].asked, (*b)[i].asked);
    same_as_other_seed += (*a)[i].prompt == (*c)[i].prompt;
    distinct.insert((*a)[i].prompt);
  }
  EXPECT_EQ(same_as_other_seed, 0);
  EXPECT_EQ(distinct.size(), 20u);
  // Pinned: the generator is part of the published numbers; changing it changes them.
  auto one = GeneratePasskeyDocument(prose, 1, {});
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->prompt.size(), kPinnedSize);
  EXPECT_EQ(one->answer(), kPinnedAnswer);
}

TEST(PasskeyGeneratorTest, RejectsBadOptions) {
  const std::vector<std::string> prose = Prose();
  PasskeyDocOptions o;
  o.max_bytes = 100;
  EXPECT_THAT(GeneratePasskeyDocument(prose, 1, o).status().message(), HasSubstr("max_bytes"));
  o = {};
  o.min_needles = 0;
  EXPECT_THAT(ValidatePasskeyDocOptions(o).message(), HasSubstr("needles"));
  o = {};
  o.min_needles = 3;
  o.max_needles = 2;
  EXPECT_THAT(ValidatePasskeyDocOptions(o).message(), HasSubstr("needles"));
  EXPECT_THAT(GeneratePasskeyDocument({}, 1, {}).status().message(), HasSubstr("filler"));
  EXPECT_THAT(GeneratePasskeyDocuments(prose, 1, 0, {}).status().message(), HasSubstr("documents"));
}

TEST(PasskeyScoringTest, ExactMatchOfTheFiveDigits) {
  EXPECT_TRUE(IsExactAnswer("52280", "52280"));
  EXPECT_TRUE(IsExactAnswer("52280.\n", "52280"));
  EXPECT_FALSE(IsExactAnswer("52281", "52280"));
  EXPECT_FALSE(IsExactAnswer("5228", "52280"));
  EXPECT_FALSE(IsExactAnswer(" 52280", "52280"));
  EXPECT_FALSE(IsExactAnswer("", "52280"));
  EXPECT_FALSE(IsExactAnswer("abcde", "abcde"));  // an answer is digits
  EXPECT_FALSE(IsExactAnswer("1234", "1234"));    // and five of them
}

TEST(PasskeyScoringTest, WilsonInterval) {
  // Reference values from the closed form (z = 1.959964).
  ProportionInterval i = WilsonInterval(82, 100);
  EXPECT_NEAR(i.lo, 0.733326, 1e-6);
  EXPECT_NEAR(i.hi, 0.882998, 1e-6);
  i = WilsonInterval(164, 200);
  EXPECT_NEAR(i.lo, 0.760885, 1e-6);
  EXPECT_NEAR(i.hi, 0.867054, 1e-6);
  i = WilsonInterval(0, 10);  // never below 0, and not the empty Wald interval
  EXPECT_EQ(i.lo, 0.0);
  EXPECT_NEAR(i.hi, 0.277533, 1e-6);
  i = WilsonInterval(10, 10);
  EXPECT_NEAR(i.lo, 0.722467, 1e-6);
  EXPECT_LE(i.hi, 1.0);
  i = WilsonInterval(0, 0);
  EXPECT_EQ(i.lo, 0.0);
  EXPECT_EQ(i.hi, 1.0);
}

// The real byte-level model ($KVC_MODEL: passkey4L.bin) on a few documents filled from the
// license texts it was trained on. Prepared once for the suite.
struct ModelState {
  std::string skip;  // why the suite skips, if it does
  std::unique_ptr<model::Transformer> model;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<PasskeyEval> eval;
  std::vector<std::string> filler;
};

constexpr char kLicenses[] = "/usr/share/common-licenses";
constexpr int kDocs = 12;
constexpr int kWindow = 16;

ModelState& State() {
  static ModelState* state = [] {
    auto* s = new ModelState;
    const std::string path = ::kvc::testing::ModelPath();
    if (path.empty()) {
      s->skip =
          "model not found: set KVC_MODEL to passkey4L.bin (ctest sets it to "
          "shared/models/passkey4L.bin beside the source tree)";
      return s;
    }
    auto model = model::Transformer::Load(path);
    if (!model.ok() || model->config().vocab_size != 256) {
      s->skip = absl::StrCat(path, " is not a byte-level model (vocab 256)");
      return s;
    }
    auto filler = LoadFillerLines(kLicenses);
    if (!filler.ok()) {
      s->skip =
          absl::StrCat("the model needs the prose it was trained on: ", filler.status().message());
      return s;
    }
    s->filler = *std::move(filler);
    s->model = std::make_unique<model::Transformer>(*std::move(model));
    s->backend = *CreateCpuBackend({});
    auto docs = GeneratePasskeyDocuments(s->filler, 3, kDocs, {});
    auto eval = PasskeyEval::Create(s->model.get(), *std::move(docs), kWindow, s->backend.get());
    if (!eval.ok()) {
      s->skip = absl::StrCat("FAILED: ", eval.status().ToString());
      return s;
    }
    s->eval = *std::move(eval);
    return s;
  }();
  return *state;
}

class PasskeyModelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelState& s = State();
    ASSERT_FALSE(absl::StartsWith(s.skip, "FAILED")) << s.skip;
    if (!s.skip.empty()) GTEST_SKIP() << s.skip;
    eval_ = s.eval.get();
  }
  PasskeyEval* eval_ = nullptr;
};

CompressionSpec Eviction(EvictionPolicy policy, double keep) {
  CompressionSpec spec;
  spec.eviction.policy = policy;
  spec.eviction.keep_ratio = keep;
  return spec;
}

TEST_F(PasskeyModelTest, FullCacheAnswersMostDocuments) {
  const PasskeyResult& full = eval_->full_cache();
  EXPECT_EQ(full.documents, kDocs);
  ASSERT_EQ(full.answers.size(), static_cast<size_t>(kDocs));
  // The model's published full-cache accuracy is 0.82 on 200 documents (0.80 with this generator);
  // a broken pipeline (positions, byte order, RoPE) answers almost nothing.
  EXPECT_GE(full.accuracy, 0.6) << full.correct << "/" << kDocs;
  int correct = 0;
  for (int i = 0; i < kDocs; ++i) {
    EXPECT_EQ(full.answers[i].size(), 5u);
    correct += full.answers[i] == eval_->documents()[i].answer();
  }
  EXPECT_EQ(correct, full.correct);
}

TEST_F(PasskeyModelTest, KeepingEverythingAnswersLikeTheFullCacheInBothScenarios) {
  const Compressor compress = InProcessCompressor(State().backend.get());
  for (PasskeyScenario s : {PasskeyScenario::kInside, PasskeyScenario::kAfter}) {
    auto r = eval_->Evaluate(CompressionSpec{}, s, compress);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->answers, eval_->full_cache().answers) << ScenarioName(s);
    EXPECT_EQ(r->correct, eval_->full_cache().correct);
    EXPECT_GT(r->size_ratio, 1.0);  // headers on top of every byte
    EXPECT_LT(r->size_ratio, 1.05);
  }
}

TEST_F(PasskeyModelTest, EvictionCostsAnswersAndShrinksTheCache) {
  const Compressor compress = InProcessCompressor(State().backend.get());
  // knorm at keep 0.25 keeps low-norm keys, not the needle: it loses answers in both scenarios;
  // snapkv (inside) reads the question and keeps more than knorm does.
  auto knorm_in =
      eval_->Evaluate(Eviction(EvictionPolicy::kKNorm, 0.25), PasskeyScenario::kInside, compress);
  auto knorm_after =
      eval_->Evaluate(Eviction(EvictionPolicy::kKNorm, 0.25), PasskeyScenario::kAfter, compress);
  auto snap_in =
      eval_->Evaluate(Eviction(EvictionPolicy::kSnapKV, 0.25), PasskeyScenario::kInside, compress);
  ASSERT_TRUE(knorm_in.ok() && knorm_after.ok() && snap_in.ok());
  EXPECT_LT(knorm_in->correct, eval_->full_cache().correct);
  EXPECT_LT(knorm_after->correct, eval_->full_cache().correct);
  EXPECT_GT(snap_in->correct, knorm_in->correct);
  EXPECT_NEAR(snap_in->size_ratio, 0.25, 0.02);
  EXPECT_EQ(knorm_after->obs_window, 0);  // query-agnostic after compression
  EXPECT_EQ(knorm_in->obs_window, kWindow);
  EXPECT_EQ(snap_in->interval.lo, WilsonInterval(snap_in->correct, kDocs).lo);
}

TEST_F(PasskeyModelTest, ScenariosCompressTheRightPositions) {
  const PasskeyDocument& d = eval_->documents()[0];
  const CompressionSpec snap = Eviction(EvictionPolicy::kSnapKV, 0.5);
  const CompressionSpec stream = Eviction(EvictionPolicy::kStreaming, 0.5);
  EXPECT_EQ(eval_->WindowFor(snap, PasskeyScenario::kInside), kWindow);
  EXPECT_EQ(eval_->WindowFor(snap, PasskeyScenario::kAfter), kWindow);  // needs queries
  EXPECT_EQ(eval_->WindowFor(stream, PasskeyScenario::kInside), kWindow);
  EXPECT_EQ(eval_->WindowFor(stream, PasskeyScenario::kAfter), 0);

  auto inside = eval_->Prefix(0, PasskeyScenario::kInside, kWindow);
  auto after = eval_->Prefix(0, PasskeyScenario::kAfter, 0);
  ASSERT_TRUE(inside.ok() && after.ok());
  EXPECT_EQ(inside->prefix_len, static_cast<int>(d.prompt.size()) - 1);  // all but the last byte
  EXPECT_EQ(after->prefix_len, d.question_offset);                       // the haystack
  const int hd = inside->head_dim;
  EXPECT_EQ(inside->layers->at(0).k.size(),
            static_cast<size_t>(inside->num_kv_heads) * inside->prefix_len * hd);
  EXPECT_EQ(inside->layers->at(0).q.size(), static_cast<size_t>(inside->num_q_heads) * kWindow * hd);
  EXPECT_TRUE(after->layers->at(0).q.empty());
  // The haystack's keys are the first rows of the whole prompt's keys (one forward pass).
  EXPECT_TRUE(std::equal(after->layers->at(1).k.begin(), after->layers->at(1).k.begin() + 5 * hd,
                         inside->layers->at(1).k.begin()));

  EXPECT_THAT(eval_->Prefix(0, PasskeyScenario::kInside, 5).status().message(),
              HasSubstr("obs_window"));
  EXPECT_THAT(eval_->Prefix(kDocs, PasskeyScenario::kInside, 0).status().message(),
              HasSubstr("out of range"));
  // Blobs of one scenario do not fit the other: the positions would be wrong.
  auto blobs = InProcessCompressor(State().backend.get())(*inside, CompressionSpec{}, 0);
  ASSERT_TRUE(blobs.ok());
  EXPECT_THAT(eval_->AnswerOnCompact(0, PasskeyScenario::kAfter, *blobs).status().message(),
              HasSubstr("seq_len"));
}

// kvzip's reconstruction pass (recon.h) runs the compressed part twice: the suite's documents
// (up to 384 bytes) do not fit the model's 384 positions twice, short ones do, and long ones in
// chunks.
TEST_F(PasskeyModelTest, KVzipReconstructsTheCompressedPartOrSaysWhyNot) {
  const CompressionSpec kvzip = *ParseSpecString("kvzip:0.5,stats=1");
  EXPECT_THAT(eval_->PrefixFor(0, PasskeyScenario::kAfter, kvzip).status().message(),
              HasSubstr("past the model's seq_len 384"));
  PasskeyDocOptions small;
  small.max_bytes = 190;  // 2 x 189 + 1 <= 384
  auto docs = GeneratePasskeyDocuments(State().filler, 5, 3, small);
  ASSERT_TRUE(docs.ok()) << docs.status();
  auto eval = PasskeyEval::Create(State().model.get(), *std::move(docs), 8,
                                  State().backend.get());
  ASSERT_TRUE(eval.ok()) << eval.status();
  ReconPrompts prompts;
  prompts.prompt = {256};
  EXPECT_THAT((*eval)->SetKVzipPrompts(prompts).message(), HasSubstr("kvzip_prompt: token 256"));
  prompts.prompt = {'\n'};
  ASSERT_TRUE((*eval)->SetKVzipPrompts(prompts).ok());
  for (PasskeyScenario scenario : {PasskeyScenario::kInside, PasskeyScenario::kAfter}) {
    SCOPED_TRACE(ScenarioName(scenario));
    int longest = 0;
    for (int i = 0; i < 3; ++i) {
      auto prefix = (*eval)->PrefixFor(i, scenario, kvzip);
      ASSERT_TRUE(prefix.ok()) << prefix.status();
      ASSERT_NE(prefix->recon, nullptr);
      EXPECT_EQ(prefix->obs_window, prefix->prefix_len + 1);  // the copy and the prompt's byte
      longest = std::max(longest, prefix->obs_window);
    }
    auto r = (*eval)->Evaluate(kvzip, scenario, InProcessCompressor(State().backend.get()));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->documents, 3);
    EXPECT_EQ(r->answers.size(), 3u);
    EXPECT_EQ(r->obs_window, longest);
    EXPECT_LT(r->size_ratio, 0.75);
  }
  // In chunks of 32 bytes the suite's own documents fit: one pass a chunk, each after its
  // instruction and the previous chunk's last 8 bytes, named in the spec of every document.
  auto long_docs = GeneratePasskeyDocuments(State().filler, 5, 3, {});
  ASSERT_TRUE(long_docs.ok()) << long_docs.status();
  auto chunked = PasskeyEval::Create(State().model.get(), *std::move(long_docs), 8,
                                     State().backend.get());
  ASSERT_TRUE(chunked.ok()) << chunked.status();
  prompts.part_prompt = {'\n', '\n'};
  prompts.chunk = 32;  // the longest pass: 334 + 2 + 8 + 32 <= 384
  ASSERT_TRUE((*chunked)->SetKVzipPrompts(prompts).ok());
  for (PasskeyScenario scenario : {PasskeyScenario::kInside, PasskeyScenario::kAfter}) {
    SCOPED_TRACE(ScenarioName(scenario));
    auto prefix = (*chunked)->PrefixFor(0, scenario, kvzip);
    ASSERT_TRUE(prefix.ok()) << prefix.status();
    const int s = prefix->prefix_len, passes = 1 + (s - 1) / 32;
    ASSERT_GT(passes, 2);
    ASSERT_EQ(prefix->recon->pass_rows.size(), static_cast<size_t>(passes));
    EXPECT_EQ(prefix->recon->pass_rows[0], 1 + 32);
    EXPECT_EQ(prefix->recon->pass_rows[1], 2 + 8 + 32);
    EXPECT_EQ(prefix->recon->pass_rows.back(), 2 + 8 + s - (passes - 1) * 32);
    EXPECT_EQ(prefix->obs_window, 1 + s + (passes - 1) * 10);
    auto r = (*chunked)->Evaluate(kvzip, scenario, InProcessCompressor(State().backend.get()));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->documents, 3);
    EXPECT_LT(r->size_ratio, 0.75);
  }
}

TEST_F(PasskeyModelTest, CreateRejectsBadInput) {
  const model::Transformer* m = State().model.get();
  auto docs = GeneratePasskeyDocuments(State().filler, 3, 2, {});
  ASSERT_TRUE(docs.ok());
  EXPECT_THAT(PasskeyEval::Create(m, *docs, 0, nullptr).status().message(), HasSubstr("window"));
  EXPECT_THAT(PasskeyEval::Create(m, *docs, 400, nullptr).status().message(),
              HasSubstr("shortest haystack"));
  EXPECT_THAT(PasskeyEval::Create(m, {}, 16, nullptr).status().message(), HasSubstr("none"));
  PasskeyDocOptions big;
  big.max_bytes = 512;
  auto long_docs = GeneratePasskeyDocuments(State().filler, 3, 1, big);
  ASSERT_TRUE(long_docs.ok());
  EXPECT_THAT(PasskeyEval::Create(m, *long_docs, 16, nullptr).status().message(),
              HasSubstr("seq_len is 384"));
  EXPECT_THAT(PasskeyEval::Create(nullptr, *docs, 16, nullptr).status().message(),
              HasSubstr("model"));
}

#ifdef KVCD_PATH
// Through a real kvcd: PutCache with the spec, GetCache PACKED; the served blobs must give exactly
// the in-process answers in both scenarios.
TEST_F(PasskeyModelTest, ViaKvcdAnswersExactlyLikeInProcess) {
  ::kvc::testing::KvcdProcess::Options kvcd_options;
  kvcd_options.binary = KVCD_PATH;
  auto kvcd = ::kvc::testing::KvcdProcess::Start(kvcd_options);
  ASSERT_TRUE(kvcd.ok()) << kvcd.status();
  ClientOptions client_options;
  client_options.target = (*kvcd)->address();
  auto client = Client::Create(client_options);
  ASSERT_TRUE(client.ok()) << client.status();
  const Compressor local = InProcessCompressor(State().backend.get());
  const Compressor remote = KvcdCompressor(client->get(), "passkey-test");
  for (const CompressionSpec& spec :
       {Eviction(EvictionPolicy::kSnapKV, 0.25), Eviction(EvictionPolicy::kStreaming, 0.25)}) {
    for (PasskeyScenario s : {PasskeyScenario::kInside, PasskeyScenario::kAfter}) {
      const std::string name =
          absl::StrCat(std::string(PolicyName(spec.eviction.policy)), " ", ScenarioName(s));
      auto w = eval_->WindowFor(spec, s);
      auto prefix = eval_->Prefix(1, s, w);
      ASSERT_TRUE(prefix.ok()) << name;
      auto a = local(*prefix, spec, 1);
      auto b = remote(*prefix, spec, 1);
      ASSERT_TRUE(a.ok() && b.ok()) << name << ": " << a.status() << " " << b.status();
      ASSERT_EQ(a->size(), b->size());
      for (size_t l = 0; l < a->size(); ++l) EXPECT_EQ((*a)[l].bytes, (*b)[l].bytes) << name;
      auto r_local = eval_->Evaluate(spec, s, local);
      auto r_remote = eval_->Evaluate(spec, s, remote);
      ASSERT_TRUE(r_local.ok() && r_remote.ok()) << name;
      EXPECT_EQ(r_local->answers, r_remote->answers) << name;
      EXPECT_EQ(r_local->size_ratio, r_remote->size_ratio) << name;
    }
  }
  auto left = (*client)->ListCaches("passkey-test");
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_TRUE(left->empty());
}
#endif  // KVCD_PATH

#ifdef KVCPASSKEY_PATH
struct ToolRun {
  int exit_code = -1;
  std::string output;  // stdout and stderr
};

ToolRun RunTool(const std::string& args) {
  ToolRun run;
  const std::string command = absl::StrCat(KVCPASSKEY_PATH, " ", args, " 2>&1");
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), pipe)) > 0) run.output.append(buf, n);
  const int status = ::pclose(pipe);
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

TEST(PasskeyToolTest, RejectsBadFlagsBeforeWork) {
  // Flags are checked before the model is read, so these need no model; only the filler check
  // comes after loading it.
  const std::string path = ::kvc::testing::ModelPath();
  const std::string model = "--model=" + (path.empty() ? "/nonexistent-dir/m.bin" : path);
  struct Case {
    std::string args, message;
  };
  std::vector<Case> cases = {
      {"", "--model: required"},
      {model + " --documents=0", "--documents: 0 < 1"},
      {model + " --spec=';'", "--spec: no spec given"},
      {model + " --spec='full;nosuch:0.5'", "--spec: 'nosuch:0.5'"},
      {model + " --scenarios=sideways", "--scenarios: 'sideways'"},
      {model + " --max_bytes=64", "--max_bytes"},
      {model + " --threads=-1", "--threads: -1 must be >= 0"},
      {model + " --attention_math=fast",
       "--attention_math: unknown 'fast' (expected auto, exact or integer)"},
      {model + " --kvzip_prompt=1,x", "--kvzip_prompt: 'x'"},
      {model + " --csv=/nonexistent-dir/x.csv", "--csv: cannot write"},
      {model + " stray", "unexpected argument 'stray'"},
      {"--model=/nonexistent-dir/m.bin", "m.bin"},
  };
  if (!path.empty()) {
    cases.push_back(
        {model + " --filler=/nonexistent-dir", "filler: '/nonexistent-dir' does not exist"});
  }
  for (const Case& c : cases) {
    const ToolRun run = RunTool(c.args);
    EXPECT_EQ(run.exit_code, 1) << c.args << "\n" << run.output;
    EXPECT_THAT(run.output, HasSubstr(c.message)) << c.args;
  }
}

TEST_F(PasskeyModelTest, ToolRunsAndWritesCsv) {
  const std::string csv = TempPath("out.csv");
  const RemovedAtEnd remove_csv{csv};
  const std::string model = "--model=" + ::kvc::testing::ModelPath();
  const ToolRun bad_window = RunTool(model + " --documents=2 --window=1000");
  EXPECT_EQ(bad_window.exit_code, 1);
  EXPECT_THAT(bad_window.output, HasSubstr("--window: 1000 is outside"));
  const ToolRun too_long = RunTool(model + " --documents=2 --max_bytes=512");
  EXPECT_EQ(too_long.exit_code, 1);
  EXPECT_THAT(too_long.output, HasSubstr("--max_bytes: documents: document 0 has"));
  EXPECT_THAT(too_long.output, HasSubstr("seq_len is 384"));
  // kvzip rows are checked before any row runs: these documents do not fit twice.
  const ToolRun kvzip_long = RunTool(model + " --documents=2 --spec='full;kvzip:0.5'");
  EXPECT_EQ(kvzip_long.exit_code, 1);
  EXPECT_THAT(kvzip_long.output, HasSubstr("kvzip:0.5: kvzip: a reconstruction pass runs"));
  EXPECT_THAT(kvzip_long.output, Not(HasSubstr("full cache: ")));
  const ToolRun kvzip = RunTool(model + " --documents=2 --max_bytes=190 --window=8 " +
                                "--spec='kvzip:0.5,stats=1' --kvzip_prompt=10");
  EXPECT_EQ(kvzip.exit_code, 0) << kvzip.output;
  EXPECT_THAT(kvzip.output, HasSubstr("kvzip:0.5,stats=1"));
  // The long documents run in chunks of 16 bytes, each pass after its own instruction (after
  // the question: inside, the compressed part is the whole prompt and cannot fit).
  const ToolRun chunked = RunTool(model + " --documents=2 --window=8 --scenarios=after " +
                                  "--spec='kvzip:0.5,stats=1' " +
                                  "--kvzip_prompt=10 --kvzip_part_prompt=10,10 --kvzip_chunk=16");
  EXPECT_EQ(chunked.exit_code, 0) << chunked.output;
  EXPECT_THAT(chunked.output, HasSubstr("kvzip:0.5,stats=1"));
  const ToolRun bad_suffix = RunTool(model + " --documents=2 --spec='kvzip:0.5' " +
                                     "--kvzip_part_suffix=1,z");
  EXPECT_EQ(bad_suffix.exit_code, 1);
  EXPECT_THAT(bad_suffix.output, HasSubstr("--kvzip_part_suffix: 'z'"));

  const ToolRun run = RunTool(model + " --documents=3 --seed=3 --window=16 " +
                              "--spec='full;streaming:0.25' --csv=" + csv);
  ASSERT_EQ(run.exit_code, 0) << run.output;
  EXPECT_THAT(run.output, HasSubstr("full cache: "));
  EXPECT_THAT(run.output, HasSubstr("Wilson 95%"));
  std::ifstream in(csv);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 5u) << run.output;  // header + 2 specs x 2 scenarios
  EXPECT_EQ(lines[0],
            "spec,scenario,window,documents,correct,accuracy,ci95_lo,ci95_hi,size_ratio,"
            "full_accuracy");
  EXPECT_TRUE(absl::StartsWith(lines[1], "full,inside,16,3,")) << lines[1];
  EXPECT_TRUE(absl::StartsWith(lines[2], "full,after,0,3,")) << lines[2];
  EXPECT_THAT(lines[3], HasSubstr(",inside,16,3,"));
  EXPECT_THAT(lines[4], HasSubstr(",after,0,3,"));
  // The first three documents of --seed=3 are the suite's: the same full-cache answers.
  int full_correct = 0;
  for (int i = 0; i < 3; ++i) {
    full_correct += eval_->full_cache().answers[i] == eval_->documents()[i].answer();
  }
  const std::vector<std::string> row = absl::StrSplit(lines[1], ',');
  EXPECT_EQ(row[4], std::to_string(full_correct));
}
#endif  // KVCPASSKEY_PATH

}  // namespace
}  // namespace kvc::fidelity

#include "kvc/fidelity/passkey.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <memory>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "kvc/model/kv_cache.h"
#include "kvc/status_macros.h"
#include "tensor_rows.h"

namespace kvc::fidelity {
namespace {

constexpr int kMinFillerBytes = 20;
constexpr int kMaxFillerBytes = 90;
constexpr int kMinNameLetters = 4;
constexpr int kMaxNameLetters = 7;
constexpr char kNeedleHead[] = "The pass key of ";
constexpr char kQuestionHead[] = "Q: pass key of ";
constexpr char kQuestionTail[] = "?\nA: ";

uint64_t SplitMix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Own generator (no std distributions), so documents are the same on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    state_ += 0x9e3779b97f4a7c15ull;
    return SplitMix64(state_);
  }
  // Uniform in [0, n), n >= 1; the modulo bias is below 2^-50 for the n used here.
  int Below(int n) { return static_cast<int>(Next() % static_cast<uint64_t>(n)); }

 private:
  uint64_t state_;
};

std::string NeedleLine(const std::string& name, const std::string& key) {
  return absl::StrCat(kNeedleHead, name, " is ", key, ".\n");
}

std::string Question(const std::string& name) {
  return absl::StrCat(kQuestionHead, name, kQuestionTail);
}

// Longest needle line and question the generator can produce.
constexpr int kMaxNeedleBytes = 16 + kMaxNameLetters + 4 + kPasskeyDigits + 2;
constexpr int kMaxQuestionBytes = 15 + kMaxNameLetters + 5;

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

bool IsFillerLine(std::string_view line) {
  const int n = static_cast<int>(line.size());
  if (n < kMinFillerBytes || n > kMaxFillerBytes) return false;
  if (line.front() == ' ' || line.back() == ' ') return false;
  int letters = 0;
  for (char c : line) {
    if (c < 0x20 || c > 0x7e) return false;  // printable ASCII only (no tabs, no UTF-8)
    if (absl::ascii_isalpha(static_cast<unsigned char>(c))) ++letters;
  }
  return letters * 10 >= n * 6;
}

std::vector<std::string> FillerLinesFromText(std::string_view text) {
  std::vector<std::string> out;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    line = absl::StripAsciiWhitespace(line);
    if (IsFillerLine(std::string_view(line.data(), line.size()))) out.emplace_back(line);
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> LoadFillerLines(const std::string& path) {
  struct stat st;
  if (path.empty() || ::stat(path.c_str(), &st) != 0) {
    return absl::NotFoundError(absl::StrCat("filler: '", path, "' does not exist"));
  }
  std::vector<std::string> files;
  if (S_ISDIR(st.st_mode)) {
    DIR* dir = ::opendir(path.c_str());
    if (dir == nullptr)
      return absl::NotFoundError(absl::StrCat("filler: cannot list '", path, "'"));
    while (const dirent* e = ::readdir(dir)) {
      const std::string file = absl::StrCat(path, "/", e->d_name);
      struct stat fst;
      if (::stat(file.c_str(), &fst) == 0 && S_ISREG(fst.st_mode)) files.push_back(file);
    }
    ::closedir(dir);
    std::sort(files.begin(), files.end());
  } else {
    files.push_back(path);
  }
  std::vector<std::string> lines;
  for (const std::string& file : files) {
    ASSIGN_OR_RETURN(std::string text, ReadFile(file));
    std::vector<std::string> more = FillerLinesFromText(text);
    lines.insert(lines.end(), std::make_move_iterator(more.begin()),
                 std::make_move_iterator(more.end()));
  }
  if (lines.empty()) {
    return absl::NotFoundError(absl::StrFormat(
        "filler: no usable line in '%s' (%zu files): need lines of %d-%d printable ASCII bytes, "
        "mostly letters (e.g. the license texts in /usr/share/common-licenses)",
        path, files.size(), kMinFillerBytes, kMaxFillerBytes));
  }
  return lines;
}

absl::Status ValidatePasskeyDocOptions(const PasskeyDocOptions& o) {
  if (o.min_needles < 1 || o.min_needles > o.max_needles || o.max_needles > 8) {
    return absl::InvalidArgumentError(absl::StrCat("needles: [", o.min_needles, ", ", o.max_needles,
                                                   "] must satisfy 1 <= min <= max <= 8"));
  }
  const int least = std::max(128, kMaxQuestionBytes + o.max_needles * kMaxNeedleBytes);
  if (o.max_bytes < least) {
    return absl::InvalidArgumentError(absl::StrCat("max_bytes: ", o.max_bytes,
                                                   " must be >= ", least, " for up to ",
                                                   o.max_needles, " needles"));
  }
  return absl::OkStatus();
}

absl::StatusOr<PasskeyDocument> GeneratePasskeyDocument(absl::Span<const std::string> filler,
                                                        uint64_t seed,
                                                        const PasskeyDocOptions& options) {
  RETURN_IF_ERROR(ValidatePasskeyDocOptions(options));
  if (filler.empty()) return absl::InvalidArgumentError("filler: no lines");
  Rng rng(seed);
  const int n_needles =
      options.min_needles + rng.Below(options.max_needles - options.min_needles + 1);
  std::vector<PasskeyNeedle> needles;
  while (static_cast<int>(needles.size()) < n_needles) {
    PasskeyNeedle n;
    const int letters = kMinNameLetters + rng.Below(kMaxNameLetters - kMinNameLetters + 1);
    for (int i = 0; i < letters; ++i) n.name.push_back(static_cast<char>('a' + rng.Below(26)));
    for (int i = 0; i < kPasskeyDigits; ++i)
      n.key.push_back(static_cast<char>('0' + rng.Below(10)));
    // Distinct names, and distinct keys so that answering another needle never scores.
    const bool clash = std::any_of(needles.begin(), needles.end(), [&](const PasskeyNeedle& o) {
      return o.name == n.name || o.key == n.key;
    });
    if (!clash) needles.push_back(std::move(n));
  }
  const int asked = rng.Below(n_needles);

  int room = options.max_bytes - static_cast<int>(Question(needles[asked].name).size());
  for (const PasskeyNeedle& n : needles) room -= static_cast<int>(NeedleLine(n.name, n.key).size());
  std::vector<const std::string*> lines;
  for (;;) {
    const std::string& line = filler[rng.Below(static_cast<int>(filler.size()))];
    const int bytes = static_cast<int>(line.size()) + 1;
    if (bytes > room) break;
    lines.push_back(&line);
    room -= bytes;
  }
  // Needle j goes before filler line slot[j] (slot == lines.size(): after the last line).
  std::vector<int> slot(n_needles);
  for (int& s : slot) s = rng.Below(static_cast<int>(lines.size()) + 1);

  PasskeyDocument doc;
  for (int s = 0; s <= static_cast<int>(lines.size()); ++s) {
    for (int j = 0; j < n_needles; ++j) {
      if (slot[j] != s) continue;
      PasskeyNeedle n = needles[j];
      n.offset = static_cast<int>(doc.prompt.size());
      if (j == asked) doc.asked = static_cast<int>(doc.needles.size());
      absl::StrAppend(&doc.prompt, NeedleLine(n.name, n.key));
      doc.needles.push_back(std::move(n));
    }
    if (s < static_cast<int>(lines.size())) absl::StrAppend(&doc.prompt, *lines[s], "\n");
  }
  doc.question_offset = static_cast<int>(doc.prompt.size());
  absl::StrAppend(&doc.prompt, Question(needles[asked].name));
  return doc;
}

absl::StatusOr<std::vector<PasskeyDocument>> GeneratePasskeyDocuments(
    absl::Span<const std::string> filler, uint64_t seed, int count,
    const PasskeyDocOptions& options) {
  if (count < 1) return absl::InvalidArgumentError(absl::StrCat("documents: ", count, " < 1"));
  std::vector<PasskeyDocument> docs;
  for (int i = 0; i < count; ++i) {
    ASSIGN_OR_RETURN(PasskeyDocument doc,
                     GeneratePasskeyDocument(
                         filler, SplitMix64(SplitMix64(seed) ^ static_cast<uint64_t>(i)), options));
    docs.push_back(std::move(doc));
  }
  return docs;
}

bool IsExactAnswer(std::string_view generated, std::string_view answer) {
  if (answer.size() != static_cast<size_t>(kPasskeyDigits)) return false;
  if (!std::all_of(answer.begin(), answer.end(),
                   [](char c) { return absl::ascii_isdigit(static_cast<unsigned char>(c)); })) {
    return false;
  }
  return generated.substr(0, answer.size()) == answer;
}

ProportionInterval WilsonInterval(int successes, int trials, double z) {
  if (trials <= 0) return {};
  const double n = trials, p = static_cast<double>(successes) / n, z2 = z * z;
  const double center = (p + z2 / (2 * n)) / (1 + z2 / n);
  const double half = z * std::sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n);
  return {std::max(0.0, center - half), std::min(1.0, center + half)};
}

const char* ScenarioName(PasskeyScenario scenario) {
  return scenario == PasskeyScenario::kInside ? "inside" : "after";
}

std::string FormatAccuracy(const PasskeyResult& r) {
  return absl::StrFormat("%.3f [%.3f, %.3f]", r.accuracy, r.interval.lo, r.interval.hi);
}

TokenDocument ToTokenDocument(const PasskeyDocument& doc) {
  TokenDocument t;
  for (char ch : doc.prompt) t.prompt.push_back(static_cast<unsigned char>(ch));
  t.question_start = doc.question_offset;
  for (char ch : doc.answer()) t.answer.push_back(static_cast<unsigned char>(ch));
  return t;
}

absl::StatusOr<std::unique_ptr<PasskeyEval>> PasskeyEval::Create(const model::Transformer* model,
                                                                 std::vector<PasskeyDocument> docs,
                                                                 int obs_window,
                                                                 Backend* attention) {
  if (model == nullptr) return absl::InvalidArgumentError("model: null");
  const model::LlamaConfig& c = model->config();
  if (c.vocab_size != 256) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model: vocab_size ", c.vocab_size, ", the pass-key task needs a byte-level model (256)"));
  }
  std::vector<TokenDocument> tokens;
  for (size_t i = 0; i < docs.size(); ++i) {
    const int s = static_cast<int>(docs[i].prompt.size());
    if (docs[i].needles.empty() || docs[i].question_offset < 1 || docs[i].question_offset >= s ||
        docs[i].asked < 0 || docs[i].asked >= static_cast<int>(docs[i].needles.size())) {
      return absl::InvalidArgumentError(absl::StrCat("documents: document ", i, " is malformed"));
    }
    tokens.push_back(ToTokenDocument(docs[i]));
  }
  return CreateChecked(model, std::move(docs), std::move(tokens), obs_window, attention, "bytes");
}

absl::StatusOr<std::unique_ptr<PasskeyEval>> PasskeyEval::CreateFromTokens(
    const model::Transformer* model, std::vector<TokenDocument> docs, int obs_window,
    Backend* attention) {
  if (model == nullptr) return absl::InvalidArgumentError("model: null");
  return CreateChecked(model, {}, std::move(docs), obs_window, attention, "tokens");
}

absl::StatusOr<std::unique_ptr<PasskeyEval>> PasskeyEval::CreateChecked(
    const model::Transformer* model, std::vector<PasskeyDocument> docs,
    std::vector<TokenDocument> tokens, int obs_window, Backend* attention, const char* unit) {
  const model::LlamaConfig& c = model->config();
  if (tokens.empty()) return absl::InvalidArgumentError("documents: none");
  int shortest = c.seq_len;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const TokenDocument& d = tokens[i];
    const std::string where =
        absl::StrCat("documents: document ", i, d.id.empty() ? "" : absl::StrCat(" (", d.id, ")"));
    const int64_t s = static_cast<int64_t>(d.prompt.size());
    if (s < 2 || d.question_start < 1 || d.question_start >= s) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": question_start ", d.question_start,
                                                     " is outside [1, prompt size - 1 = ", s - 1,
                                                     "]"));
    }
    if (d.answer.empty() || d.answer.size() > static_cast<size_t>(kMaxAnswerTokens)) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": answer of ", d.answer.size(),
                                                     " tokens, must be 1..", kMaxAnswerTokens));
    }
    if (s > c.seq_len) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has ", s, " ", unit, ", the model's seq_len is ", c.seq_len));
    }
    for (const std::vector<int32_t>* ids : {&d.prompt, &d.answer}) {
      for (size_t t = 0; t < ids->size(); ++t) {
        if ((*ids)[t] < 0 || (*ids)[t] >= c.vocab_size) {
          return absl::InvalidArgumentError(absl::StrCat(
              where, ": ", ids == &d.prompt ? "prompt" : "answer", "[", t, "] = ", (*ids)[t],
              " is outside the model's vocabulary [0, ", c.vocab_size, ")"));
        }
      }
    }
    shortest = std::min(shortest, d.question_start);
  }
  if (obs_window < 1 || obs_window > shortest) {
    return absl::InvalidArgumentError(absl::StrCat("window: ", obs_window, " is outside [1, ",
                                                   shortest, "] (the shortest haystack)"));
  }
  ASSIGN_OR_RETURN(const RopeParams rope, model::EngineRope(c));
  std::unique_ptr<PasskeyEval> eval(
      new PasskeyEval(model, std::move(docs), std::move(tokens), obs_window, attention));
  eval->rope_ = rope;
  RETURN_IF_ERROR(eval->Prepare());
  return eval;
}

int PasskeyEval::CompressedLength(int i, PasskeyScenario scenario) const {
  return scenario == PasskeyScenario::kInside ? static_cast<int>(tokens_[i].prompt.size()) - 1
                                              : tokens_[i].question_start;
}

bool PasskeyEval::IsCorrect(int i, const std::vector<int32_t>& generated) const {
  return generated == tokens_[i].answer;
}

std::string PasskeyEval::AnswerText(const std::vector<int32_t>& generated) const {
  if (!docs_.empty()) {
    std::string bytes;
    for (int32_t t : generated) bytes.push_back(static_cast<char>(t));
    return bytes;
  }
  return absl::StrJoin(generated, " ");
}

absl::Status PasskeyEval::Prepare() {
  const model::LlamaConfig& c = model_->config();
  const int hd = c.head_dim(), w = obs_window_;
  full_.documents = static_cast<int>(tokens_.size());
  model::ForwardOptions forward;
  forward.last_logits = 0;  // answers come from decoding
  for (int i = 0; i < full_.documents; ++i) {
    const std::vector<int32_t>& tokens = tokens_[i].prompt;
    const int s = static_cast<int>(tokens.size());
    const int n_answer = static_cast<int>(tokens_[i].answer.size());
    ASSIGN_OR_RETURN(model::ForwardOutput fwd, model_->Forward(tokens, forward));
    DocCache cache;
    const int p_in = CompressedLength(i, PasskeyScenario::kInside);
    const int p_hay = CompressedLength(i, PasskeyScenario::kAfter);
    for (const model::LayerProjections& layer : fwd.layers) {
      cache.q_in.push_back(Rows(layer.q, c.n_heads, s, hd, p_in - w, w));
      cache.q_hay.push_back(Rows(layer.q, c.n_heads, s, hd, p_hay - w, w));
    }
    // Full-cache reference, decoded the same way as on a compact cache.
    ASSIGN_OR_RETURN(std::unique_ptr<model::FullKvCache> full,
                     model::FullKvCache::FromPrefix(c, fwd.layers, s, p_in, p_in + n_answer));
    ASSIGN_OR_RETURN(std::vector<int32_t> answer,
                     Generate(i, PasskeyScenario::kInside, full.get()));
    if (IsCorrect(i, answer)) ++full_.correct;
    full_.answers.push_back(AnswerText(answer));
    for (model::LayerProjections& layer : fwd.layers) {
      cache.k.push_back(std::move(layer.k));
      cache.v.push_back(std::move(layer.v));
    }
    caches_.push_back(std::move(cache));
  }
  full_.accuracy = static_cast<double>(full_.correct) / full_.documents;
  full_.interval = WilsonInterval(full_.correct, full_.documents);
  full_.obs_window = 0;
  full_.size_ratio = 1.0;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int32_t>> PasskeyEval::Generate(int i, PasskeyScenario scenario,
                                                           model::KvCache* cache) const {
  const TokenDocument& d = tokens_[i];
  const int vocab = model_->config().vocab_size;
  std::vector<float> logits(vocab);
  for (size_t t = CompressedLength(i, scenario); t < d.prompt.size(); ++t) {
    RETURN_IF_ERROR(model_->DecodeStep(d.prompt[t], cache, absl::MakeSpan(logits)));
  }
  std::vector<int32_t> answer;
  for (;;) {
    const int32_t next = ArgMax(logits.data(), vocab);
    answer.push_back(next);
    if (answer.size() == d.answer.size()) break;
    RETURN_IF_ERROR(model_->DecodeStep(next, cache, absl::MakeSpan(logits)));
  }
  return answer;
}

int PasskeyEval::WindowFor(const CompressionSpec& spec, PasskeyScenario scenario) const {
  if (scenario == PasskeyScenario::kInside) return obs_window_;
  const model::LlamaConfig& c = model_->config();
  LayerShape shape;
  shape.num_kv_heads = c.n_kv_heads;
  shape.num_q_heads = c.n_heads;
  shape.head_dim = c.head_dim();
  shape.seq_len = CompressedLength(0, scenario);
  shape.obs_window = 0;
  return ValidateSpec(spec, shape, 0).ok() ? 0 : obs_window_;
}

absl::StatusOr<PrefixCache> PasskeyEval::Prefix(int i, PasskeyScenario scenario,
                                                int obs_window) const {
  if (i < 0 || i >= static_cast<int>(tokens_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("document: ", i, " is out of range"));
  }
  if (obs_window != 0 && obs_window != obs_window_) {
    return absl::InvalidArgumentError(
        absl::StrCat("obs_window: ", obs_window, " must be 0 or ", obs_window_));
  }
  const model::LlamaConfig& c = model_->config();
  const int s = static_cast<int>(tokens_[i].prompt.size()), p = CompressedLength(i, scenario);
  const DocCache& cache = caches_[i];
  PrefixCache prefix;
  prefix.prefix_len = p;
  prefix.obs_window = obs_window;
  prefix.num_kv_heads = c.n_kv_heads;
  prefix.num_q_heads = c.n_heads;
  prefix.head_dim = c.head_dim();
  prefix.rope = rope_;
  auto layers = std::make_shared<std::vector<model::LayerProjections>>();
  for (int l = 0; l < c.n_layers; ++l) {
    model::LayerProjections layer;
    layer.k = Rows(cache.k[l], c.n_kv_heads, s, c.head_dim(), 0, p);
    layer.v = Rows(cache.v[l], c.n_kv_heads, s, c.head_dim(), 0, p);
    if (obs_window > 0) {
      layer.q = scenario == PasskeyScenario::kInside ? cache.q_in[l] : cache.q_hay[l];
    }
    layers->push_back(std::move(layer));
  }
  prefix.layers = std::move(layers);
  return prefix;
}

absl::StatusOr<std::vector<int32_t>> PasskeyEval::GenerateOnCompact(
    int i, PasskeyScenario scenario, std::vector<CompactLayer> layers) const {
  if (i < 0 || i >= static_cast<int>(tokens_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("document: ", i, " is out of range"));
  }
  const int p = CompressedLength(i, scenario);
  const int fed = static_cast<int>(tokens_[i].prompt.size()) - p;
  const int n_answer = static_cast<int>(tokens_[i].answer.size());
  ASSIGN_OR_RETURN(std::unique_ptr<model::CompactKvCache> cache,
                   model::CompactKvCache::Create(model_->config(), std::move(layers), attention_,
                                                 fed + n_answer - 1));
  // New tokens' RoPE positions continue at the blobs' seq_len: it must be the compressed length.
  if (cache->position() != p) {
    return absl::InvalidArgumentError(absl::StrCat("layers: blobs have seq_len ", cache->position(),
                                                   ", the compressed part has ", p));
  }
  return Generate(i, scenario, cache.get());
}

absl::StatusOr<std::string> PasskeyEval::AnswerOnCompact(int i, PasskeyScenario scenario,
                                                         std::vector<CompactLayer> layers) const {
  ASSIGN_OR_RETURN(std::vector<int32_t> answer, GenerateOnCompact(i, scenario, std::move(layers)));
  return AnswerText(answer);
}

absl::Status PasskeyEval::SetKVzipPrompts(ReconPrompts prompts) {
  RETURN_IF_ERROR(CheckKVzipPrompts(model_->config(), prompts));
  kvzip_ = std::move(prompts);
  return absl::OkStatus();
}

absl::StatusOr<PrefixCache> PasskeyEval::PrefixFor(int i, PasskeyScenario scenario,
                                                   const CompressionSpec& spec) const {
  if (!NeedsReconstruction(spec)) return Prefix(i, scenario, WindowFor(spec, scenario));
  RETURN_IF_ERROR(CheckReconstructionSpec(spec));
  ASSIGN_OR_RETURN(PrefixCache prefix, Prefix(i, scenario, 0));
  const std::vector<int32_t>& prompt = tokens_[i].prompt;
  ASSIGN_OR_RETURN(ReconstructionPass pass,
                   RunReconstruction(*model_, absl::MakeConstSpan(prompt.data(), prefix.prefix_len),
                                     kvzip_));
  prefix.obs_window = pass.rows;
  prefix.recon = std::make_shared<const ReconstructionPass>(std::move(pass));
  return prefix;
}

absl::StatusOr<PasskeyResult> PasskeyEval::Evaluate(const CompressionSpec& spec,
                                                    PasskeyScenario scenario,
                                                    const Compressor& compressor) {
  PasskeyResult r;
  r.documents = static_cast<int>(tokens_.size());
  r.obs_window = NeedsReconstruction(spec) ? 0 : WindowFor(spec, scenario);
  uint64_t packed = 0, full = 0;
  for (int i = 0; i < r.documents; ++i) {
    ASSIGN_OR_RETURN(PrefixCache prefix, PrefixFor(i, scenario, spec));
    r.obs_window = std::max(r.obs_window, prefix.obs_window);
    // kvzip over several reconstruction passes: the spec names this document's passes.
    const CompressionSpec doc_spec = SpecForPasses(spec, prefix.recon.get());
    ASSIGN_OR_RETURN(std::vector<CompactLayer> layers, compressor(prefix, doc_spec, i));
    for (const CompactLayer& layer : layers) packed += layer.bytes.size();
    full += prefix.full_bytes();
    ASSIGN_OR_RETURN(std::vector<int32_t> answer,
                     GenerateOnCompact(i, scenario, std::move(layers)));
    if (IsCorrect(i, answer)) ++r.correct;
    r.answers.push_back(AnswerText(answer));
  }
  r.accuracy = static_cast<double>(r.correct) / r.documents;
  r.interval = WilsonInterval(r.correct, r.documents);
  r.size_ratio = full > 0 ? static_cast<double>(packed) / full : 0;
  return r;
}

}  // namespace kvc::fidelity

#include "kvc/fidelity/documents_file.h"

#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"

namespace kvc::fidelity {
namespace {

using Json = nlohmann::json;

absl::Status Bad(const std::string& where, int line, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(where, ":", line, ": ", problem));
}

// A list of token ids: integers in [0, INT32_MAX].
absl::Status GetIds(const Json& doc, const char* key, const std::string& where, int line,
                    std::vector<int32_t>* out) {
  auto it = doc.find(key);
  if (it == doc.end()) return Bad(where, line, absl::StrCat("\"", key, "\" is missing"));
  if (!it->is_array()) {
    return Bad(where, line, absl::StrCat("\"", key, "\" is not a list of token ids"));
  }
  out->reserve(it->size());
  for (size_t i = 0; i < it->size(); ++i) {
    const Json& v = (*it)[i];
    const bool ok = v.is_number_integer() && v.get<int64_t>() >= 0 &&
                    v.get<int64_t>() <= std::numeric_limits<int32_t>::max() &&
                    !(v.is_number_unsigned() && v.get<uint64_t>() > INT32_MAX);
    if (!ok) {
      return Bad(where, line,
                 absl::StrCat("\"", key, "\"[", i, "] = ", v.dump(), " is not a token id"));
    }
    out->push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<TokenDocument>> ParseTokenDocuments(std::string_view text,
                                                               const std::string& where) {
  std::vector<TokenDocument> docs;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(absl::string_view(text.data(), text.size()), '\n')) {
    ++line_no;
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    if (static_cast<int>(docs.size()) == kMaxDocumentsPerFile) {
      return Bad(where, line_no, absl::StrCat("more than ", kMaxDocumentsPerFile, " documents"));
    }
    const Json doc = Json::parse(line.begin(), line.end(), nullptr, false);
    if (doc.is_discarded() || !doc.is_object()) {
      return Bad(where, line_no, "not a JSON object (one document per line)");
    }
    TokenDocument d;
    if (auto id = doc.find("id"); id != doc.end() && !id->is_null()) {
      if (!id->is_string()) return Bad(where, line_no, "\"id\" is not a string");
      d.id = id->get<std::string>();
    }
    if (absl::Status s = GetIds(doc, "prompt", where, line_no, &d.prompt); !s.ok()) return s;
    if (absl::Status s = GetIds(doc, "answer", where, line_no, &d.answer); !s.ok()) return s;
    auto qs = doc.find("question_start");
    if (qs == doc.end()) return Bad(where, line_no, "\"question_start\" is missing");
    if (!qs->is_number_integer()) {
      return Bad(where, line_no,
                 absl::StrCat("\"question_start\" = ", qs->dump(), " is not an integer"));
    }
    const int64_t start = qs->is_number_unsigned() && qs->get<uint64_t>() > INT64_MAX
                              ? INT64_MAX
                              : qs->get<int64_t>();
    const int64_t n = static_cast<int64_t>(d.prompt.size());
    if (n < 2 || start < 1 || start > n - 1) {
      return Bad(where, line_no,
                 absl::StrCat("\"question_start\" = ", start, " must be in [1, len(prompt) - 1 = ",
                              n - 1, "] (a non-empty context and question)"));
    }
    d.question_start = static_cast<int>(start);
    if (d.answer.empty() || d.answer.size() > static_cast<size_t>(kMaxAnswerTokens)) {
      return Bad(where, line_no,
                 absl::StrCat("\"answer\" has ", d.answer.size(), " tokens, must have 1..",
                              kMaxAnswerTokens));
    }
    docs.push_back(std::move(d));
  }
  if (docs.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": no documents"));
  return docs;
}

absl::StatusOr<std::vector<TokenDocument>> ReadTokenDocuments(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  return ParseTokenDocuments(text.str(), path);
}

}  // namespace kvc::fidelity

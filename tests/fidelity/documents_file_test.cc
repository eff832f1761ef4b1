// The pre-tokenized documents file of kvcpasskey --documents_file: what it accepts and how each
// malformed line is refused.
#include "kvc/fidelity/documents_file.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc::fidelity {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(DocumentsFileTest, ParsesDocumentsAndSkipsBlankLines) {
  const std::string text =
      "{\"id\": \"d0\", \"prompt\": [1, 5, 9, 7], \"question_start\": 2, \"answer\": [3, 4], "
      "\"task\": \"passkey\"}\n"
      "\n"
      "  {\"prompt\": [0, 2], \"question_start\": 1, \"answer\": [8]}  \n";
  absl::StatusOr<std::vector<TokenDocument>> docs = ParseTokenDocuments(text, "f");
  ASSERT_TRUE(docs.ok()) << docs.status();
  ASSERT_EQ(docs->size(), 2u);
  EXPECT_EQ((*docs)[0].id, "d0");
  EXPECT_THAT((*docs)[0].prompt, ElementsAre(1, 5, 9, 7));
  EXPECT_EQ((*docs)[0].question_start, 2);
  EXPECT_THAT((*docs)[0].answer, ElementsAre(3, 4));
  EXPECT_EQ((*docs)[1].id, "");
  EXPECT_THAT((*docs)[1].answer, ElementsAre(8));
}

TEST(DocumentsFileTest, RefusesMalformedLinesNamingLineAndKey) {
  struct Case {
    std::string line;
    const char* message;
  };
  const std::string ok_prompt = "\"prompt\": [1, 2, 3]";
  const Case cases[] = {
      {"not json", "f:2: not a JSON object (one document per line)"},
      {"[1, 2, 3]", "f:2: not a JSON object"},
      {"{\"question_start\": 1, \"answer\": [1]}", "f:2: \"prompt\" is missing"},
      {"{" + ok_prompt + ", \"question_start\": 1}", "f:2: \"answer\" is missing"},
      {"{" + ok_prompt + ", \"answer\": [1]}", "f:2: \"question_start\" is missing"},
      {"{\"prompt\": \"1 2 3\", \"question_start\": 1, \"answer\": [1]}",
       "\"prompt\" is not a list of token ids"},
      {"{\"prompt\": [1, -2, 3], \"question_start\": 1, \"answer\": [1]}",
       "\"prompt\"[1] = -2 is not a token id"},
      {"{\"prompt\": [1, 2.5, 3], \"question_start\": 1, \"answer\": [1]}",
       "\"prompt\"[1] = 2.5 is not a token id"},
      {"{\"prompt\": [1, 4294967296], \"question_start\": 1, \"answer\": [1]}",
       "\"prompt\"[1] = 4294967296 is not a token id"},
      {"{" + ok_prompt + ", \"question_start\": 1, \"answer\": [\"7\"]}",
       "\"answer\"[0] = \"7\" is not a token id"},
      {"{" + ok_prompt + ", \"question_start\": 0, \"answer\": [1]}",
       "\"question_start\" = 0 must be in [1, len(prompt) - 1 = 2]"},
      {"{" + ok_prompt + ", \"question_start\": 3, \"answer\": [1]}",
       "\"question_start\" = 3 must be in [1, len(prompt) - 1 = 2]"},
      {"{\"prompt\": [1], \"question_start\": 1, \"answer\": [1]}", "len(prompt) - 1 = 0"},
      {"{" + ok_prompt + ", \"question_start\": \"1\", \"answer\": [1]}",
       "\"question_start\" = \"1\" is not an integer"},
      {"{" + ok_prompt + ", \"question_start\": 1, \"answer\": []}",
       "\"answer\" has 0 tokens, must have 1..64"},
      {"{" + ok_prompt + ", \"question_start\": 1, \"answer\": [" + std::string(64, '1') + "]}",
       "is not a token id"},
      {"{\"id\": 5, " + ok_prompt + ", \"question_start\": 1, \"answer\": [1]}",
       "\"id\" is not a string"},
  };
  const std::string good = "{" + ok_prompt + ", \"question_start\": 1, \"answer\": [1]}\n";
  for (const Case& c : cases) {
    absl::Status s = ParseTokenDocuments(good + c.line + "\n", "f").status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.line;
    EXPECT_THAT(s.message(), HasSubstr(c.message)) << c.line;
  }
  std::string long_answer = "{" + ok_prompt + ", \"question_start\": 1, \"answer\": [1";
  for (int i = 0; i < 64; ++i) long_answer += ", 1";
  EXPECT_THAT(ParseTokenDocuments(long_answer + "]}", "f").status().message(),
              HasSubstr("\"answer\" has 65 tokens, must have 1..64"));
  EXPECT_THAT(ParseTokenDocuments("\n \n", "f").status().message(), HasSubstr("f: no documents"));
  EXPECT_EQ(ReadTokenDocuments("/nonexistent/docs.jsonl").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvc::fidelity

// Pre-tokenized retrieval documents for kvcpasskey --documents_file: JSON Lines, one document per
// line (blank lines skipped), written by a Python generator that owns the tokenizer:
//
//   {"id": "passkey-1k-0", "prompt": [1, 504, 3575, ...], "question_start": 812,
//    "answer": [33, 34, 35, 36, 37]}
//
//   prompt          token ids of context + question, exactly as the model reads them (nothing is
//                   prepended: a BOS token, if wanted, is the first id); at least 2 ids
//   question_start  index of the question's first token: prompt[0, question_start) is the context
//                   the "after" scenario compresses; in [1, len(prompt) - 1]
//   answer          the token ids the model should generate greedily after the prompt, 1..64
//   id              optional string, echoed in reports
// Other keys are ignored (a generator may record task, depth, key, ...). Token ids are checked
// against the model's vocabulary when the documents are evaluated (PasskeyEval::CreateFromTokens).
// Thread-safe (no shared state).
#ifndef KVC_FIDELITY_DOCUMENTS_FILE_H_
#define KVC_FIDELITY_DOCUMENTS_FILE_H_

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kvc/fidelity/passkey.h"

namespace kvc::fidelity {

// Most documents one file may hold.
inline constexpr int kMaxDocumentsPerFile = 1000000;

// Parses the text of a documents file. INVALID_ARGUMENT "<where>:<line>: ..." naming the key and
// the problem: a line that is not a JSON object, a missing key, a key of the wrong type (ids must
// be integers in [0, 2^31)), question_start or answer length out of range, no document at all,
// more than kMaxDocumentsPerFile.
absl::StatusOr<std::vector<TokenDocument>> ParseTokenDocuments(std::string_view text,
                                                               const std::string& where);

// Reads and parses a file (NOT_FOUND when it cannot be opened; the parse errors above).
absl::StatusOr<std::vector<TokenDocument>> ReadTokenDocuments(const std::string& path);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_DOCUMENTS_FILE_H_

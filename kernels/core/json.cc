#include "core/json.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace kvc::json {
namespace {

// A SAX handler that builds the document like nlohmann's own DOM builder, but stops at the first
// duplicate key or over-deep container (returning false from an event ends parsing), and appends
// object members directly: ordered_json's own insertion searches the object linearly, which a
// header with millions of keys would turn into quadratic time. Never throws.
class StrictBuilder {
 public:
  bool null() { return Put(Value(nullptr)); }
  bool boolean(bool b) { return Put(Value(b)); }
  bool number_integer(Value::number_integer_t v) { return Put(Value(v)); }
  bool number_unsigned(Value::number_unsigned_t v) { return Put(Value(v)); }
  bool number_float(Value::number_float_t v, const Value::string_t&) { return Put(Value(v)); }
  bool string(Value::string_t& s) { return Put(Value(std::move(s))); }
  bool binary(Value::binary_t&) { return Fail("binary values are not JSON"); }

  bool start_object(std::size_t) { return Open(Value::object()); }
  bool start_array(std::size_t) { return Open(Value::array()); }
  bool end_object() { return Close(); }
  bool end_array() { return Close(); }

  bool key(Value::string_t& k) {
    if (!open_.back().keys.insert(k).second) {
      return Fail(absl::StrCat("duplicate key ", Quote(k)));
    }
    key_ = std::move(k);
    return true;
  }

  bool parse_error(std::size_t position, const std::string&, const Value::exception& ex) {
    // ex.what() is "[json.exception.parse_error.101] parse error at line 1, column 5: ...".
    absl::string_view what = ex.what();
    if (const size_t cut = what.find("] "); what.front() == '[' && cut != what.npos) {
      what.remove_prefix(cut + 2);
    }
    return Fail(absl::StrCat(what, " (byte ", position, ")"));
  }

  // Non-empty after a failed parse.
  const std::string& error() const { return error_; }
  Value& root() { return root_; }

 private:
  struct Container {
    Value* value;
    std::unordered_set<std::string> keys;  // objects only
  };

  bool Fail(std::string what) {
    if (error_.empty()) error_ = std::move(what);  // the first reason is the real one
    return false;
  }

  // Stores `v` where the parser is (root, next array element or the member named by key_).
  Value* Place(Value v) {
    if (open_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Value& parent = *open_.back().value;
    if (parent.is_array()) {
      auto& array = parent.get_ref<Value::array_t&>();
      array.push_back(std::move(v));
      return &array.back();
    }
    // ordered_map is a vector of pairs; emplace_back skips its linear search (key() already
    // rejected duplicates).
    auto& object = parent.get_ref<Value::object_t&>();
    object.emplace_back(std::move(key_), std::move(v));
    return &object.back().second;
  }

  bool Put(Value v) {
    Place(std::move(v));
    return true;
  }

  // Containers hold pointers into their parents; only the innermost open container changes, so
  // the pointers stay valid until their container is closed.
  bool Open(Value v) {
    if (open_.size() >= static_cast<size_t>(kMaxDepth)) {
      return Fail(absl::StrCat("nesting deeper than ", kMaxDepth));
    }
    Value* placed = Place(std::move(v));
    open_.push_back({placed, {}});
    return true;
  }

  bool Close() {
    open_.pop_back();
    return true;
  }

  Value root_;
  std::vector<Container> open_;
  std::string key_;
  std::string error_;
};

}  // namespace

absl::StatusOr<Value> Parse(absl::string_view text) {
  StrictBuilder builder;
  // strict: the whole input must be one value (trailing whitespace allowed); no comments.
  const bool ok = Value::sax_parse(text.begin(), text.end(), &builder, Value::input_format_t::json,
                                   /*strict=*/true, /*ignore_comments=*/false);
  if (!ok || !builder.error().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("json: ", builder.error().empty() ? "invalid JSON" : builder.error()));
  }
  return std::move(builder.root());
}

bool IsValidUtf8(absl::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned char c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int extra;
    uint32_t min, cp;
    if ((c & 0xE0) == 0xC0) {
      extra = 1, min = 0x80, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      extra = 2, min = 0x800, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      extra = 3, min = 0x10000, cp = c & 0x07;
    } else {
      return false;
    }
    if (end - p <= extra) return false;
    for (int i = 1; i <= extra; ++i) {
      if ((p[i] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[i] & 0x3F);
    }
    // Overlong forms, UTF-16 surrogates and code points beyond Unicode are not UTF-8.
    if (cp < min || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) return false;
    p += extra + 1;
  }
  return true;
}

std::string Quote(absl::string_view s) {
  return Value(std::string(s))
      .dump(-1, ' ', /*ensure_ascii=*/false, Value::error_handler_t::replace);
}

}  // namespace kvc::json

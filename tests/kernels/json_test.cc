// The strict JSON reader is internal to kernels/ (kernels/core/json.h, on nlohmann-json); what it
// adds to the library (duplicate keys, depth limit, document order, no exceptions) is tested here.
#include "../kernels/core/json.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc::json {
namespace {

using ::testing::HasSubstr;

std::string ParseError(const std::string& text) {
  absl::StatusOr<Value> v = Parse(text);
  EXPECT_FALSE(v.ok()) << text;
  if (v.ok()) return "";
  EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(v.status().message());
}

TEST(JsonTest, ParsesNestedDocument) {
  absl::StatusOr<Value> v = Parse(
      " {\"a\": [1, -2, 9223372036854775807, 1.5e3, -0.25], \"b\": {\"c\": \"x\", \"d\": true,"
      " \"e\": false, \"f\": null}, \"g\": []}\n ");
  ASSERT_TRUE(v.ok()) << v.status();
  ASSERT_TRUE(v->is_object());
  ASSERT_EQ(v->size(), 3u);
  EXPECT_EQ(v->begin().key(), "a");  // document order
  const Value& a = (*v)["a"];
  ASSERT_EQ(a.size(), 5u);
  EXPECT_EQ(a[0].get<int64_t>(), 1);
  EXPECT_TRUE(a[1].is_number_integer());
  EXPECT_EQ(a[1].get<int64_t>(), -2);
  EXPECT_EQ(a[2].get<int64_t>(), INT64_MAX);
  EXPECT_TRUE(a[3].is_number_float());
  EXPECT_EQ(a[3].get<double>(), 1500.0);
  EXPECT_EQ(a[4].get<double>(), -0.25);
  const Value& b = (*v)["b"];
  EXPECT_EQ(b["c"].get<std::string>(), "x");
  EXPECT_TRUE(b["d"].get<bool>());
  EXPECT_TRUE(b["e"].is_boolean());
  EXPECT_FALSE(b["e"].get<bool>());
  EXPECT_TRUE(b["f"].is_null());
  EXPECT_EQ(b.find("zz"), b.end());
  EXPECT_TRUE((*v)["g"].is_array());
  EXPECT_TRUE((*v)["g"].empty());
}

TEST(JsonTest, KeepsDocumentOrder) {
  absl::StatusOr<Value> v = Parse(R"({"z":1,"a":2,"m":{"y":3,"b":4}})");
  ASSERT_TRUE(v.ok()) << v.status();
  std::string keys;
  for (const auto& [k, x] : v->items()) keys += k;
  for (const auto& [k, x] : (*v)["m"].items()) keys += k;
  EXPECT_EQ(keys, "zamyb");
}

TEST(JsonTest, StringEscapes) {
  absl::StatusOr<Value> v = Parse(R"("q\" b\\ s\/ \b\f\n\r\t \u00e9 \u20ac \ud83d\ude00")");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->get<std::string>(), "q\" b\\ s/ \b\f\n\r\t \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
}

TEST(JsonTest, IntegerBeyondUint64IsADouble) {
  absl::StatusOr<Value> v = Parse("99999999999999999999");
  ASSERT_TRUE(v.ok());
  EXPECT_TRUE(v->is_number_float());
  EXPECT_EQ(v->get<double>(), 1e20);
}

TEST(JsonTest, RejectsMalformed) {
  for (const char* text : {"",
                           "{\"a\":1,}",
                           "[1,]",
                           "[1 2]",
                           "{\"a\" 1}",
                           "01",
                           "1.",
                           "1e",
                           "-",
                           "\"abc",
                           "\"a\nb\"",
                           "\"\\x\"",
                           "\"\\u12zz\"",
                           "\"\\u12",
                           "\"\\ud800\"",
                           "\"\\udc00\"",
                           "tru",
                           "{\"a\":1",
                           "\"\xff\"",
                           "\"\xc0\x80\"",
                           "[1] // comment",
                           "NaN"}) {
    EXPECT_THAT(ParseError(text), HasSubstr("json: ")) << text;
  }
  // The library's message names the place.
  EXPECT_THAT(ParseError("[1 2]"), HasSubstr("(byte "));
  EXPECT_THAT(ParseError("{} x"), HasSubstr("expected end of input"));
}

TEST(JsonTest, RejectsDuplicateKeys) {
  EXPECT_THAT(ParseError("{\"a\":1,\"a\":2}"), HasSubstr("duplicate key \"a\""));
  EXPECT_THAT(ParseError("[{\"x\":{\"a\":1,\"b\":{},\"a\":[]}}]"),
              HasSubstr("duplicate key \"a\""));
  // The same key in different objects is fine.
  EXPECT_TRUE(Parse("{\"a\":{\"a\":1},\"b\":{\"a\":2}}").ok());
}

TEST(JsonTest, DepthLimit) {
  const std::string ok = std::string(kMaxDepth, '[') + std::string(kMaxDepth, ']');
  EXPECT_TRUE(Parse(ok).ok());
  const std::string deep = std::string(kMaxDepth + 1, '[') + std::string(kMaxDepth + 1, ']');
  EXPECT_THAT(ParseError(deep), HasSubstr("nesting deeper than"));
  // Far deeper input is rejected the same way, without exhausting the stack.
  EXPECT_THAT(ParseError(std::string(1 << 20, '[')), HasSubstr("nesting deeper than"));
}

TEST(JsonTest, ManyKeysTakeLinearTime) {
  // 200k members: quadratic insertion would take minutes, the builder takes milliseconds.
  std::string text = "{";
  for (int i = 0; i < 200000; ++i) text += (i ? ",\"k" : "\"k") + std::to_string(i) + "\":0";
  text += "}";
  absl::StatusOr<Value> v = Parse(text);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->size(), 200000u);
}

TEST(JsonTest, Utf8Validation) {
  EXPECT_TRUE(IsValidUtf8("plain \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"));
  EXPECT_FALSE(IsValidUtf8("\xff"));
  EXPECT_FALSE(IsValidUtf8("\xc3"));              // truncated
  EXPECT_FALSE(IsValidUtf8("\xc0\x80"));          // overlong
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));      // surrogate
  EXPECT_FALSE(IsValidUtf8("\xf4\x90\x80\x80"));  // beyond U+10FFFF
}

TEST(JsonTest, QuoteRoundTrips) {
  const std::string s = std::string("a\"b\\c\n\x01\x1f end \xc3\xa9", 16);
  EXPECT_EQ(Quote("x\"y"), "\"x\\\"y\"");
  EXPECT_EQ(Quote(std::string("\x01", 1)), "\"\\u0001\"");
  absl::StatusOr<Value> v = Parse(Quote(s));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->get<std::string>(), s);
  // Invalid UTF-8 cannot be written as JSON: it is replaced rather than thrown about.
  EXPECT_EQ(Quote("a\xff"), "\"a\xef\xbf\xbd\"");
}

}  // namespace
}  // namespace kvc::json

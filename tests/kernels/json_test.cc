// The JSON reader is internal to kernels/ (kernels/cpu/json.h); it is tested directly here.
#include "../kernels/cpu/json.h"

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
  ASSERT_EQ(v->kind, Value::Kind::kObject);
  ASSERT_EQ(v->object.size(), 3u);
  EXPECT_EQ(v->object[0].first, "a");  // document order
  const Value* a = v->Find("a");
  ASSERT_NE(a, nullptr);
  ASSERT_EQ(a->array.size(), 5u);
  EXPECT_EQ(a->array[0].integer, 1);
  EXPECT_EQ(a->array[1].integer, -2);
  EXPECT_EQ(a->array[2].integer, INT64_MAX);
  EXPECT_EQ(a->array[3].kind, Value::Kind::kDouble);
  EXPECT_EQ(a->array[3].number, 1500.0);
  EXPECT_EQ(a->array[4].number, -0.25);
  const Value* b = v->Find("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->Find("c")->string, "x");
  EXPECT_TRUE(b->Find("d")->boolean);
  EXPECT_EQ(b->Find("e")->kind, Value::Kind::kBool);
  EXPECT_FALSE(b->Find("e")->boolean);
  EXPECT_EQ(b->Find("f")->kind, Value::Kind::kNull);
  EXPECT_EQ(b->Find("zz"), nullptr);
  EXPECT_EQ(v->Find("g")->kind, Value::Kind::kArray);
  EXPECT_TRUE(v->Find("g")->array.empty());
}

TEST(JsonTest, StringEscapes) {
  absl::StatusOr<Value> v = Parse(R"("q\" b\\ s\/ \b\f\n\r\t \u00e9 \u20ac \ud83d\ude00")");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->string, "q\" b\\ s/ \b\f\n\r\t \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80");
}

TEST(JsonTest, IntegerBeyondInt64IsADouble) {
  absl::StatusOr<Value> v = Parse("99999999999999999999");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->kind, Value::Kind::kDouble);
  EXPECT_EQ(v->number, 1e20);
}

TEST(JsonTest, RejectsMalformed) {
  EXPECT_THAT(ParseError(""), HasSubstr("unexpected end"));
  EXPECT_THAT(ParseError("{\"a\":1,}"), HasSubstr("expected a string key"));
  EXPECT_THAT(ParseError("[1,]"), HasSubstr("unexpected character"));
  EXPECT_THAT(ParseError("[1 2]"), HasSubstr("expected ',' or ']'"));
  EXPECT_THAT(ParseError("{\"a\" 1}"), HasSubstr("expected ':'"));
  EXPECT_THAT(ParseError("01"), HasSubstr("leading zero"));
  EXPECT_THAT(ParseError("1."), HasSubstr("after '.'"));
  EXPECT_THAT(ParseError("1e"), HasSubstr("exponent"));
  EXPECT_THAT(ParseError("-"), HasSubstr("expected digits"));
  EXPECT_THAT(ParseError("\"abc"), HasSubstr("unterminated string"));
  EXPECT_THAT(ParseError("\"a\nb\""), HasSubstr("control character"));
  EXPECT_THAT(ParseError("\"\\x\""), HasSubstr("bad escape"));
  EXPECT_THAT(ParseError("\"\\u12zz\""), HasSubstr("hex digit"));
  EXPECT_THAT(ParseError("\"\\u12"), HasSubstr("truncated"));
  EXPECT_THAT(ParseError("\"\\ud800\""), HasSubstr("unpaired surrogate"));
  EXPECT_THAT(ParseError("\"\\udc00\""), HasSubstr("unpaired surrogate"));
  EXPECT_THAT(ParseError("{\"a\":1,\"a\":2}"), HasSubstr("duplicate key \"a\""));
  EXPECT_THAT(ParseError("{} x"), HasSubstr("after the JSON value"));
  EXPECT_THAT(ParseError("tru"), HasSubstr("unexpected character"));
  EXPECT_THAT(ParseError("{\"a\":1"), HasSubstr("expected ',' or '}'"));
}

TEST(JsonTest, DepthLimit) {
  const std::string ok = std::string(kMaxDepth, '[') + std::string(kMaxDepth, ']');
  EXPECT_TRUE(Parse(ok).ok());
  const std::string deep = std::string(kMaxDepth + 2, '[') + std::string(kMaxDepth + 2, ']');
  EXPECT_THAT(ParseError(deep), HasSubstr("nesting deeper than"));
  // Far deeper input is rejected the same way, without exhausting the stack.
  EXPECT_THAT(ParseError(std::string(1 << 20, '[')), HasSubstr("nesting deeper than"));
}

TEST(JsonTest, QuoteRoundTrips) {
  const std::string s = std::string("a\"b\\c\n\x01\x1f end \xc3\xa9", 16);
  EXPECT_EQ(Quote("x\"y"), "\"x\\\"y\"");
  EXPECT_EQ(Quote(std::string("\x01", 1)), "\"\\u0001\"");
  absl::StatusOr<Value> v = Parse(Quote(s));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->string, s);
}

}  // namespace
}  // namespace kvc::json

#include "metrics/http_request.h"

#include <string>

#include "gtest/gtest.h"

namespace kvc {
namespace {

TEST(HttpRequestTest, FindsTheEndOfTheHead) {
  EXPECT_EQ(HttpHeadLength("GET / HTTP/1.1\r\n"), std::string::npos);
  EXPECT_EQ(HttpHeadLength("GET / HTTP/1.1\r\n\r\n"), 18u);
  EXPECT_EQ(HttpHeadLength("GET / HTTP/1.1\n\nbody"), 16u);
  EXPECT_EQ(HttpHeadLength("GET / HTTP/1.1\r\nA: b\r\n\r"), std::string::npos);
  EXPECT_EQ(HttpHeadLength(""), std::string::npos);
}

TEST(HttpRequestTest, ParsesAScrape) {
  auto r = ParseHttpRequest(
      "GET /metrics?x=1 HTTP/1.1\r\nHost: 127.0.0.1:9464\r\nAccept: text/plain;q=0.9\r\n"
      "User-Agent: Prometheus/2.45.0\r\n\r\n");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->method, "GET");
  EXPECT_EQ(r->path, "/metrics");
  EXPECT_EQ(r->minor_version, 1);
  auto old = ParseHttpRequest("\r\nHEAD / HTTP/1.0\n\n");  // a leading empty line is ignored
  ASSERT_TRUE(old.ok()) << old.status();
  EXPECT_EQ(old->method, "HEAD");
  EXPECT_EQ(old->minor_version, 0);
}

TEST(HttpRequestTest, RejectsMalformedHeads) {
  const char* bad[] = {
      "GET /metrics HTTP/1.1\r\n",                    // no empty line
      "\r\n\r\n",                                     // no request line
      "GET /metrics\r\n\r\n",                         // no version
      "GET  /metrics HTTP/1.1\r\n\r\n",               // two spaces
      "GET /metrics HTTP/1.1 x\r\n\r\n",              // three parts
      "G(T /metrics HTTP/1.1\r\n\r\n",                // method not a token
      "GET metrics HTTP/1.1\r\n\r\n",                 // not origin-form
      "GET http://x/metrics HTTP/1.1\r\n\r\n",        // absolute-form
      "GET /me\x01trics HTTP/1.1\r\n\r\n",            // control in the target
      "GET /m\xc3\xa9trics HTTP/1.1\r\n\r\n",         // non-ASCII in the target
      "GET /metrics HTTP/2.0\r\n\r\n",                // version
      "GET /metrics HTTP/1.1\r\nHost 1\r\n\r\n",      // no colon
      "GET /metrics HTTP/1.1\r\nHo st: 1\r\n\r\n",    // name not a token
      "GET /metrics HTTP/1.1\r\n: 1\r\n\r\n",         // empty name
      "GET /metrics HTTP/1.1\r\nA: b\x7f\r\n\r\n",    // control in a value
      "GET /metrics HTTP/1.1\r\nA: b\r\n c\r\n\r\n",  // obs-fold
  };
  for (const char* head : bad) {
    auto r = ParseHttpRequest(head);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << head;
  }
  std::string nul("GET /metrics HTTP/1.1\r\nA: \0\r\n\r\n", 31);
  EXPECT_FALSE(ParseHttpRequest(nul).ok());
}

TEST(HttpRequestTest, RejectsAnOversizedHead) {
  std::string head = "GET /metrics HTTP/1.1\r\nX: " + std::string(kMaxHttpRequestHeadBytes, 'a');
  head += "\r\n\r\n";
  auto r = ParseHttpRequest(head);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("over"), std::string::npos);
}

}  // namespace
}  // namespace kvc

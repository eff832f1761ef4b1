#include "kvc/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;
using Labels = std::map<std::string, std::string>;

std::unique_ptr<Metrics> MakeMetrics() {
  Metrics::Options o;
  o.listen_address = "";
  auto m = Metrics::Create(o);
  EXPECT_TRUE(m.ok()) << m.status();
  return std::move(m).value();
}

// Parses one sample line `name{k="v",...} value` of the text format.
bool ParseSample(const std::string& line, std::string* name, Labels* labels, double* value) {
  if (line.empty() || line[0] == '#') return false;
  const size_t space = line.rfind(' ');
  if (space == std::string::npos) return false;
  std::string head = line.substr(0, space);
  if (!absl::SimpleAtod(line.substr(space + 1), value)) return false;
  labels->clear();
  const size_t brace = head.find('{');
  if (brace == std::string::npos) {
    *name = head;
    return true;
  }
  *name = head.substr(0, brace);
  std::string body = head.substr(brace + 1, head.size() - brace - 2);
  // Label values in these tests never contain commas, quotes or escapes.
  for (absl::string_view pair : absl::StrSplit(body, ',', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(pair, absl::MaxSplits('=', 1));
    if (kv.size() != 2 || kv[1].size() < 2) return false;
    (*labels)[kv[0]] = kv[1].substr(1, kv[1].size() - 2);
  }
  return true;
}

// The value of the sample `name` with exactly `labels`, or NaN-free -1 when absent.
double Sample(const std::string& text, const std::string& name, const Labels& labels = {}) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::string n;
    Labels l;
    double v;
    if (ParseSample(std::string(line), &n, &l, &v) && n == name && l == labels) return v;
  }
  return -1;
}

std::string TypeOf(const std::string& text, const std::string& family) {
  const std::string prefix = absl::StrCat("# TYPE ", family, " ");
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, prefix)) return std::string(line);
  }
  return "";
}

bool HasHelp(const std::string& text, const std::string& family) {
  const std::string prefix = absl::StrCat("# HELP ", family, " ");
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (absl::ConsumePrefix(&line, prefix) && !line.empty()) return true;
  }
  return false;
}

TEST(MetricsTest, EveryFamilyExistsWithItsTypeAndHelp) {
  auto m = MakeMetrics();
  const std::string text = m->Scrape();
  const std::map<std::string, std::string> families = {
      {"grpc_server_started_total", "counter"},
      {"grpc_server_handled_total", "counter"},
      {"grpc_server_handling_seconds", "histogram"},
      {"kvc_ingest_bytes_total", "counter"},
      {"kvc_served_bytes_total", "counter"},
      {"kvc_compress_duration_seconds", "histogram"},
      {"kvc_compression_ratio", "histogram"},
      {"kvc_store_used_bytes", "gauge"},
      {"kvc_store_capacity_bytes", "gauge"},
      {"kvc_store_entries", "gauge"},
      {"kvc_evictions_total", "counter"},
      {"kvc_rejected_requests_total", "counter"},
      {"kvc_gpu_memory_used_bytes", "gauge"},
      {"kvc_buffer_pool_idle_bytes", "gauge"},
      {"kvc_buffer_pool_capacity_bytes", "gauge"},
      {"kvc_buffer_pool_requests_total", "counter"},
      {"kvc_build_info", "gauge"},
      {"kvc_active_streams", "gauge"},
      {"kvc_compressions_running", "gauge"},
      {"kvc_staging_reserved_bytes", "gauge"},
      {"kvc_staging_capacity_bytes", "gauge"},
  };
  for (const auto& [name, type] : families) {
    EXPECT_EQ(TypeOf(text, name), type) << name;
    EXPECT_TRUE(HasHelp(text, name)) << name;
  }
}

TEST(MetricsTest, KnownSeriesExistFromStartAtZero) {
  auto m = MakeMetrics();
  const std::string text = m->Scrape();
  for (const char* method :
       {"PutCache", "GetCache", "StatCache", "DeleteCache", "ListCaches", "GetServerInfo"}) {
    EXPECT_EQ(Sample(text, "grpc_server_started_total", {{"grpc_method", method}}), 0) << method;
    for (const char* code : {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "UNAUTHENTICATED"}) {
      EXPECT_EQ(
          Sample(text, "grpc_server_handled_total", {{"grpc_method", method}, {"grpc_code", code}}),
          0)
          << method << " " << code;
    }
    EXPECT_EQ(Sample(text, "grpc_server_handling_seconds_count", {{"grpc_method", method}}), 0);
  }
  for (const char* stage : {"score", "select", "pack", "quantize", "total"}) {
    EXPECT_EQ(Sample(text, "kvc_compress_duration_seconds_count", {{"stage", stage}}), 0) << stage;
  }
  for (const char* reason : {"capacity", "ttl", "overwrite", "deleted"}) {
    EXPECT_EQ(Sample(text, "kvc_evictions_total", {{"reason", reason}}), 0) << reason;
  }
  for (const char* reason :
       {"invalid_argument", "too_large", "budget", "limit", "draining", "unauthenticated",
        "permission_denied", "stream_idle", "peer_streams", "staging", "work"}) {
    EXPECT_EQ(Sample(text, "kvc_rejected_requests_total", {{"reason", reason}}), 0) << reason;
  }
  EXPECT_EQ(Sample(text, "kvc_ingest_bytes_total"), 0);
  EXPECT_EQ(Sample(text, "kvc_active_streams"), 0);
  EXPECT_EQ(Sample(text, "kvc_compressions_running"), 0);
  EXPECT_EQ(Sample(text, "kvc_staging_reserved_bytes"), 0);
  // Histogram buckets: 100us first, 60s last, then +Inf.
  EXPECT_EQ(Sample(text, "grpc_server_handling_seconds_bucket",
                   {{"grpc_method", "PutCache"}, {"le", "0.0001"}}),
            0);
  EXPECT_EQ(Sample(text, "grpc_server_handling_seconds_bucket",
                   {{"grpc_method", "PutCache"}, {"le", "60"}}),
            0);
  EXPECT_EQ(Sample(text, "kvc_compression_ratio_bucket", {{"le", "64"}}), 0);
}

TEST(MetricsTest, RecordingMovesTheRightSeries) {
  auto m = MakeMetrics();
  m->RecordRpcStarted("PutCache");
  m->RecordRpc("PutCache", absl::StatusCode::kOk, 0.003);
  m->RecordRpc("PutCache", grpc::StatusCode::INVALID_ARGUMENT, 0.0002);
  m->RecordRpc("Check", absl::StatusCode::kOk, 0.5);  // a method outside the known list
  m->RecordRpc("PutCache", static_cast<absl::StatusCode>(99), 1);  // unknown code -> UNKNOWN
  m->AddIngestBytes(1000);
  m->AddIngestBytes(24);
  m->AddServedBytes(7);
  CompressTimings t;
  t.score = 0.002;
  t.total = 0.004;
  m->ObserveCompressTimings(t);
  m->ObserveCompress(CompressStage::kPack, 0.5);
  m->ObserveCompressionRatio(5);
  m->SetStoreStats({.used_bytes = 10, .capacity_bytes = 100, .entries = 2, .leased_bytes = 0});
  m->RecordEviction(EvictionReason::kTtl);
  m->RecordEviction(EvictionReason::kTtl);
  m->RecordRejection(RejectionReason::kDraining);
  m->SetGpuMemoryUsed(1 << 20);
  m->SetBufferPoolStats(4 << 20, 512 << 20, 3, 2);
  m->SetBufferPoolStats(6 << 20, 512 << 20, 5, 2);  // running totals: counters add the growth
  m->StreamStarted();
  m->StreamStarted();
  m->StreamFinished();
  m->SetBuildInfo("0.1.0", "cpu");
  m->SetBuildInfo("0.1.0", "cuda");  // replaces, never two series

  const std::string s = m->Scrape();
  EXPECT_EQ(Sample(s, "grpc_server_started_total", {{"grpc_method", "PutCache"}}), 1);
  EXPECT_EQ(
      Sample(s, "grpc_server_handled_total", {{"grpc_method", "PutCache"}, {"grpc_code", "OK"}}),
      1);
  EXPECT_EQ(Sample(s, "grpc_server_handled_total",
                   {{"grpc_method", "PutCache"}, {"grpc_code", "INVALID_ARGUMENT"}}),
            1);
  EXPECT_EQ(Sample(s, "grpc_server_handled_total",
                   {{"grpc_method", "PutCache"}, {"grpc_code", "UNKNOWN"}}),
            1);
  EXPECT_EQ(Sample(s, "grpc_server_handled_total", {{"grpc_method", "Check"}, {"grpc_code", "OK"}}),
            1);
  EXPECT_EQ(Sample(s, "grpc_server_handling_seconds_count", {{"grpc_method", "PutCache"}}), 3);
  EXPECT_NEAR(Sample(s, "grpc_server_handling_seconds_sum", {{"grpc_method", "PutCache"}}), 1.0032,
              1e-9);
  EXPECT_EQ(Sample(s, "grpc_server_handling_seconds_bucket",
                   {{"grpc_method", "PutCache"}, {"le", "0.00025"}}),
            1);
  EXPECT_EQ(Sample(s, "grpc_server_handling_seconds_bucket",
                   {{"grpc_method", "PutCache"}, {"le", "0.005"}}),
            2);
  EXPECT_EQ(Sample(s, "kvc_ingest_bytes_total"), 1024);
  EXPECT_EQ(Sample(s, "kvc_served_bytes_total"), 7);
  EXPECT_EQ(Sample(s, "kvc_compress_duration_seconds_count", {{"stage", "score"}}), 1);
  EXPECT_EQ(Sample(s, "kvc_compress_duration_seconds_count", {{"stage", "pack"}}), 2);
  EXPECT_NEAR(Sample(s, "kvc_compress_duration_seconds_sum", {{"stage", "total"}}), 0.004, 1e-12);
  EXPECT_EQ(Sample(s, "kvc_compression_ratio_bucket", {{"le", "4"}}), 0);
  EXPECT_EQ(Sample(s, "kvc_compression_ratio_bucket", {{"le", "6"}}), 1);
  EXPECT_EQ(Sample(s, "kvc_store_used_bytes"), 10);
  EXPECT_EQ(Sample(s, "kvc_store_capacity_bytes"), 100);
  EXPECT_EQ(Sample(s, "kvc_store_entries"), 2);
  EXPECT_EQ(Sample(s, "kvc_evictions_total", {{"reason", "ttl"}}), 2);
  EXPECT_EQ(Sample(s, "kvc_evictions_total", {{"reason", "capacity"}}), 0);
  EXPECT_EQ(Sample(s, "kvc_rejected_requests_total", {{"reason", "draining"}}), 1);
  EXPECT_EQ(Sample(s, "kvc_gpu_memory_used_bytes"), 1 << 20);
  EXPECT_EQ(Sample(s, "kvc_active_streams"), 1);
  EXPECT_EQ(Sample(s, "kvc_buffer_pool_idle_bytes"), 6 << 20);
  EXPECT_EQ(Sample(s, "kvc_buffer_pool_capacity_bytes"), 512 << 20);
  EXPECT_EQ(Sample(s, "kvc_buffer_pool_requests_total", {{"result", "reused"}}), 5);
  EXPECT_EQ(Sample(s, "kvc_buffer_pool_requests_total", {{"result", "mapped"}}), 2);
  EXPECT_EQ(Sample(s, "kvc_build_info", {{"version", "0.1.0"}, {"backend", "cuda"}}), 1);
  EXPECT_EQ(Sample(s, "kvc_build_info", {{"version", "0.1.0"}, {"backend", "cpu"}}), -1);
}

TEST(MetricsTest, ConcurrentRecordingLosesNothing) {
  auto m = MakeMetrics();
  constexpr int kThreads = 4, kPerThread = 2000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kPerThread; ++i) {
        // New method names are created concurrently with lookups of existing ones.
        m->RecordRpc(absl::StrCat("M", i % 7), absl::StatusCode::kOk, 0.001);
        m->RecordRpc("GetCache", absl::StatusCode::kNotFound, 0.001);
        m->AddServedBytes(1);
        if (i % 500 == 0) (void)m->Scrape();
      }
    });
  }
  for (auto& th : threads) th.join();
  const std::string s = m->Scrape();
  EXPECT_EQ(Sample(s, "kvc_served_bytes_total"), kThreads * kPerThread);
  EXPECT_EQ(Sample(s, "grpc_server_handled_total",
                   {{"grpc_method", "GetCache"}, {"grpc_code", "NOT_FOUND"}}),
            kThreads * kPerThread);
  double sum = 0;
  for (int i = 0; i < 7; ++i) {
    sum += Sample(s, "grpc_server_handled_total",
                  {{"grpc_method", absl::StrCat("M", i)}, {"grpc_code", "OK"}});
  }
  EXPECT_EQ(sum, kThreads * kPerThread);
}

std::string FindOnPath(const std::string& exe) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':', absl::SkipEmpty())) {
    std::string candidate = absl::StrCat(dir, "/", exe);
    if (access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

TEST(MetricsTest, PromtoolAcceptsTheExposition) {
  const std::string promtool = FindOnPath("promtool");
  if (promtool.empty()) GTEST_SKIP() << "promtool not found on PATH";
  auto m = MakeMetrics();
  m->RecordRpc("PutCache", absl::StatusCode::kOk, 0.01);
  m->ObserveCompressTimings({});
  m->SetBuildInfo("0.1.0", "cpu");
  const std::string file = absl::StrCat(::testing::TempDir(), "/kvc_metrics_", getpid(), ".txt");
  {
    std::ofstream out(file);
    out << m->Scrape();
  }
  const std::string cmd = absl::StrCat(promtool, " check metrics < ", file, " 2>&1");
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  std::string output;
  char buf[512];
  while (size_t n = fread(buf, 1, sizeof(buf), pipe)) output.append(buf, n);
  const int rc = pclose(pipe);
  std::remove(file.c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 0) << output;
  EXPECT_EQ(output, "") << "promtool lint findings";
}

// A listening socket on an ephemeral loopback port; closed on destruction.
struct BusyPort {
  int fd = -1;
  int port = 0;
  BusyPort() {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || listen(fd, 1) != 0) {
      return;
    }
    socklen_t len = sizeof(addr);
    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    port = ntohs(addr.sin_port);
  }
  ~BusyPort() { close(fd); }
};

TEST(MetricsTest, BindFailureIsAnErrorNotACrash) {
  BusyPort busy;
  ASSERT_GT(busy.port, 0);
  Metrics::Options o;
  o.listen_address = absl::StrCat("127.0.0.1:", busy.port);
  auto m = Metrics::Create(o);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(std::string(m.status().message()), HasSubstr("listen_address"));
}

TEST(MetricsTest, InvalidOptionsAreRejected) {
  Metrics::Options o;
  for (const char* bad : {"localhost", ":9464", "127.0.0.1:", "127.0.0.1:http", "1.2.3.4:70000"}) {
    o.listen_address = bad;
    auto m = Metrics::Create(o);
    EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("listen_address")) << bad;
  }
}

// Sends `request` to 127.0.0.1:port with a plain socket; returns the whole response.
std::string HttpRequest(int port, const std::string& req) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  std::string response;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[4096];
      ssize_t n;
      while ((n = read(fd, buf, sizeof(buf))) > 0) response.append(buf, n);
    }
  }
  close(fd);
  return response;
}

TEST(MetricsTest, ExposerServesTheRegistryOverHttp) {
  Metrics::Options o;
  o.listen_address = "127.0.0.1:0";
  auto m = Metrics::Create(o);
  ASSERT_TRUE(m.ok()) << m.status();
  const int port = (*m)->port();
  ASSERT_GT(port, 0);
  (*m)->AddIngestBytes(4242);
  const std::string response =
      HttpRequest(port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: text/plain\r\n\r\n");
  EXPECT_THAT(response, HasSubstr("200 OK"));
  EXPECT_THAT(response, HasSubstr("text/plain; version=0.0.4"));
  EXPECT_THAT(response, HasSubstr("\nkvc_ingest_bytes_total 4242\n"));
  EXPECT_THAT(response, HasSubstr("# TYPE grpc_server_handled_total counter"));
  // Scrapes see live values.
  (*m)->AddIngestBytes(1);
  EXPECT_THAT(HttpRequest(port, "GET /metrics HTTP/1.0\r\n\r\n"),
              HasSubstr("\nkvc_ingest_bytes_total 4243\n"));
  EXPECT_THAT(HttpRequest(port, "GET /other HTTP/1.0\r\n\r\n"), HasSubstr(" 404 "));
  EXPECT_THAT(HttpRequest(port, "POST /metrics HTTP/1.0\r\n\r\n"), HasSubstr(" 405 "));
}

}  // namespace
}  // namespace kvc

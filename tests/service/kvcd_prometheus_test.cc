// kvcd's metrics as a real Prometheus sees them: a `prometheus` server on loopback scrapes kvcd
// every second, and its query API must report exactly the bytes uploaded. `promtool check
// metrics` must accept a real scrape. Skips (with the reason) where the binaries are missing.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using testing::KvcdProcess;

// Full path of `name` on PATH, or "".
std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return "";
  for (absl::string_view dir : absl::StrSplit(path, ':')) {
    const std::string candidate = absl::StrCat(dir, "/", name);
    if (!dir.empty() && access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return "";
}

// A fresh directory, removed with its contents at scope exit.
class TempDir {
 public:
  TempDir() {
    std::string templ = ::testing::TempDir() + "/kvc_prom_XXXXXX";
    if (mkdtemp(templ.data()) != nullptr) path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A child process whose output goes to a file; SIGTERM and reaped on destruction.
class Child {
 public:
  Child(std::vector<std::string> args, const std::string& log) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      FILE* out = std::freopen(log.c_str(), "w", stdout);
      if (out != nullptr) dup2(fileno(stdout), STDERR_FILENO);
      execv(argv[0], argv.data());
      _exit(127);
    }
  }
  ~Child() {
    if (pid_ > 0) {
      kill(pid_, SIGTERM);
      int status;
      waitpid(pid_, &status, 0);
    }
  }
  bool ok() const { return pid_ > 0; }

 private:
  pid_t pid_ = -1;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// The sample value of the first result of an instant query, e.g. from
// {"status":"success","data":{"resultType":"vector","result":[{"metric":{...},"value":[t,"42"]}]}}
absl::StatusOr<double> FirstValue(const std::string& json) {
  const size_t v = json.find("\"value\":[");
  if (v == std::string::npos) return absl::NotFoundError("no sample yet");
  const size_t q1 = json.find('"', json.find(',', v) + 1);
  const size_t q2 = json.find('"', q1 + 1);
  double d;
  if (q1 == std::string::npos || q2 == std::string::npos ||
      !absl::SimpleAtod(json.substr(q1 + 1, q2 - q1 - 1), &d)) {
    return absl::DataLossError(absl::StrCat("unparsable: ", json));
  }
  return d;
}

std::unique_ptr<KvcdProcess> StartKvcd() {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = {"--backend=cpu", "--max_chunk_bytes=64KiB"};
  auto p = KvcdProcess::Start(opts);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

TEST(KvcdPrometheusTest, PromtoolAcceptsARealScrape) {
  const std::string promtool = FindOnPath("promtool");
  if (promtool.empty()) GTEST_SKIP() << "promtool is not installed (Debian package prometheus)";
  auto kvcd = StartKvcd();
  ASSERT_NE(kvcd, nullptr);
  // Traffic first, so histograms and labelled series carry real samples.
  auto stub = testing::NewStub(kvcd->address());
  ASSERT_TRUE(testing::PutCache(stub.get(), testing::MakeTestCache(
                                                "lint/a", testing::Shape(2, 2, 2, 32, 64, 8),
                                                kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 1))
                  .ok());
  auto text = testing::HttpGet(kvcd->metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  TempDir tmp;
  const std::string& dir = tmp.path();
  ASSERT_FALSE(dir.empty());
  const std::string scrape = dir + "/scrape.txt", log = dir + "/promtool.txt";
  std::ofstream(scrape) << *text;
  const int rc =
      std::system(absl::StrCat(promtool, " check metrics < ", scrape, " > ", log, " 2>&1").c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 0) << ReadFile(log);
  EXPECT_NE(text->find("kvc_build_info{"), std::string::npos);
  EXPECT_NE(text->find("grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"PutCache\"} 1"),
            std::string::npos)
      << *text;
}

TEST(KvcdPrometheusTest, MetricsCountRequestsBytesStagesAndRejections) {
  auto kvcd = StartKvcd();
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  auto cache = testing::MakeTestCache("m/a", testing::Shape(3, 2, 4, 32, 128, 16),
                                      kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 2);
  cache.header.mutable_compression()->mutable_eviction()->set_policy("h2o");
  cache.header.mutable_compression()->mutable_eviction()->set_keep_ratio(0.5);
  ASSERT_TRUE(testing::PutCache(stub.get(), cache).ok());
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("m/a");
  testing::Fetched fetched;
  ASSERT_TRUE(testing::Get(stub.get(), get, &fetched).ok());
  uint64_t served = 0;
  for (const auto& [key, bytes] : fetched.parts) served += bytes.size();
  auto bad = cache;
  bad.header.set_cache_id("m/bad");
  bad.header.mutable_shape()->set_head_dim(4);
  EXPECT_EQ(testing::PutCache(stub.get(), bad).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  grpc::ClientContext ctx;
  kvcache::v1::ServerInfo info;
  ASSERT_TRUE(stub->GetServerInfo(&ctx, {}, &info).ok());

  // A stream leaves kvc_active_streams in its reactor's OnDone, which gRPC may run just after the
  // client has seen the final status: scrape until the gauge settles (bounded), then check all.
  absl::Status settled = testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 0);
  ASSERT_TRUE(settled.ok()) << settled;
  absl::StatusOr<std::string> text = testing::HttpGet(kvcd->metrics_address(), "/metrics");
  ASSERT_TRUE(text.ok()) << text.status();
  auto value = [&](const std::string& series) {
    auto v = testing::MetricValue(*text, series);
    EXPECT_TRUE(v.ok()) << v.status();
    return v.ok() ? *v : -1.0;
  };
  EXPECT_EQ(value("kvc_ingest_bytes_total"), double(cache.total_bytes()));
  EXPECT_EQ(value("kvc_served_bytes_total"), double(served));
  EXPECT_EQ(value("grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"PutCache\"}"), 1);
  EXPECT_EQ(value("grpc_server_handled_total{grpc_code=\"INVALID_ARGUMENT\","
                  "grpc_method=\"PutCache\"}"),
            1);
  EXPECT_EQ(value("grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"GetCache\"}"), 1);
  EXPECT_EQ(value("grpc_server_handling_seconds_count{grpc_method=\"GetCache\"}"), 1);
  EXPECT_EQ(value("kvc_rejected_requests_total{reason=\"invalid_argument\"}"), 1);
  EXPECT_EQ(value("kvc_compress_duration_seconds_count{stage=\"total\"}"), 1);
  EXPECT_GT(value("kvc_compress_duration_seconds_sum{stage=\"total\"}"), 0);
  EXPECT_EQ(value("kvc_compression_ratio_count"), 1);
  EXPECT_EQ(value("kvc_store_entries"), 1);
  EXPECT_EQ(value("kvc_store_used_bytes"), double(info.store_used_bytes()));
  EXPECT_EQ(value("kvc_store_capacity_bytes"), double(64 << 20));
  EXPECT_EQ(value("kvc_active_streams"), 0);
}

TEST(KvcdPrometheusTest, PrometheusScrapesTheIngestedBytes) {
  const std::string prometheus = FindOnPath("prometheus");
  if (prometheus.empty()) GTEST_SKIP() << "prometheus is not installed (Debian package prometheus)";
  auto kvcd = StartKvcd();
  ASSERT_NE(kvcd, nullptr);
  auto port = testing::PickFreeLoopbackPort();
  ASSERT_TRUE(port.ok()) << port.status();
  TempDir tmp;  // declared before the Prometheus child, so removed after it stops
  const std::string& dir = tmp.path();
  ASSERT_FALSE(dir.empty());
  std::ofstream(dir + "/prometheus.yml")
      << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
      << "scrape_configs:\n  - job_name: kvcd\n    static_configs:\n"
      << "      - targets: ['" << kvcd->metrics_address() << "']\n";
  const std::string web = absl::StrCat("127.0.0.1:", *port);
  Child prom({prometheus, "--config.file=" + dir + "/prometheus.yml", "--web.listen-address=" + web,
              "--storage.tsdb.path=" + dir + "/data", "--log.level=warn"},
             dir + "/prometheus.log");
  ASSERT_TRUE(prom.ok());

  auto stub = testing::NewStub(kvcd->address());
  const auto cache = testing::MakeTestCache("prom/a", testing::Shape(3, 2, 4, 64, 300, 0),
                                            kvcache::v1::DTYPE_BF16, kvcache::v1::LAYOUT_NHD, 4);
  grpc::Status s = testing::PutCache(stub.get(), cache, nullptr, 64 << 10);
  ASSERT_TRUE(s.ok()) << s.error_message();
  const double uploaded = static_cast<double>(cache.total_bytes());

  // Bounded wait: Prometheus starts, scrapes every second, and answers the query.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  absl::StatusOr<double> value = absl::NotFoundError("no query made");
  while (absl::Now() < deadline) {
    auto body =
        testing::HttpGet(web, "/api/v1/query?query=kvc_ingest_bytes_total", absl::Seconds(2));
    if (body.ok()) {
      value = FirstValue(*body);
      if (value.ok() && *value == uploaded) break;
    } else {
      value = body.status();
    }
    absl::SleepFor(absl::Milliseconds(250));
  }
  ASSERT_TRUE(value.ok()) << value.status() << "\nprometheus log:\n"
                          << ReadFile(dir + "/prometheus.log");
  EXPECT_EQ(*value, uploaded);
}

}  // namespace
}  // namespace kvc

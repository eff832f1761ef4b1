// kvcd with TLS and mutual TLS on its main port: certificates are made at test time with the
// openssl command-line tool (a throwaway CA, a server certificate for 127.0.0.1 and localhost, a
// client certificate, and a second CA that kvcd does not trust). Covers raw gRPC stubs and
// kvc::Client, plaintext and wrong-CA clients, the plaintext health port, and bad flag combos.
#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "kvc/client.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;
using testing::KvcdProcess;

bool HaveOpenssl() { return std::system("openssl version >/dev/null 2>&1") == 0; }

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Runs a shell command in `dir`; false (with the command logged) when it fails.
bool Run(const std::string& dir, const std::string& cmd) {
  const std::string full = absl::StrCat("cd '", dir, "' && ", cmd, " >/dev/null 2>&1");
  if (std::system(full.c_str()) == 0) return true;
  ADD_FAILURE() << "failed: " << cmd;
  return false;
}

// Makes NAME.key/NAME.pem signed by CA (CA.pem, CA.key) with the given extensions file content.
bool MakeLeaf(const std::string& dir, const std::string& name, const std::string& ca,
              const std::string& cn, const std::string& ext) {
  std::ofstream(absl::StrCat(dir, "/", name, ".ext")) << ext << "\n";
  return Run(dir,
             absl::StrCat("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 ",
                          "-nodes -keyout ", name, ".key -out ", name, ".csr -subj /CN=", cn)) &&
         Run(dir, absl::StrCat("openssl x509 -req -in ", name, ".csr -CA ", ca, ".pem -CAkey ", ca,
                               ".key -CAcreateserial -days 2 -out ", name, ".pem -extfile ", name,
                               ".ext"));
}

bool MakeCa(const std::string& dir, const std::string& name) {
  return Run(dir, absl::StrCat("openssl req -x509 -newkey ec -pkeyopt "
                               "ec_paramgen_curve:prime256v1 -nodes -days 2 -keyout ",
                               name, ".key -out ", name, ".pem -subj /CN=", name));
}

class KvcdTlsTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!HaveOpenssl()) return;
    std::string tmpl = ::testing::TempDir() + "kvcd_tls_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = new std::string(tmpl);
    const std::string& d = *dir_;
    ASSERT_TRUE(MakeCa(d, "ca"));
    ASSERT_TRUE(MakeCa(d, "other_ca"));
    ASSERT_TRUE(
        MakeLeaf(d, "server", "ca", "localhost", "subjectAltName=IP:127.0.0.1,DNS:localhost"));
    ASSERT_TRUE(MakeLeaf(d, "client", "ca", "kvc-test-client", "extendedKeyUsage=clientAuth"));
    ASSERT_TRUE(MakeLeaf(d, "stranger", "other_ca", "stranger", "extendedKeyUsage=clientAuth"));
    // The certificate kvcd rotates to in the reload test: same names, the other CA.
    ASSERT_TRUE(MakeLeaf(d, "rotated", "other_ca", "localhost",
                         "subjectAltName=IP:127.0.0.1,DNS:localhost"));
    std::ofstream(d + "/empty.pem").flush();
  }
  static void TearDownTestSuite() {
    if (dir_ != nullptr) std::system(absl::StrCat("rm -rf '", *dir_, "'").c_str());
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override {
    if (!HaveOpenssl()) GTEST_SKIP() << "the openssl command-line tool is not on PATH";
    ASSERT_NE(dir_, nullptr);
  }

  static std::string F(const std::string& name) { return absl::StrCat(*dir_, "/", name); }

  // kvcd's $TMPDIR (where a reloading kvcd copies its key) is `tmpdir`, by default the suite's
  // folder, removed after the suite: a kvcd the test ends with SIGKILL leaves nothing behind.
  static std::unique_ptr<KvcdProcess> StartKvcd(std::vector<std::string> flags,
                                                const std::string& tmpdir = "") {
    KvcdProcess::Options o;
    o.binary = KVCD_PATH;
    o.flags = std::move(flags);
    o.env = {"TMPDIR=" + (tmpdir.empty() ? *dir_ : tmpdir)};
    auto p = KvcdProcess::Start(o);
    EXPECT_TRUE(p.ok()) << p.status();
    return p.ok() ? std::move(*p) : nullptr;
  }
  static std::vector<std::string> TlsFlags() {
    return {"--tls_cert_file=" + F("server.pem"), "--tls_key_file=" + F("server.key")};
  }

  // A raw stub; roots/cert/key are file names under the temp dir ("" = none).
  static std::unique_ptr<pb::KvCache::Stub> SslStub(const std::string& address,
                                                    const std::string& roots,
                                                    const std::string& cert = "",
                                                    const std::string& key = "") {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = ReadFile(F(roots));
    if (!cert.empty()) {
      ssl.pem_cert_chain = ReadFile(F(cert));
      ssl.pem_private_key = ReadFile(F(key));
    }
    // A connection of its own: channels with equal arguments would otherwise share one
    // connection (and its TLS session), or its reconnect backoff after a failed handshake.
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    return pb::KvCache::NewStub(
        grpc::CreateCustomChannel(address, grpc::SslCredentials(ssl), args));
  }

  static grpc::Status Info(pb::KvCache::Stub* stub) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    pb::ServerInfo info;
    return stub->GetServerInfo(&ctx, pb::GetServerInfoRequest(), &info);
  }

  // Uploads a small cache and reads it back PACKED over `stub`.
  static void ExpectRoundTrip(pb::KvCache::Stub* stub, const std::string& id) {
    const testing::TestCache cache = testing::MakeTestCache(id, testing::Shape(2, 2, 4, 64, 128, 8),
                                                            pb::DTYPE_F16, pb::LAYOUT_HND, 7);
    pb::PutCacheResponse put;
    grpc::Status s = testing::PutCache(stub, cache, &put);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    EXPECT_EQ(put.cache_id(), id);
    pb::GetCacheRequest req;
    req.set_cache_id(id);
    testing::Fetched got;
    s = testing::Get(stub, req, &got);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    EXPECT_EQ(got.info.cache_id(), id);
    EXPECT_EQ(got.kept_tokens.size(), 2u);
  }

  static std::string* dir_;
};
std::string* KvcdTlsTest::dir_ = nullptr;

TEST_F(KvcdTlsTest, TlsClientWithTheCaRoundTripsAndOthersFail) {
  auto kvcd = StartKvcd(TlsFlags());
  ASSERT_NE(kvcd, nullptr);
  auto stub = SslStub(kvcd->address(), "ca.pem");
  ExpectRoundTrip(stub.get(), "tls-raw");

  // kvc::Client with the CA, by IP (in the certificate's SANs) and by an overridden name.
  for (const std::string& override_name : {std::string(), std::string("localhost")}) {
    ClientOptions o;
    o.target = kvcd->address();
    o.tls = true;
    o.tls_ca_file = F("ca.pem");
    o.tls_server_name_override = override_name;
    auto client = Client::Create(o);
    ASSERT_TRUE(client.ok()) << client.status();
    auto stat = (*client)->StatCache("tls-raw");
    ASSERT_TRUE(stat.ok()) << override_name << ": " << stat.status();
    EXPECT_EQ(stat->cache_id(), "tls-raw");
    auto got = (*client)->GetCache("tls-raw", GetOptions());
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(got->layers.size(), 2u);
  }

  // A name the certificate does not list fails verification.
  {
    ClientOptions o;
    o.target = kvcd->address();
    o.tls = true;
    o.tls_ca_file = F("ca.pem");
    o.tls_server_name_override = "not-the-server.example";
    o.max_attempts = 1;
    auto client = Client::Create(o);
    ASSERT_TRUE(client.ok()) << client.status();
    EXPECT_EQ((*client)->StatCache("tls-raw").status().code(), absl::StatusCode::kUnavailable);
  }

  auto plain = testing::NewStub(kvcd->address());
  EXPECT_EQ(Info(plain.get()).error_code(), grpc::StatusCode::UNAVAILABLE);
  auto other = SslStub(kvcd->address(), "other_ca.pem");
  EXPECT_EQ(Info(other.get()).error_code(), grpc::StatusCode::UNAVAILABLE);

  // Probes keep working in plaintext on the health-only port.
  auto serving = testing::HealthServing(kvcd->health_address());
  ASSERT_TRUE(serving.ok()) << serving.status();
  EXPECT_TRUE(*serving);
}

TEST_F(KvcdTlsTest, MutualTlsRequiresACertificateSignedByTheClientCa) {
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_client_ca_file=" + F("ca.pem"));
  auto kvcd = StartKvcd(flags);
  ASSERT_NE(kvcd, nullptr);

  auto no_cert = SslStub(kvcd->address(), "ca.pem");
  EXPECT_EQ(Info(no_cert.get()).error_code(), grpc::StatusCode::UNAVAILABLE);
  auto stranger = SslStub(kvcd->address(), "ca.pem", "stranger.pem", "stranger.key");
  EXPECT_EQ(Info(stranger.get()).error_code(), grpc::StatusCode::UNAVAILABLE);

  auto with_cert = SslStub(kvcd->address(), "ca.pem", "client.pem", "client.key");
  ExpectRoundTrip(with_cert.get(), "mtls-raw");

  ClientOptions o;
  o.target = kvcd->address();
  o.tls = true;
  o.tls_ca_file = F("ca.pem");
  o.tls_cert_file = F("client.pem");
  o.tls_key_file = F("client.key");
  auto client = Client::Create(o);
  ASSERT_TRUE(client.ok()) << client.status();
  auto stat = (*client)->StatCache("mtls-raw");
  ASSERT_TRUE(stat.ok()) << stat.status();

  o.tls_cert_file.clear();
  o.tls_key_file.clear();
  o.max_attempts = 1;
  auto anonymous = Client::Create(o);
  ASSERT_TRUE(anonymous.ok()) << anonymous.status();
  EXPECT_EQ((*anonymous)->StatCache("mtls-raw").status().code(), absl::StatusCode::kUnavailable);
}

// Certificate rotation: kvcd re-reads its files every --tls_reload_seconds; new connections get
// the new certificate, and a pair that does not load (here: a key of another certificate) is
// skipped while the last good one stays in use.
TEST_F(KvcdTlsTest, ReloadsRotatedCertificatesForNewConnections) {
  const std::string cert = F("live.pem"), key = F("live.key");
  auto install = [&](const std::string& from_cert, const std::string& from_key) {
    // Each file is replaced whole (written aside, then renamed over), as a secret mount does.
    for (const auto& [from, to] : {std::pair{F(from_cert), cert}, std::pair{F(from_key), key}}) {
      std::ofstream(to + ".tmp", std::ios::binary) << ReadFile(from);
      ASSERT_EQ(std::rename((to + ".tmp").c_str(), to.c_str()), 0) << to;
    }
  };
  install("server.pem", "server.key");
  auto kvcd =
      StartKvcd({"--tls_cert_file=" + cert, "--tls_key_file=" + key, "--tls_reload_seconds=1"});
  ASSERT_NE(kvcd, nullptr);
  ASSERT_TRUE(Info(SslStub(kvcd->address(), "ca.pem").get()).ok());
  EXPECT_FALSE(Info(SslStub(kvcd->address(), "other_ca.pem").get()).ok());
  auto stub_before = SslStub(kvcd->address(), "ca.pem");
  ASSERT_TRUE(Info(stub_before.get()).ok());  // an open connection, kept across the rotation

  install("rotated.pem", "rotated.key");
  // Picked up within a few reload periods.
  bool rotated = false;
  for (int i = 0; i < 100 && !rotated; ++i) {
    rotated = Info(SslStub(kvcd->address(), "other_ca.pem").get()).ok();
    if (!rotated) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(rotated) << "kvcd still presents the old certificate after 10 s\n" << kvcd->output();
  EXPECT_FALSE(Info(SslStub(kvcd->address(), "ca.pem").get()).ok());
  ExpectRoundTrip(SslStub(kvcd->address(), "other_ca.pem").get(), "rotated");
  EXPECT_TRUE(Info(stub_before.get()).ok()) << "the connection made before the rotation broke";

  // A broken pair (the key of another certificate) is not taken.
  install("server.pem", "client.key");
  absl::SleepFor(absl::Seconds(3));
  EXPECT_TRUE(Info(SslStub(kvcd->address(), "other_ca.pem").get()).ok())
      << "kvcd dropped its last good certificate for a pair that does not match\n"
      << kvcd->output();
  const std::string out = kvcd->output();
  EXPECT_NE(out.find("TLS files reloaded"), std::string::npos) << out;
  EXPECT_NE(out.find("TLS files changed but cannot be used"), std::string::npos) << out;
  EXPECT_EQ(out.find("PRIVATE KEY"), std::string::npos) << out;
}

// The client CA rotates the same way: after the switch, clients signed by the new CA get in and
// those signed by the old one do not (new connections); a file that is PEM but holds no
// certificate (here: a private key) is not taken, and the last good CA stays in use.
TEST_F(KvcdTlsTest, ReloadsARotatedClientCa) {
  const std::string ca = F("live_client_ca.pem");
  auto install = [&](const std::string& from) {
    std::ofstream(ca + ".tmp", std::ios::binary) << ReadFile(F(from));
    ASSERT_EQ(std::rename((ca + ".tmp").c_str(), ca.c_str()), 0) << ca;
  };
  install("ca.pem");
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_client_ca_file=" + ca);
  flags.push_back("--tls_reload_seconds=1");
  auto kvcd = StartKvcd(flags);
  ASSERT_NE(kvcd, nullptr);
  const auto client = [&] { return SslStub(kvcd->address(), "ca.pem", "client.pem", "client.key"); };
  const auto stranger = [&] {
    return SslStub(kvcd->address(), "ca.pem", "stranger.pem", "stranger.key");
  };
  ASSERT_TRUE(Info(client().get()).ok());
  EXPECT_FALSE(Info(stranger().get()).ok());

  install("other_ca.pem");
  bool rotated = false;
  for (int i = 0; i < 100 && !rotated; ++i) {
    rotated = Info(stranger().get()).ok();
    if (!rotated) absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(rotated) << "kvcd still trusts only the old client CA after 10 s\n"
                       << kvcd->output();
  EXPECT_FALSE(Info(client().get()).ok()) << "a client of the old CA still got in";
  ExpectRoundTrip(stranger().get(), "client-ca-rotated");

  // PEM, but not a certificate: refused, the other CA stays.
  install("client.key");
  absl::SleepFor(absl::Seconds(3));
  EXPECT_TRUE(Info(stranger().get()).ok())
      << "kvcd dropped its last good client CA for a file that holds none\n"
      << kvcd->output();
  const std::string out = kvcd->output();
  EXPECT_NE(out.find("TLS files changed but cannot be used"), std::string::npos) << out;
  EXPECT_EQ(out.find("PRIVATE KEY"), std::string::npos) << out;
}

// With reload on, kvcd keeps a private copy of the certificate and key under $TMPDIR (what gRPC
// watches). A kvcd stopped by SIGTERM removes it: it exits without destructors, so the server's
// shutdown does. (A killed kvcd cannot; the copy is mode 0700.)
TEST_F(KvcdTlsTest, StoppingRemovesThePrivateCopyOfTheKey) {
  const std::string tmp = F("tmpdir");
  ASSERT_TRUE(std::filesystem::create_directory(tmp));
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_reload_seconds=1");
  auto kvcd = StartKvcd(flags, tmp);
  ASSERT_NE(kvcd, nullptr);
  ExpectRoundTrip(SslStub(kvcd->address(), "ca.pem").get(), "copy");
  const auto entries = [&] {
    std::vector<std::string> names;
    for (const auto& e : std::filesystem::directory_iterator(tmp)) {
      names.push_back(e.path().filename().string());
    }
    return names;
  };
  const std::vector<std::string> running = entries();
  ASSERT_EQ(running.size(), 1u);
  EXPECT_EQ(running[0].rfind("kvcd-tls-", 0), 0u) << running[0];
  EXPECT_TRUE(std::filesystem::exists(tmp + "/" + running[0] + "/current/key.pem"));

  absl::StatusOr<int> code = kvcd->Stop(absl::Seconds(30));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0) << kvcd->output();
  EXPECT_TRUE(entries().empty()) << "left behind: " << entries()[0];
}

// --tls_reload_seconds=0: the files are read once, and TLS works the same.
TEST_F(KvcdTlsTest, ReloadOffServesTheFilesReadAtStart) {
  std::vector<std::string> flags = TlsFlags();
  flags.push_back("--tls_reload_seconds=0");
  auto kvcd = StartKvcd(flags);
  ASSERT_NE(kvcd, nullptr);
  ExpectRoundTrip(SslStub(kvcd->address(), "ca.pem").get(), "reload-off");
  EXPECT_FALSE(Info(SslStub(kvcd->address(), "other_ca.pem").get()).ok());
}

TEST_F(KvcdTlsTest, BadTlsFlagsExitTwoNamingTheFlag) {
  const std::string cert = "--tls_cert_file=" + F("server.pem");
  const std::string key = "--tls_key_file=" + F("server.key");
  struct Case {
    std::vector<std::string> flags;
    std::string names;
  };
  const std::vector<Case> cases = {
      {{cert}, "--tls_key_file"},
      {{key}, "--tls_cert_file"},
      {{"--tls_client_ca_file=" + F("ca.pem")}, "--tls_client_ca_file"},
      {{cert, "--tls_key_file=" + F("missing.key")}, "--tls_key_file"},
      {{"--tls_cert_file=" + F("empty.pem"), key}, "--tls_cert_file"},
      {{cert, key, "--tls_client_ca_file=" + F("server.ext")}, "--tls_client_ca_file"},
      // A valid key that belongs to another certificate.
      {{cert, "--tls_key_file=" + F("client.key")}, "--tls_key_file"},
      {{cert, key, "--tls_reload_seconds=-1"}, "--tls_reload_seconds"},
      {{cert, key, "--tls_reload_seconds=86401"}, "--tls_reload_seconds"},
  };
  for (const Case& c : cases) {
    KvcdProcess::Options o;
    o.binary = KVCD_PATH;
    o.flags = c.flags;
    o.wait_for_ready = false;
    auto p = KvcdProcess::Start(o);
    ASSERT_TRUE(p.ok()) << p.status();
    auto code = (*p)->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok()) << code.status();
    const std::string out = (*p)->output();
    EXPECT_EQ(*code, 2) << c.names << "\n" << out;
    EXPECT_NE(out.find(c.names), std::string::npos) << out;
    EXPECT_EQ(out.find("PRIVATE KEY"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace kvc

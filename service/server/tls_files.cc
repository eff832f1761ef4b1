#include "server/tls_files.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "kvc/status_macros.h"

namespace kvc::server {
namespace {

// Reads a PEM file named by `flag`. Only the path is ever printed, never the contents (a key).
absl::StatusOr<std::string> ReadPem(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": cannot read ", path));
  }
  std::string pem = text.str();
  if (pem.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " is empty"));
  }
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("--", flag, ": ", path, " is not PEM"));
  }
  return pem;
}

struct Pems {
  std::string cert, key, ca;  // ca empty without --tls_client_ca_file
};

absl::StatusOr<Pems> ReadPems(const ServerConfig& c) {
  Pems p;
  ASSIGN_OR_RETURN(p.cert, ReadPem("tls_cert_file", c.tls_cert_file));
  ASSIGN_OR_RETURN(p.key, ReadPem("tls_key_file", c.tls_key_file));
  if (!c.tls_client_ca_file.empty()) {
    ASSIGN_OR_RETURN(p.ca, ReadPem("tls_client_ca_file", c.tls_client_ca_file));
  }
  return p;
}

std::shared_ptr<grpc::ServerCredentials> StaticCredentials(const Pems& p) {
  grpc::SslServerCredentialsOptions ssl;
  ssl.pem_key_cert_pairs.push_back({p.key, p.cert});
  if (!p.ca.empty()) {
    ssl.pem_root_certs = p.ca;
    ssl.client_certificate_request = GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  }
  return grpc::SslServerCredentials(ssl);
}

// gRPC checks a key against its certificate only when a server starts listening, so the pair is
// tried on a throwaway loopback listener. Returns the credentials that passed.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> CheckedCredentials(const Pems& p) {
  std::shared_ptr<grpc::ServerCredentials> credentials = StaticCredentials(p);
  grpc::ServerBuilder probe;
  int port = 0;
  probe.AddListeningPort("127.0.0.1:0", credentials, &port);
  probe.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  grpc::CallbackGenericService nothing;  // a server needs a service to start
  probe.RegisterCallbackGenericService(&nothing);
  std::unique_ptr<grpc::Server> server = probe.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::InvalidArgumentError(
        "--tls_cert_file/--tls_key_file: TLS setup failed (the key does not match the "
        "certificate, or a file is not a valid PEM certificate or key)");
  }
  server->Shutdown();
  return credentials;
}

absl::Status WritePrivate(const std::string& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InternalError(absl::StrCat("cannot write ", path));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n <= 0) break;
    done += static_cast<size_t>(n);
  }
  const bool ok = done == text.size() && close(fd) == 0;
  if (!ok) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<TlsFiles>> TlsFiles::Create(const ServerConfig& config) {
  std::unique_ptr<TlsFiles> t(new TlsFiles(config));
  ASSIGN_OR_RETURN(Pems p, ReadPems(config));
  ASSIGN_OR_RETURN(auto checked, CheckedCredentials(p));
  if (!t->reloads()) {
    t->credentials_ = std::move(checked);
    return t;
  }
  std::error_code ec;
  std::string tmpl = (std::filesystem::temp_directory_path(ec) / "kvcd-tls-XXXXXX").string();
  if (ec || mkdtemp(tmpl.data()) == nullptr) {
    return absl::InternalError(absl::StrCat(
        "--tls_reload_seconds: cannot create a private directory for the certificates under ",
        std::filesystem::temp_directory_path(ec).string(), " (set TMPDIR, or 0 to not reload)"));
  }
  t->dir_ = tmpl;
  RETURN_IF_ERROR(t->Stage(p.cert, p.key, p.ca));
  t->seen_ = p.cert + p.key + p.ca;
  using grpc::experimental::FileWatcherCertificateProvider;
  const std::string current = t->dir_ + "/current/";
  auto provider = p.ca.empty()
                      ? std::make_shared<FileWatcherCertificateProvider>(
                            current + "key.pem", current + "cert.pem", config.tls_reload_seconds)
                      : std::make_shared<FileWatcherCertificateProvider>(
                            current + "key.pem", current + "cert.pem", current + "ca.pem",
                            config.tls_reload_seconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!p.ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  t->credentials_ = grpc::experimental::TlsServerCredentials(options);
  return t;
}

TlsFiles::~TlsFiles() { RemoveCopy(); }

void TlsFiles::RemoveCopy() {
  if (dir_.empty()) return;
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
  dir_.clear();
}

// Writes v<n+1>/{cert,key,ca}.pem, then points `current` at it with one rename, so a reader sees
// the old pair or the new one (two reads straddling the switch can mix them; the watcher's next
// period reads a consistent pair again), then drops the version before the old one.
absl::Status TlsFiles::Stage(const std::string& cert, const std::string& key,
                             const std::string& ca) {
  const int next = version_ + 1;
  const std::string vdir = absl::StrCat(dir_, "/v", next);
  if (mkdir(vdir.c_str(), 0700) != 0) {
    return absl::InternalError(absl::StrCat("cannot create ", vdir));
  }
  RETURN_IF_ERROR(WritePrivate(vdir + "/cert.pem", cert));
  RETURN_IF_ERROR(WritePrivate(vdir + "/key.pem", key));
  if (!ca.empty()) RETURN_IF_ERROR(WritePrivate(vdir + "/ca.pem", ca));
  const std::string link = dir_ + "/current", tmp = dir_ + "/current.new";
  unlink(tmp.c_str());
  if (symlink(absl::StrCat("v", next).c_str(), tmp.c_str()) != 0 ||
      rename(tmp.c_str(), link.c_str()) != 0) {
    return absl::InternalError(absl::StrCat("cannot switch ", link));
  }
  std::error_code ec;
  if (version_ > 1) std::filesystem::remove_all(absl::StrCat(dir_, "/v", version_ - 1), ec);
  version_ = next;
  return absl::OkStatus();
}

std::string TlsFiles::Poll() {
  if (!reloads() || dir_.empty()) return "";
  absl::StatusOr<Pems> p = ReadPems(config_);
  const std::string now = p.ok() ? p->cert + p->key + p->ca : std::string(p.status().message());
  if (now == seen_) return "";
  seen_ = now;
  if (!p.ok()) {
    return absl::StrCat("TLS files changed but cannot be used (", p.status().message(),
                        "); still serving the previous certificate");
  }
  if (absl::Status s = CheckedCredentials(*p).status(); !s.ok()) {
    return absl::StrCat("TLS files changed but cannot be used (", s.message(),
                        "); still serving the previous certificate");
  }
  if (absl::Status s = Stage(p->cert, p->key, p->ca); !s.ok()) {
    return absl::StrCat("TLS files changed but could not be staged (", s.message(),
                        "); still serving the previous certificate");
  }
  return absl::StrCat("TLS files reloaded; new connections use them within ",
                      config_.tls_reload_seconds, " s");
}

}  // namespace kvc::server

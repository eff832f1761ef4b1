// TLS on kvcd's main gRPC port: the credentials built from --tls_cert_file, --tls_key_file and
// --tls_client_ca_file, and their reload (--tls_reload_seconds).
//
// Reload: gRPC's file watcher re-reads certificate files by itself, but takes whatever it finds,
// a certificate with a key that does not match included, and then fails every new handshake.
// So it never watches the configured files: kvcd validates the files itself (the same check as
// at start: a throwaway loopback listener with those credentials) and copies a pair that passes
// into a private directory (mode 0700 under $TMPDIR or /tmp), switched by renaming one symlink;
// gRPC watches that copy. A change that does not validate is reported and skipped, and the
// previous certificate stays in use. Connections already open keep the certificate they began
// with.
#ifndef KVC_SERVICE_SERVER_TLS_FILES_H_
#define KVC_SERVICE_SERVER_TLS_FILES_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/server_credentials.h"
#include "server/config.h"

namespace kvc::server {

class TlsFiles {
 public:
  // Reads and validates the configured files (INVALID_ARGUMENT naming the flag, never printing
  // a key). Requires config.tls_cert_file to be set.
  static absl::StatusOr<std::unique_ptr<TlsFiles>> Create(const ServerConfig& config);
  ~TlsFiles();  // removes the private copy

  // Removes the private copy of the certificate and key now (reload only; idempotent), for a
  // process that exits without running destructors. Poll() stages nothing afterwards; gRPC keeps
  // the credentials it already read.
  void RemoveCopy();
  TlsFiles(const TlsFiles&) = delete;
  TlsFiles& operator=(const TlsFiles&) = delete;

  std::shared_ptr<grpc::ServerCredentials> credentials() const { return credentials_; }
  bool reloads() const { return config_.tls_reload_seconds > 0; }

  // With reload on: when the configured files changed since the last call, validates them and
  // stages them for gRPC. Returns a line for the log ("" when nothing changed or reload is off).
  std::string Poll();

 private:
  explicit TlsFiles(const ServerConfig& config) : config_(config) {}
  absl::Status Stage(const std::string& cert, const std::string& key, const std::string& ca);

  const ServerConfig config_;
  std::shared_ptr<grpc::ServerCredentials> credentials_;
  std::string dir_;   // the private copy (reload only)
  int version_ = 0;   // dir_/v<version_> is what dir_/current points to
  std::string seen_;  // the configured files' contents at the last Poll
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_TLS_FILES_H_

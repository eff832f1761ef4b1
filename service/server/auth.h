// Bearer-token authentication for kvcd (--auth_tokens_file). Each token maps to a tenant; every
// RPC except grpc.health.v1 must carry "authorization: Bearer TOKEN". Cache ids are namespaced
// per tenant in the store ("TENANT/" + id), so a tenant sees and touches only its own caches.
//
// File format: one "TOKEN TENANT" pair per line; blank lines and lines starting with '#' are
// ignored. Tokens are 8..512 printable non-space characters; tenants 1..64 bytes of
// [A-Za-z0-9._-].
//
// Thread-safety: immutable after Load; Authenticate may be called concurrently.
#ifndef KVC_SERVICE_SERVER_AUTH_H_
#define KVC_SERVICE_SERVER_AUTH_H_

#include <memory>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "grpcpp/grpcpp.h"

namespace kvc::server {

class TokenAuth {
 public:
  // INVALID_ARGUMENT (naming the line) for a malformed file or a duplicate token; NOT_FOUND when
  // the file cannot be read.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> Load(const std::string& path);
  static absl::StatusOr<std::unique_ptr<TokenAuth>> Parse(const std::string& contents);

  // The store-id prefix of the caller's tenant ("TENANT/"), or UNAUTHENTICATED.
  absl::StatusOr<std::string> Authenticate(const grpc::ServerContextBase& context) const;

  size_t size() const { return tenants_.size(); }

 private:
  TokenAuth() = default;
  absl::flat_hash_map<std::string, std::string> tenants_;  // token -> tenant
};

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_AUTH_H_

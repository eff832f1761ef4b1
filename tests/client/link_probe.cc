// A program built on kvc_client alone, for link_check.sh: it connects to the address in argv[1]
// (default 127.0.0.1:1) and asks for the server's info, so the client library's code is linked
// in as an application would link it. Exit 0 when the call worked, 1 otherwise.
#include <cstdio>
#include <memory>

#include "kvc/client.h"

int main(int argc, char** argv) {
  kvc::ClientOptions options;
  options.target = argc > 1 ? argv[1] : "127.0.0.1:1";
  options.unary_timeout = absl::Milliseconds(200);
  absl::StatusOr<std::unique_ptr<kvc::Client>> client = kvc::Client::Create(options);
  if (!client.ok()) return 1;
  absl::StatusOr<kvcache::v1::ServerInfo> info = (*client)->GetServerInfo();
  std::printf("%s\n", info.ok() ? info->backend().c_str() : info.status().ToString().c_str());
  return info.ok() ? 0 : 1;
}

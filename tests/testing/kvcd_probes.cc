#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "kvc/protocol/status.h"
#include "testing/kvcd_process.h"

namespace kvc::testing {
namespace {

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

absl::StatusOr<bool> HealthServing(const std::string& address, const std::string& service,
                                   absl::Duration timeout) {
  // HealthCheckRequest{service} and HealthCheckResponse{status} encoded by hand: the health
  // proto's generated code is not part of the installed gRPC headers.
  std::string req;
  if (!service.empty()) {
    req.push_back(0x0a);
    req.push_back(static_cast<char>(service.size()));
    req += service;
  }
  grpc::Slice slice(req);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  if (!status.ok()) {
    const absl::Status s = FromGrpcStatus(status);
    return absl::Status(s.code(), absl::StrCat("health check: ", s.message()));
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) return absl::DataLossError("health check: unreadable");
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  // SERVING = 1, NOT_SERVING = 2; an absent field means UNKNOWN (0).
  const int value = bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : 0;
  if (value == 1) return true;
  if (value == 2) return false;
  return absl::UnknownError(absl::StrCat("health check: status ", value));
}

absl::StatusOr<int> PickFreeLoopbackPort() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    return Errno("bind");
  }
  close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace kvc::testing

// health_probe ADDRESS SERVICE: asks grpc.health.v1.Health/Check for SERVICE over plaintext, as
// kubelet's native gRPC probe does, and prints the answer. Exit 0 for SERVING, 1 for any other
// status, 2 if the call itself failed (with its code and message). A test helper: the deploy
// checks use it to prove the manifests' probes would pass against a real kvcd.
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

namespace {

// HealthCheckRequest { string service = 1; } in protobuf wire format.
std::string EncodeRequest(const std::string& service) {
  std::string out;
  if (service.empty()) return out;
  out.push_back(0x0a);  // field 1, length-delimited
  for (size_t n = service.size();; n >>= 7) {
    if (n < 0x80) {
      out.push_back(static_cast<char>(n));
      break;
    }
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
  }
  return out + service;
}

// HealthCheckResponse { ServingStatus status = 1; }; an absent field is UNKNOWN (0).
int DecodeStatus(const std::string& bytes) {
  if (bytes.size() >= 2 && bytes[0] == 0x08) return static_cast<unsigned char>(bytes[1]) & 0x7f;
  return 0;
}

const char* StatusName(int status) {
  switch (status) {
    case 1: return "SERVING";
    case 2: return "NOT_SERVING";
    case 3: return "SERVICE_UNKNOWN";
    default: return "UNKNOWN";
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: health_probe HOST:PORT SERVICE  (SERVICE may be \"\")\n");
    return 2;
  }
  const std::string address = argv[1];
  const std::string service = argv[2];
  grpc::GenericStub stub(grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  const std::string request = EncodeRequest(service);
  grpc::Slice slice(request);
  grpc::ByteBuffer request_buffer(&slice, 1);

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  grpc::CompletionQueue queue;
  auto call = stub.PrepareUnaryCall(&context, "/grpc.health.v1.Health/Check", request_buffer,
                                    &queue);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  if (!queue.Next(&tag, &ok) || !ok) {
    std::printf("%s '%s': the call did not complete\n", address.c_str(), service.c_str());
    return 2;
  }
  if (!status.ok()) {
    std::printf("%s '%s': rpc error %d: %s\n", address.c_str(), service.c_str(),
                static_cast<int>(status.error_code()), status.error_message().c_str());
    return 2;
  }
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok()) {
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  const int serving = DecodeStatus(bytes);
  std::printf("%s '%s': %s\n", address.c_str(), service.c_str(), StatusName(serving));
  queue.Shutdown();
  while (queue.Next(&tag, &ok)) {
  }
  return serving == 1 ? 0 : 1;
}

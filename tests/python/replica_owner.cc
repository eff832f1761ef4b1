// Test tool for the cross-language replica test: prints, for each cache id read from stdin (one a
// line), the replica that kvc::Client picks for it, as "<index> <address>", for the target given
// as the only argument. The Python test compares its own choice with this one.
#include <iostream>
#include <memory>
#include <string>

#include "kvc/client.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::cerr << "usage: kvc_replica_owner TARGET < ids\n";
    return 2;
  }
  kvc::ClientOptions options;
  options.target = argv[1];
  auto client = kvc::Client::Create(options);
  if (!client.ok()) {
    std::cerr << client.status() << "\n";
    return 1;
  }
  std::string id;
  while (std::getline(std::cin, id)) {
    const size_t r = (*client)->ReplicaFor(id);
    std::cout << r << " " << (*client)->replicas()[r] << "\n";
  }
  return 0;
}

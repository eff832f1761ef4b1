// Replica sets: resolving a client target to replica addresses, and rendezvous
// (highest-random-weight) hashing to decide which replica owns a cache id.
//
// ResolveTarget:
//   "dns:///name:port"  every address getaddrinfo returns for name, as "ip:port" ("[ip6]:port"),
//                       deduplicated and sorted; UNAVAILABLE when it resolves to nothing
//   "a,b,c"             the entries as written (spaces around them trimmed), deduplicated, sorted;
//                       an empty entry is INVALID_ARGUMENT
//   anything else       the target itself, one replica (gRPC resolves it)
//
// weight(id, replica) = XXH3_64bits_withSeed(id, XXH3_64bits(replica))
// i.e. XXH3-64 of the cache id's bytes, seeded with the XXH3-64 (seed 0) of the replica address
// bytes ("ip:port" or the list entry exactly as written). The owner is the replica of highest
// weight; equal weights go to the lexicographically smaller address. XXH3-64 output is stable
// across versions and platforms, so every client with the same replica set picks the same owner,
// and removing a replica moves only the ids it owned.
//
// Thread-safety: all functions are thread-safe (ResolveTarget blocks on DNS).
#ifndef KVC_REPLICAS_H_
#define KVC_REPLICAS_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace kvc {

absl::StatusOr<std::vector<std::string>> ResolveTarget(const std::string& target);

uint64_t RendezvousWeight(absl::string_view cache_id, absl::string_view replica);

// Index of the owner of `cache_id` in `replicas`. Precondition: replicas is not empty.
size_t RendezvousOwner(absl::string_view cache_id, absl::Span<const std::string> replicas);

}  // namespace kvc

#endif  // KVC_REPLICAS_H_

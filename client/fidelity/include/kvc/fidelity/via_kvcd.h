// The fidelity sweep through kvcd: each prefix cache is uploaded with PutCache (the compression
// spec in the header) and fetched back with GetCache PACKED, so decoding runs on the blobs the
// service stores and serves.
#ifndef KVC_FIDELITY_VIA_KVCD_H_
#define KVC_FIDELITY_VIA_KVCD_H_

#include <string>

#include "kvc/client.h"
#include "kvc/fidelity/fidelity.h"
#include "kvc/protocol/convert.h"
#include "kvcache/v1/kvcache.pb.h"

namespace kvc::fidelity {

// The wire form of a spec is kvc::SpecToProto (kvc/protocol/convert.h, the one mapping).

// A Compressor that round-trips through kvcd with `client` (not owned; must outlive the
// function). Cache ids are `id_prefix` + a running number; each cache is uploaded with overwrite
// and deleted after it is fetched. Errors from the server are returned with their code.
Compressor KvcdCompressor(Client* client, const std::string& id_prefix);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_VIA_KVCD_H_

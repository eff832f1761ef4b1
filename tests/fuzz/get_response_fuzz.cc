// Fuzzes the client's raw message parser (kvc/client_wire.h, used for GetCacheResponse) against
// protobuf's own parser on the same bytes: both accept or both reject, and an accepted message has
// the same non-data fields (unknown ones included) and the same data bytes, however the bytes are
// split into slices.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvc/client_wire.h"
#include "kvcache/v1/kvcache.pb.h"
#include "wire_fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvc::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvc::fuzz::Check;
  constexpr const char* kName = "get_response_fuzz";
  std::string bytes;
  const grpc::ByteBuffer buffer = kvc::fuzz::SlicedBuffer(data, size, &bytes);
  kvcache::v1::GetCacheResponse expected;
  const bool pb_ok = expected.ParseFromString(bytes);
  kvcache::v1::GetCacheResponse fields;
  kvc::RawData raw;
  const absl::Status st = kvc::ParseRawMessage(buffer, &fields, &raw);
  if (!pb_ok) {
    Check(!st.ok(), kName, "raw parser accepts bytes protobuf rejects");
    return 0;
  }
  Check(st.ok(), kName, "raw parser rejects bytes protobuf accepts");
  std::string got(raw.size(), '\0');
  raw.CopyTo(reinterpret_cast<uint8_t*>(got.data()));
  Check(got == expected.data(), kName, "data bytes differ");
  expected.clear_data();
  Check(kvc::fuzz::SameFields(fields, expected), kName,
        "non-data fields differ");
  return 0;
}

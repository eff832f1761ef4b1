// Fuzzes kvcd's raw PutCacheRequest parser (service/server/wire.h) against protobuf's own parser
// on the same bytes: both accept or both reject, and an accepted message has the same oneof
// member, header or chunk fields and data bytes. Also checks that the parser tolerates the bytes
// arriving in several slices.
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvcache/v1/kvcache.pb.h"
#include "server/wire.h"
#include "wire_fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  kvc::fuzz::QuietProtobuf();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using kvc::fuzz::Check;
  constexpr const char* kName = "put_request_fuzz";
  std::string bytes;
  grpc::ByteBuffer buffer = kvc::fuzz::SlicedBuffer(data, size, &bytes);
  kvcache::v1::PutCacheRequest expected;
  const bool pb_ok = expected.ParseFromString(bytes);
  absl::StatusOr<kvc::server::RawPutRequest> raw = kvc::server::ParsePutRequest(&buffer);
  if (!pb_ok) {
    Check(!raw.ok(), kName, "raw parser accepts bytes protobuf rejects");
    return 0;
  }
  Check(raw.ok(), kName, "raw parser rejects bytes protobuf accepts");
  using Kind = kvc::server::RawPutRequest::Kind;
  switch (expected.kind_case()) {
    case kvcache::v1::PutCacheRequest::kHeader:
      Check(raw->kind == Kind::kHeader, kName, "oneof: protobuf has a header");
      Check(kvc::fuzz::SameFields(raw->header, expected.header()), kName, "header differs");
      break;
    case kvcache::v1::PutCacheRequest::kChunk:
      Check(raw->kind == Kind::kChunk, kName, "oneof: protobuf has a chunk");
      Check(kvc::fuzz::SameFields(raw->chunk, expected.chunk()), kName, "chunk differs");
      break;
    default:
      Check(raw->kind == Kind::kNone, kName, "oneof: protobuf has neither member");
  }
  Check(raw->data_size == expected.data().size(), kName, "data size differs");
  std::string got(raw->data_size, '\0');
  raw->CopyDataTo(reinterpret_cast<uint8_t*>(got.data()));
  Check(got == expected.data(), kName, "data bytes differ");
  return 0;
}

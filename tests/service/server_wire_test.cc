// Unit tests of kvcd's raw wire handling and flag parsing: PutCacheRequest parsed over arbitrary
// slice boundaries equals protobuf's own parse; GetCacheResponse built from a prefix and a
// referenced payload parses back with protobuf; unary requests that do not parse are
// INVALID_ARGUMENT; error messages show callers their own ids; byte sizes and config validation.
#include <string>
#include <utility>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/config.h"
#include "server/convert.h"
#include "server/wire.h"
#include "testing/protobuf_edge_cases.h"

namespace kvc::server {
namespace {

using ::testing::HasSubstr;

// Splits `bytes` into slices at the given cut points.
grpc::ByteBuffer Split(const std::string& bytes, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t prev = 0;
  cuts.push_back(bytes.size());
  for (size_t c : cuts) {
    slices.emplace_back(bytes.data() + prev, c - prev);
    prev = c;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

std::string Data(const RawPutRequest& r) {
  std::string out(r.data_size, '\0');
  r.CopyDataTo(reinterpret_cast<uint8_t*>(out.data()));
  return out;
}

TEST(ServerWireTest, ChunkParsesIdenticallyAcrossEverySliceBoundary) {
  kvcache::v1::PutCacheRequest req;
  req.mutable_chunk()->set_layer(3);
  req.mutable_chunk()->set_tensor(kvcache::v1::TENSOR_V);
  req.mutable_chunk()->set_offset(1ull << 40);
  std::string payload(300, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 7);
  req.set_data(payload);
  const std::string bytes = req.SerializeAsString();
  for (size_t a = 0; a <= bytes.size(); a += 3) {
    for (size_t b = a; b <= bytes.size(); b += 17) {
      grpc::ByteBuffer buf = Split(bytes, {a, b});
      auto parsed = ParsePutRequest(&buf);
      ASSERT_TRUE(parsed.ok()) << parsed.status() << " cuts " << a << "," << b;
      ASSERT_EQ(parsed->kind, RawPutRequest::Kind::kChunk);
      EXPECT_EQ(parsed->chunk.layer(), 3u);
      EXPECT_EQ(parsed->chunk.tensor(), kvcache::v1::TENSOR_V);
      EXPECT_EQ(parsed->chunk.offset(), 1ull << 40);
      EXPECT_EQ(Data(*parsed), payload);
    }
  }
}

TEST(ServerWireTest, HeaderAndUnknownFieldsAndFieldOrder) {
  kvcache::v1::PutCacheRequest req;
  req.mutable_header()->set_cache_id("a/b");
  req.mutable_header()->mutable_shape()->set_seq_len(77);
  // Data before the header, and an unknown varint field 9: protobuf accepts both; so must we.
  std::string bytes;
  bytes += std::string("\x7a\x02xy", 4);  // field 15, length 2
  bytes += std::string("\x48\x05", 2);    // field 9 varint 5 (unknown)
  bytes += req.SerializeAsString();
  grpc::ByteBuffer buf = Split(bytes, {1, 5});
  auto parsed = ParsePutRequest(&buf);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  ASSERT_EQ(parsed->kind, RawPutRequest::Kind::kHeader);
  EXPECT_EQ(parsed->header.cache_id(), "a/b");
  EXPECT_EQ(parsed->header.shape().seq_len(), 77u);
  EXPECT_EQ(Data(*parsed), "xy");
  // Cross-check with protobuf's own parser.
  kvcache::v1::PutCacheRequest reference;
  ASSERT_TRUE(reference.ParseFromString(bytes));
  EXPECT_EQ(reference.data(), "xy");
}

TEST(ServerWireTest, EmptyMessageHasNoKind) {
  grpc::ByteBuffer buf = Split("", {});
  auto parsed = ParsePutRequest(&buf);
  ASSERT_TRUE(parsed.ok());
  EXPECT_EQ(parsed->kind, RawPutRequest::Kind::kNone);
  EXPECT_EQ(parsed->data_size, 0u);
}

TEST(ServerWireTest, MalformedInputIsInvalidArgument) {
  const std::vector<std::string> bad = {
      std::string("\x7a\x05xy", 4),        // data shorter than its length
      std::string("\x0a\x03\x0a", 3),      // header shorter than its length
      std::string("\x0a\x02\xff\xff", 4),  // header bytes that are not a PutCacheHeader
      std::string("\x7a", 1),              // length missing
      std::string("\x00\x01", 2),          // field number 0
      std::string("\x7b\x00", 2),          // wire type 3 (groups)
      std::string("\x48\xff\xff\xff", 4),  // truncated varint
  };
  for (const auto& b : bad) {
    grpc::ByteBuffer buf = Split(b, {});
    auto parsed = ParsePutRequest(&buf);
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << "input of " << b.size() << " bytes";
  }
}

// The unary methods parse their own requests, so that bytes protobuf refuses are
// INVALID_ARGUMENT naming the message (gRPC's generated handler answers UNIMPLEMENTED, no message).
TEST(ServerWireTest, ParseMessageAcceptsValidBytesOverAnySliceBoundary) {
  kvcache::v1::ListCachesRequest req;
  req.set_prefix("tenant-visible/prefix");
  req.set_page_size(7);
  req.set_page_token("after/this");
  const std::string bytes = req.SerializeAsString();
  for (size_t cut = 0; cut <= bytes.size(); ++cut) {
    kvcache::v1::ListCachesRequest parsed;
    ASSERT_TRUE(ParseMessage(Split(bytes, {cut}), &parsed).ok()) << "cut " << cut;
    EXPECT_EQ(parsed.SerializeAsString(), bytes);
  }
  kvcache::v1::GetServerInfoRequest empty;
  EXPECT_TRUE(ParseMessage(grpc::ByteBuffer(), &empty).ok());
}

TEST(ServerWireTest, ParseMessageRejectsUnparsableBytesNamingTheMessage) {
  const std::vector<std::string> bad = {
      std::string("\x0a\x02\xff\xfe", 4),  // cache_id that is not UTF-8
      std::string("\x0a\x05\x61\x62", 4),  // cache_id shorter than its length
      std::string("\x08", 1),              // varint missing
      std::string("\x00\x01", 2),          // field number 0
  };
  for (const auto& b : bad) {
    kvcache::v1::StatCacheRequest req;
    absl::Status s = ParseMessage(Split(b, {}), &req);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "input of " << b.size() << " bytes";
    EXPECT_THAT(s.message(), HasSubstr("malformed kvcache.v1.StatCacheRequest"));
  }
}

// Store messages quote the tenant-qualified id; the caller is shown the id it sent.
TEST(ServerWireTest, ToGrpcShowsTheCallerItsOwnId) {
  const absl::Status not_found = absl::NotFoundError("cache 'alpha/shared/id' not found");
  grpc::Status s = ToGrpc(not_found, "alpha/");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(s.error_message(), "cache 'shared/id' not found");
  // Without authentication the prefix is empty and the message unchanged.
  EXPECT_EQ(ToGrpc(not_found, "").error_message(), "cache 'alpha/shared/id' not found");
  // Only the quoted prefix is rewritten, every occurrence of it.
  EXPECT_EQ(ToGrpc(absl::AlreadyExistsError("cache 'beta/x' ('beta/x')"), "beta/").error_message(),
            "cache 'x' ('x')");
  EXPECT_TRUE(ToGrpc(absl::OkStatus(), "alpha/").ok());
}

TEST(ServerWireTest, AcceptsExactlyWhatProtobufAccepts) {
  for (const auto& [what, bytes] : testing::ProtobufEdgeCases()) {
    kvcache::v1::PutCacheRequest reference;
    const bool pb_ok = reference.ParseFromString(bytes);
    grpc::ByteBuffer buf = Split(bytes, {bytes.size() / 2});
    auto parsed = ParsePutRequest(&buf);
    ASSERT_EQ(parsed.ok(), pb_ok) << what << ": " << parsed.status();
    if (!pb_ok) {
      EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument) << what;
      continue;
    }
    EXPECT_EQ(parsed->kind == RawPutRequest::Kind::kHeader, reference.has_header()) << what;
    EXPECT_EQ(parsed->header.SerializeAsString(), reference.header().SerializeAsString()) << what;
    EXPECT_EQ(Data(*parsed), reference.data()) << what;
  }
}

TEST(ServerWireTest, ChunkResponseParsesWithProtobuf) {
  kvcache::v1::LayerChunk chunk;
  chunk.set_layer(2);
  chunk.set_part(kvcache::v1::PART_PACKED);
  chunk.set_offset(4096);
  chunk.set_total_bytes(1 << 20);
  chunk.set_kept_tokens(99);
  for (size_t size : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{70000}}) {
    auto payload = std::make_shared<std::vector<uint8_t>>(size);
    for (size_t i = 0; i < size; ++i) (*payload)[i] = static_cast<uint8_t>(i * 13);
    grpc::ByteBuffer buf = MakeChunkResponse(chunk, payload->data(), size, payload);
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(buf.Dump(&slices).ok());
    std::string bytes;
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    kvcache::v1::GetCacheResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(bytes)) << size;
    ASSERT_TRUE(parsed.has_chunk());
    EXPECT_EQ(parsed.chunk().SerializeAsString(), chunk.SerializeAsString());
    EXPECT_EQ(parsed.data(), std::string(payload->begin(), payload->end()));
  }
}

TEST(ServerWireTest, ChunkResponseReferencesThePayloadAndKeepsItAlive) {
  auto payload = std::make_shared<std::vector<uint8_t>>(1000, 5);
  std::weak_ptr<std::vector<uint8_t>> weak = payload;
  {
    grpc::ByteBuffer buf =
        MakeChunkResponse(kvcache::v1::LayerChunk(), payload->data(), 1000, payload);
    const uint8_t* data = payload->data();
    payload.reset();
    EXPECT_FALSE(weak.expired());  // the buffer holds it
    std::vector<grpc::Slice> slices;
    ASSERT_TRUE(buf.Dump(&slices).ok());
    ASSERT_EQ(slices.size(), 2u);
    EXPECT_EQ(slices[1].begin(), data);  // no copy
  }
  EXPECT_TRUE(weak.expired());
}

TEST(ServerConfigTest, ParseByteSize) {
  EXPECT_EQ(*ParseByteSize("f", "1073741824"), 1073741824u);
  EXPECT_EQ(*ParseByteSize("f", "1GiB"), 1ull << 30);
  EXPECT_EQ(*ParseByteSize("f", "1G"), 1ull << 30);
  EXPECT_EQ(*ParseByteSize("f", "64MiB"), 64ull << 20);
  EXPECT_EQ(*ParseByteSize("f", "512k"), 512ull << 10);
  EXPECT_EQ(*ParseByteSize("f", "4KB"), 4096u);
  EXPECT_EQ(*ParseByteSize("f", "2TiB"), 2ull << 40);
  EXPECT_EQ(*ParseByteSize("f", "7B"), 7u);
  for (const char* bad :
       {"", "G", "-1", "1.5G", "12X", "1GiBB", "99999999999999999999", "20000000000T"}) {
    auto r = ParseByteSize("store_bytes", bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(std::string(r.status().message()), HasSubstr("--store_bytes")) << bad;
  }
}

TEST(ServerConfigTest, DefaultsKeepOneUploadAndOnePeerBounded) {
  ServerConfig c;
  c.store_bytes = 1 << 30;
  c.max_concurrent_streams = 64;
  EXPECT_EQ(EffectiveMaxCacheBytes(c), 256u << 20);  // a quarter of the store
  EXPECT_EQ(EffectiveStagingBytes(c), 512u << 20);   // half of it
  EXPECT_EQ(EffectiveStreamsPerPeer(c), 16u);
  c.max_cache_bytes = 768 << 20;  // larger uploads raise the staging default with them
  EXPECT_EQ(EffectiveStagingBytes(c), 768u << 20);
  c.max_concurrent_streams = 3;
  EXPECT_EQ(EffectiveStreamsPerPeer(c), 1u);
  c.max_streams_per_peer = 2;
  EXPECT_EQ(EffectiveStreamsPerPeer(c), 2u);
}

TEST(ServerConfigTest, ValidateConfigNamesTheFlag) {
  EXPECT_TRUE(ValidateConfig(ServerConfig()).ok());
  auto expect_bad = [](std::function<void(ServerConfig&)> mutate, const std::string& flag) {
    ServerConfig c;
    mutate(c);
    absl::Status s = ValidateConfig(c);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << flag;
    EXPECT_THAT(std::string(s.message()), HasSubstr(flag));
  };
  expect_bad([](auto& c) { c.listen = "nohost"; }, "--listen");
  expect_bad([](auto& c) { c.listen = ""; }, "--listen");
  expect_bad([](auto& c) { c.health_listen = "1.2.3.4:99999"; }, "--health_listen");
  expect_bad([](auto& c) { c.metrics_listen = ":80"; }, "--metrics_listen");
  expect_bad([](auto& c) { c.store_bytes = 0; }, "--store_bytes");
  expect_bad([](auto& c) { c.max_message_bytes = 10; }, "--max_message_bytes");
  expect_bad([](auto& c) { c.max_chunk_bytes = c.max_message_bytes; }, "--max_chunk_bytes");
  expect_bad([](auto& c) { c.max_chunk_bytes = 0; }, "--max_chunk_bytes");
  expect_bad([](auto& c) { c.max_concurrent_streams = 0; }, "--max_concurrent_streams");
  expect_bad([](auto& c) { c.backend = "gpu"; }, "--backend");
  expect_bad([](auto& c) { c.threads = -2; }, "--threads");
  expect_bad([](auto& c) { c.drain_seconds = -1; }, "--drain_seconds");
  expect_bad([](auto& c) { c.shutdown_deadline_seconds = 1e9; }, "--shutdown_deadline_seconds");
  expect_bad([](auto& c) { c.ttl_sweep_seconds = 0; }, "--ttl_sweep_seconds");
  expect_bad([](auto& c) { c.max_streams_per_peer = c.max_concurrent_streams + 1; },
             "--max_streams_per_peer");
  expect_bad(
      [](auto& c) {
        c.max_cache_bytes = 64 << 20;
        c.staging_bytes = 32 << 20;
      },
      "--staging_bytes");
  expect_bad([](auto& c) { c.stream_idle_seconds = 0; }, "--stream_idle_seconds");
  // Empty optional addresses disable those listeners.
  ServerConfig c;
  c.health_listen = "";
  c.metrics_listen = "";
  EXPECT_TRUE(ValidateConfig(c).ok());
}

}  // namespace
}  // namespace kvc::server

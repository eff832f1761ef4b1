// Raw framing of bulk messages must be byte-compatible with the generated protobuf code.
#include <gtest/gtest.h>

#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kvc/client_wire.h"
#include "testing/protobuf_edge_cases.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;

std::string Flatten(const grpc::ByteBuffer& bb) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(bb.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// Splits serialized bytes into slices at the given cut points, as a network read might.
grpc::ByteBuffer SplitIntoSlices(const std::string& bytes, std::vector<size_t> cuts) {
  std::vector<grpc::Slice> slices;
  size_t prev = 0;
  cuts.push_back(bytes.size());
  for (size_t cut : cuts) {
    slices.emplace_back(bytes.data() + prev, cut - prev);
    prev = cut;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(SplitChunks, TenMiBInFourMiBChunks) {
  const uint64_t mib = 1 << 20;
  const std::vector<ChunkSpan> c = SplitChunks(10 * mib, 4 * mib);
  ASSERT_EQ(c.size(), 3u);
  EXPECT_EQ(c[0].offset, 0u);
  EXPECT_EQ(c[0].size, 4 * mib);
  EXPECT_EQ(c[1].offset, 4 * mib);
  EXPECT_EQ(c[1].size, 4 * mib);
  EXPECT_EQ(c[2].offset, 8 * mib);
  EXPECT_EQ(c[2].size, 2 * mib);
}

TEST(SplitChunks, ExactMultipleEmptyAndSmall) {
  EXPECT_EQ(SplitChunks(8, 4).size(), 2u);
  EXPECT_EQ(SplitChunks(8, 4)[1].size, 4u);
  EXPECT_TRUE(SplitChunks(0, 4).empty());
  EXPECT_TRUE(SplitChunks(8, 0).empty());
  ASSERT_EQ(SplitChunks(3, 4).size(), 1u);
  EXPECT_EQ(SplitChunks(3, 4)[0].size, 3u);
}

TEST(FramePutChunk, ParsesAsNormalPutCacheRequest) {
  std::vector<uint8_t> payload(300000);
  std::iota(payload.begin(), payload.end(), 7);
  pb::ChunkHeader chunk;
  chunk.set_layer(3);
  chunk.set_tensor(pb::TENSOR_V);
  chunk.set_offset(123456789012ull);
  const grpc::ByteBuffer bb = FramePutChunk(chunk, payload.data(), payload.size());
  pb::PutCacheRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(bb)));
  ASSERT_TRUE(parsed.has_chunk());
  EXPECT_EQ(parsed.chunk().layer(), 3u);
  EXPECT_EQ(parsed.chunk().tensor(), pb::TENSOR_V);
  EXPECT_EQ(parsed.chunk().offset(), 123456789012ull);
  EXPECT_EQ(parsed.data(), std::string(payload.begin(), payload.end()));

  // Byte-identical to what protobuf itself serializes (data is the last field in both).
  pb::PutCacheRequest normal;
  *normal.mutable_chunk() = chunk;
  normal.set_data(payload.data(), payload.size());
  EXPECT_EQ(Flatten(bb), normal.SerializeAsString());
}

TEST(FramePutChunk, EmptyPayloadAndHeaderMessage) {
  pb::ChunkHeader chunk;
  chunk.set_layer(1);
  pb::PutCacheRequest parsed;
  ASSERT_TRUE(parsed.ParseFromString(Flatten(FramePutChunk(chunk, nullptr, 0))));
  EXPECT_EQ(parsed.chunk().layer(), 1u);
  EXPECT_TRUE(parsed.data().empty());

  pb::PutCacheRequest header;
  header.mutable_header()->set_cache_id("abc");
  header.mutable_header()->mutable_shape()->set_num_layers(2);
  ASSERT_TRUE(parsed.ParseFromString(Flatten(FrameMessage(header))));
  EXPECT_EQ(parsed.header().cache_id(), "abc");
  EXPECT_EQ(parsed.header().shape().num_layers(), 2u);
}

TEST(ParseRawMessage, MatchesProtobufAcrossSliceBoundaries) {
  pb::GetCacheResponse msg;
  msg.mutable_chunk()->set_layer(5);
  msg.mutable_chunk()->set_part(pb::PART_POSITIONS);
  msg.mutable_chunk()->set_offset(4096);
  msg.mutable_chunk()->set_total_bytes(1 << 20);
  msg.mutable_chunk()->set_kept_tokens(77);
  std::string payload(100000, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 31 + 1);
  msg.set_data(payload);
  const std::string bytes = msg.SerializeAsString();
  // Cuts inside the chunk header, inside the data tag/length and inside the payload.
  for (const std::vector<size_t>& cuts :
       {std::vector<size_t>{}, std::vector<size_t>{1, 3, 5}, std::vector<size_t>{10, 11, 12, 13},
        std::vector<size_t>{20, 5000, 99999}}) {
    pb::GetCacheResponse fields;
    RawData data;
    ASSERT_TRUE(ParseRawMessage(SplitIntoSlices(bytes, cuts), &fields, &data).ok());
    EXPECT_EQ(fields.chunk().SerializeAsString(), msg.chunk().SerializeAsString());
    EXPECT_TRUE(fields.data().empty());  // data stays out of the protobuf copy
    ASSERT_EQ(data.size(), payload.size());
    std::string copied(data.size(), '\0');
    data.CopyTo(reinterpret_cast<uint8_t*>(copied.data()));
    EXPECT_EQ(copied, payload);
  }
}

TEST(ParseRawMessage, DataBeforeOtherFieldsAndInfoMessage) {
  // Field order on the wire is free in protobuf; a data field first must still parse.
  pb::GetCacheResponse data_only;
  data_only.set_data("xyz");
  pb::GetCacheResponse info_only;
  info_only.mutable_info()->set_cache_id("c1");
  info_only.mutable_info()->set_stored_bytes(99);
  const std::string bytes = data_only.SerializeAsString() + info_only.SerializeAsString();
  pb::GetCacheResponse fields;
  RawData data;
  ASSERT_TRUE(ParseRawMessage(SplitIntoSlices(bytes, {}), &fields, &data).ok());
  EXPECT_EQ(fields.info().cache_id(), "c1");
  EXPECT_EQ(fields.info().stored_bytes(), 99u);
  EXPECT_EQ(data.size(), 3u);
}

TEST(ParseRawMessage, RejectsTruncatedAndMalformed) {
  pb::GetCacheResponse msg;
  msg.mutable_chunk()->set_layer(1);
  msg.set_data(std::string(1000, 'a'));
  const std::string bytes = msg.SerializeAsString();
  pb::GetCacheResponse fields;
  RawData data;
  absl::Status s =
      ParseRawMessage(SplitIntoSlices(bytes.substr(0, bytes.size() - 1), {}), &fields, &data);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("data"), absl::string_view::npos) << s;
  // An unterminated group.
  s = ParseRawMessage(SplitIntoSlices(std::string("\x0b", 1), {}), &fields, &data);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // Field number 0.
  s = ParseRawMessage(SplitIntoSlices(std::string("\x00\x01", 2), {}), &fields, &data);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // A truncated varint.
  s = ParseRawMessage(SplitIntoSlices(std::string("\x08\x80", 2), {}), &fields, &data);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseRawMessage, AcceptsExactlyWhatProtobufAccepts) {
  for (const auto& [what, bytes] : testing::ProtobufEdgeCases()) {
    pb::GetCacheResponse reference;
    const bool pb_ok = reference.ParseFromString(bytes);
    pb::GetCacheResponse fields;
    RawData data;
    const absl::Status s =
        ParseRawMessage(SplitIntoSlices(bytes, {bytes.size() / 2}), &fields, &data);
    ASSERT_EQ(s.ok(), pb_ok) << what << ": " << s;
    if (!pb_ok) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what;
      continue;
    }
    std::string payload;
    payload.resize(data.size());
    data.CopyTo(reinterpret_cast<uint8_t*>(payload.data()));
    EXPECT_EQ(payload, reference.data()) << what;
    reference.clear_data();
    EXPECT_EQ(fields.SerializeAsString(), reference.SerializeAsString()) << what;
  }
}

}  // namespace
}  // namespace kvc

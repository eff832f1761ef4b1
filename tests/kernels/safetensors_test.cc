#include "kvc/safetensors.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

StTensor Tensor(const std::string& name, StDType t, std::vector<int64_t> shape, uint8_t fill) {
  StTensor x;
  x.name = name;
  x.dtype = t;
  x.shape = std::move(shape);
  size_t n = StDTypeSize(t);
  for (int64_t d : x.shape) n *= static_cast<size_t>(d);
  x.data.resize(n);
  for (size_t i = 0; i < n; ++i) x.data[i] = static_cast<uint8_t>(fill + i * 7);
  return x;
}

StFile Sample() {
  StFile f;
  f.metadata["format"] = "kvc";
  f.metadata["note \"quoted\""] = "line\nbreak";
  f.tensors.push_back(Tensor("layers.0.k", StDType::kF16, {2, 3, 8}, 1));
  f.tensors.push_back(Tensor("b", StDType::kBF16, {5}, 2));
  f.tensors.push_back(Tensor("empty", StDType::kF32, {0, 4}, 3));
  f.tensors.push_back(Tensor("positions", StDType::kI32, {2, 3}, 4));
  f.tensors.push_back(Tensor("ids", StDType::kI64, {3}, 5));
  f.tensors.push_back(Tensor("mask", StDType::kU8, {7}, 6));
  f.tensors.push_back(Tensor("scalar", StDType::kF32, {}, 7));
  return f;
}

// A file from a raw header string and a data section.
std::vector<uint8_t> Raw(const std::string& header, size_t data_bytes) {
  const uint64_t n = header.size();
  std::vector<uint8_t> out(8 + n + data_bytes, 0xab);
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(n >> (8 * i));
  std::copy(header.begin(), header.end(), out.begin() + 8);
  return out;
}

std::string Error(const std::vector<uint8_t>& bytes) {
  absl::StatusOr<StFile> f = ParseSafetensors(bytes);
  EXPECT_FALSE(f.ok());
  if (f.ok()) return "";
  EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument);
  return std::string(f.status().message());
}

TEST(SafetensorsTest, RoundTrip) {
  const StFile f = Sample();
  ASSERT_TRUE(ValidateStFile(f).ok());
  const std::vector<uint8_t> bytes = SerializeSafetensors(f);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);  // padded like the reference writer
  EXPECT_EQ(bytes[8], '{');
  absl::StatusOr<StFile> g = ParseSafetensors(bytes);
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->metadata, f.metadata);
  ASSERT_EQ(g->tensors.size(), f.tensors.size());
  for (size_t i = 0; i < f.tensors.size(); ++i) {
    EXPECT_EQ(g->tensors[i].name, f.tensors[i].name);
    EXPECT_EQ(g->tensors[i].dtype, f.tensors[i].dtype);
    EXPECT_EQ(g->tensors[i].shape, f.tensors[i].shape);
    EXPECT_EQ(g->tensors[i].data, f.tensors[i].data);
  }
  ASSERT_NE(g->Find("b"), nullptr);
  EXPECT_EQ(g->Find("b")->shape, std::vector<int64_t>{5});
  EXPECT_EQ(g->Find("nope"), nullptr);
  EXPECT_EQ(SerializeSafetensors(*g), bytes);
}

// A header as the reference writer lays it out (metadata first, data_offsets relative to the
// byte after the header) parses, with tensors ordered by offset.
TEST(SafetensorsTest, ParsesHandWrittenFile) {
  const std::string header =
      R"({"__metadata__":{"k":"v"},"w":{"dtype":"F32","shape":[2],"data_offsets":[2,10]},)"
      R"("u":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}})";
  std::vector<uint8_t> bytes = Raw(header + std::string((8 - header.size() % 8) % 8, ' '), 10);
  const float w[2] = {1.5f, -2.0f};
  std::memcpy(bytes.data() + bytes.size() - 8, w, 8);
  absl::StatusOr<StFile> f = ParseSafetensors(bytes);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(f->tensors.size(), 2u);
  EXPECT_EQ(f->tensors[0].name, "u");
  EXPECT_EQ(f->tensors[1].name, "w");
  float got[2];
  std::memcpy(got, f->tensors[1].data.data(), 8);
  EXPECT_EQ(got[0], 1.5f);
  EXPECT_EQ(got[1], -2.0f);
  EXPECT_EQ(f->metadata.at("k"), "v");
}

TEST(SafetensorsTest, RejectsTruncated) {
  const std::vector<uint8_t> bytes = SerializeSafetensors(Sample());
  EXPECT_THAT(Error(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 5)),
              HasSubstr("too short"));
  EXPECT_THAT(Error(std::vector<uint8_t>(bytes.begin(), bytes.begin() + 40)),
              HasSubstr("runs past the end"));
  EXPECT_THAT(Error(std::vector<uint8_t>(bytes.begin(), bytes.end() - 1)),
              HasSubstr("out of range"));
  for (size_t n = 0; n < bytes.size(); n += 3) {
    EXPECT_FALSE(ParseSafetensors(absl::MakeConstSpan(bytes.data(), n)).ok()) << n;
  }
}

TEST(SafetensorsTest, RejectsOversizedHeader) {
  std::vector<uint8_t> bytes(16, ' ');
  const uint64_t n = kMaxSafetensorsHeaderBytes + 1;
  std::memcpy(bytes.data(), &n, 8);
  EXPECT_THAT(Error(bytes), HasSubstr("exceeds the limit"));
}

TEST(SafetensorsTest, RejectsBadHeaders) {
  EXPECT_THAT(Error(Raw("{\"a\":", 0)), HasSubstr("bad header"));
  EXPECT_THAT(Error(Raw("[1]", 0)), HasSubstr("not a JSON object"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8)),
              HasSubstr("dtype \"F64\" is not supported"));
  EXPECT_THAT(Error(Raw(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4)),
              HasSubstr("\"dtype\" is missing"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4)),
              HasSubstr("non-negative"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", 8)),
              HasSubstr("two integers"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", 4)),
              HasSubstr("span 4 bytes but shape and dtype need 8"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8)),
              HasSubstr("not 0 <= begin <= end"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],)"
                        R"("data_offsets":[0,4]}})",
                        4)),
              HasSubstr("too large"));
  EXPECT_THAT(Error(Raw(R"({"__metadata__":{"k":1}})", 0)), HasSubstr("not a string"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                        R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                        2)),
              HasSubstr("duplicate key \"a\""));
}

TEST(SafetensorsTest, RejectsBadOffsets) {
  const std::string a = R"("a":{"dtype":"U8","shape":[4],"data_offsets":)";
  const std::string b = R"("b":{"dtype":"U8","shape":[4],"data_offsets":)";
  EXPECT_THAT(Error(Raw("{" + a + "[0,4]}," + b + "[4,8]}}", 6)), HasSubstr("out of range"));
  EXPECT_THAT(Error(Raw("{" + a + "[0,4]}," + b + "[2,6]}}", 8)), HasSubstr("overlap"));
  EXPECT_THAT(Error(Raw("{" + a + "[0,4]}," + b + "[5,9]}}", 9)), HasSubstr("gap"));
  EXPECT_THAT(Error(Raw("{" + a + "[0,4]}}", 6)), HasSubstr("cover"));
  EXPECT_THAT(Error(Raw("{}", 3)), HasSubstr("cover"));
  EXPECT_TRUE(ParseSafetensors(Raw("{" + a + "[0,4]}," + b + "[4,8]}}", 8)).ok());
}

TEST(SafetensorsTest, ValidateRejectsInconsistentFiles) {
  StFile f = Sample();
  f.tensors.push_back(f.tensors[1]);
  EXPECT_THAT(std::string(ValidateStFile(f).message()), HasSubstr("duplicate tensor name"));
  f = Sample();
  f.tensors[0].data.pop_back();
  EXPECT_THAT(std::string(ValidateStFile(f).message()), HasSubstr("need 96"));
  f = Sample();
  f.tensors[2].name = "__metadata__";
  EXPECT_THAT(std::string(ValidateStFile(f).message()), HasSubstr("reserved"));
  f = Sample();
  f.tensors[1].shape = {-5};
  EXPECT_THAT(std::string(ValidateStFile(f).message()), HasSubstr("negative"));
  // JSON strings are UTF-8: a name or metadata the header could not carry is refused up front.
  f = Sample();
  f.tensors[0].name = "bad\xff";
  EXPECT_THAT(std::string(ValidateStFile(f).message()), HasSubstr("not UTF-8"));
  f = Sample();
  f.metadata["k"] = "\xc0\x80";  // overlong NUL
  EXPECT_THAT(std::string(ValidateStFile(f).message()), HasSubstr("not UTF-8"));
}

TEST(SafetensorsTest, UnicodeNamesRoundTrip) {
  StFile f = Sample();
  f.tensors[0].name = "caf\xc3\xa9 \"q\" \x01";
  f.metadata["\xe2\x82\xac"] = "line\nbreak";
  ASSERT_TRUE(ValidateStFile(f).ok());
  absl::StatusOr<StFile> back = ParseSafetensors(SerializeSafetensors(f));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_NE(back->Find(f.tensors[0].name), nullptr);
  EXPECT_EQ(back->metadata, f.metadata);
}

TEST(SafetensorsTest, RejectsHostileJson) {
  // Invalid UTF-8 inside a header string, nesting beyond the limit, trailing garbage.
  EXPECT_THAT(Error(Raw("{\"\xff\":{}}", 0)), HasSubstr("bad header"));
  EXPECT_THAT(
      Error(Raw("{\"__metadata__\":" + std::string(200, '[') + std::string(200, ']') + "}", 0)),
      HasSubstr("nesting deeper than"));
  EXPECT_THAT(Error(Raw("{} {}", 0)), HasSubstr("bad header"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"U8","shape":[18446744073709551615],)"
                        R"("data_offsets":[0,1]}})",
                        1)),
              HasSubstr("non-negative"));
  EXPECT_THAT(Error(Raw(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1.5]}})", 1)),
              HasSubstr("two integers"));
}

TEST(SafetensorsTest, FileRoundTripAndErrors) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/kvc_safetensors_test.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, Sample()).ok());
  absl::StatusOr<StFile> f = ReadSafetensors(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->tensors.size(), Sample().tensors.size());
  std::remove(path.c_str());

  absl::StatusOr<StFile> missing = ReadSafetensors(path);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(missing.status().message()), HasSubstr(path));

  const std::string bad_dir = dir + "/no/such/dir/x.safetensors";
  absl::Status st = WriteSafetensors(bad_dir, Sample());
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(st.message()), HasSubstr(bad_dir));

  StFile invalid = Sample();
  invalid.tensors[0].data.clear();
  st = WriteSafetensors(path, invalid);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(ReadSafetensors(path).ok());  // nothing was written

  // A corrupt file reports the path and the parse error.
  std::FILE* out = std::fopen(path.c_str(), "wb");
  ASSERT_NE(out, nullptr);
  std::fputs("abc", out);
  std::fclose(out);
  absl::StatusOr<StFile> corrupt = ReadSafetensors(path);
  EXPECT_EQ(corrupt.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(corrupt.status().message()), HasSubstr(path + ": safetensors: file"));
  std::remove(path.c_str());
}

TEST(SafetensorsTest, DTypeHelpers) {
  EXPECT_EQ(StDTypeName(StDType::kBF16), "BF16");
  EXPECT_EQ(StDTypeSize(StDType::kI64), 8u);
  EXPECT_EQ(ToStDType(DType::kF16), StDType::kF16);
  EXPECT_EQ(*ToDType(StDType::kBF16), DType::kBF16);
  EXPECT_FALSE(ToDType(StDType::kI32).ok());
}

}  // namespace
}  // namespace kvc

#include "kvc/layer.h"

#include <cstdint>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvc {
namespace {

using ::testing::HasSubstr;

LayerShape GoodShape() {
  return {.num_kv_heads = 2, .num_q_heads = 8, .seq_len = 64, .head_dim = 16, .obs_window = 8};
}

void ExpectInvalid(const LayerShape& shape, const std::string& field) {
  const absl::Status s = ValidateShape(shape);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_THAT(std::string(s.message()), HasSubstr(field));
}

TEST(ValidateShapeTest, AcceptsGoodShapesAndLimits) {
  EXPECT_TRUE(ValidateShape(GoodShape()).ok());
  LayerShape s = GoodShape();
  s.head_dim = kMinHeadDim;
  EXPECT_TRUE(ValidateShape(s).ok());
  s.head_dim = kMaxHeadDim;
  EXPECT_TRUE(ValidateShape(s).ok());
  s.obs_window = 0;
  EXPECT_TRUE(ValidateShape(s).ok());
  s.obs_window = s.seq_len;
  EXPECT_TRUE(ValidateShape(s).ok());
  s.seq_len = 1;
  s.obs_window = 1;
  EXPECT_TRUE(ValidateShape(s).ok());
}

TEST(ValidateShapeTest, RejectsEachBadField) {
  LayerShape s = GoodShape();
  s.num_kv_heads = 0;
  ExpectInvalid(s, "shape.num_kv_heads");
  s = GoodShape();
  s.num_q_heads = 0;
  ExpectInvalid(s, "shape.num_q_heads");
  s = GoodShape();
  s.num_q_heads = 7;  // not a multiple of 2
  ExpectInvalid(s, "shape.num_q_heads");
  s = GoodShape();
  s.seq_len = 0;
  ExpectInvalid(s, "shape.seq_len");
  s = GoodShape();
  s.head_dim = kMinHeadDim - 1;
  ExpectInvalid(s, "shape.head_dim");
  s.head_dim = kMaxHeadDim + 1;
  ExpectInvalid(s, "shape.head_dim");
  s = GoodShape();
  s.obs_window = s.seq_len + 1;  // W > S
  ExpectInvalid(s, "shape.obs_window");
  s.obs_window = -1;
  ExpectInvalid(s, "shape.obs_window");
  EXPECT_FALSE(ValidateShape(s, /*rows_after_context=*/true).ok());
}

// kvzip's reconstruction rows may outnumber the tokens; the element limit still holds for them.
TEST(ValidateShapeTest, RowsAfterTheContextMayExceedSeqLen) {
  LayerShape s = GoodShape();
  s.obs_window = s.seq_len + 1;
  EXPECT_TRUE(ValidateShape(s, /*rows_after_context=*/true).ok());
  s.obs_window = 10 * s.seq_len;
  EXPECT_TRUE(ValidateShape(s, /*rows_after_context=*/true).ok());
  s = {.num_kv_heads = 1, .num_q_heads = 1024, .seq_len = 1, .head_dim = 256,
       .obs_window = 1 << 18};  // Q_obs at 2^36 elements: the limit
  EXPECT_TRUE(ValidateShape(s, /*rows_after_context=*/true).ok());
  s.obs_window += 1;
  const absl::Status st = ValidateShape(s, /*rows_after_context=*/true);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("Q_obs has"));
}

TEST(ValidateShapeTest, RejectsElementCountsAboveTheLimit) {
  LayerShape s = {.num_kv_heads = 1024,
                  .num_q_heads = 1024,
                  .seq_len = 1 << 28,
                  .head_dim = 256,
                  .obs_window = 0};
  ExpectInvalid(s, "K has");
  // Exactly at the limit (2^10 heads * 2^18 tokens * 2^8 channels = 2^36) is accepted.
  s = {.num_kv_heads = 1024,
       .num_q_heads = 1024,
       .seq_len = 1 << 18,
       .head_dim = 256,
       .obs_window = 0};
  EXPECT_TRUE(ValidateShape(s).ok());
  s.seq_len += 1;
  ExpectInvalid(s, "K has");
  s = {.num_kv_heads = 1,
       .num_q_heads = 1 << 20,
       .seq_len = 1 << 18,
       .head_dim = 256,
       .obs_window = 1 << 18};
  ExpectInvalid(s, "Q_obs has");
}

// Each count is checked as it is multiplied: the product below is 2^64 + 2144, which wrapped to
// 2144 elements and passed the limit before.
TEST(ValidateShapeTest, RejectsCountsThatOverflow64BitsNamingTheProduct) {
  LayerShape s = {.num_kv_heads = 901467965,
                  .num_q_heads = 901467965,
                  .seq_len = 213156309,
                  .head_dim = 96,
                  .obs_window = 0};
  absl::Status st = ValidateShape(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "shape: num_kv_heads*seq_len*head_dim = 901467965*213156309*96 overflows 64 bits");
  // K within the limit (2^34 elements), Q_obs past 2^64.
  s = {.num_kv_heads = 1,
       .num_q_heads = INT32_MAX,
       .seq_len = INT32_MAX,
       .head_dim = 8,
       .obs_window = INT32_MAX};
  st = ValidateShape(s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(),
            "shape: num_q_heads*obs_window*head_dim = 2147483647*2147483647*8 overflows 64 bits");
}

TEST(ValidateInputTest, RejectsBadPointersAndEnums) {
  uint16_t buf[16] = {};
  LayerInput in;
  in.shape = {.num_kv_heads = 1, .num_q_heads = 1, .seq_len = 1, .head_dim = 8, .obs_window = 1};
  in.k = buf;
  in.v = buf;
  in.q_obs = buf;
  EXPECT_TRUE(ValidateInput(in).ok());

  LayerInput bad = in;
  bad.k = nullptr;
  EXPECT_THAT(std::string(ValidateInput(bad).message()), HasSubstr("k: null"));
  bad = in;
  bad.v = nullptr;
  EXPECT_THAT(std::string(ValidateInput(bad).message()), HasSubstr("v: null"));
  bad = in;
  bad.q_obs = nullptr;
  EXPECT_THAT(std::string(ValidateInput(bad).message()), HasSubstr("q_obs"));
  bad.shape.obs_window = 0;  // no queries needed then
  EXPECT_TRUE(ValidateInput(bad).ok());
  bad = in;
  bad.dtype = static_cast<DType>(9);
  EXPECT_THAT(std::string(ValidateInput(bad).message()), HasSubstr("dtype"));
  bad = in;
  bad.layout = static_cast<Layout>(5);
  EXPECT_THAT(std::string(ValidateInput(bad).message()), HasSubstr("layout"));
  bad = in;
  bad.layer_index = -1;
  EXPECT_THAT(std::string(ValidateInput(bad).message()), HasSubstr("layer_index"));
  bad = in;
  bad.shape.head_dim = 4;
  EXPECT_THAT(std::string(ValidateInput(bad).message()), HasSubstr("shape.head_dim"));
  bad = in;
  bad.memory = static_cast<MemorySpace>(2);
  EXPECT_THAT(std::string(ValidateInput(bad, /*allow_device=*/true).message()),
              HasSubstr("memory: unknown value 2"));
}

// Device memory is accepted only where the caller says it can read it (the CUDA backend).
TEST(ValidateInputTest, DeviceMemoryOnlyWhereAllowed) {
  uint16_t buf[16] = {};
  LayerInput in;
  in.shape = {.num_kv_heads = 1, .num_q_heads = 1, .seq_len = 1, .head_dim = 8, .obs_window = 1};
  in.k = in.v = in.q_obs = buf;
  in.memory = MemorySpace::kDevice;
  const absl::Status st = ValidateInput(in);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("memory: k, v and q_obs are in device memory"));
  EXPECT_TRUE(ValidateInput(in, /*allow_device=*/true).ok());
}

TEST(ElementOffsetTest, HndAndNhdAddressTheSameElement) {
  // 3 heads, 5 tokens, D 8: element (h=2, t=4, c=7).
  EXPECT_EQ(ElementOffset(Layout::kHND, 3, 5, 8, 2, 4, 7), (2u * 5 + 4) * 8 + 7);
  EXPECT_EQ(ElementOffset(Layout::kNHD, 3, 5, 8, 2, 4, 7), (4u * 3 + 2) * 8 + 7);
}

}  // namespace
}  // namespace kvc

// A PutCacheHeader whose num_kv_heads * seq_len * head_dim overflows 64 bits (each field is at
// most 2^30, so the product can reach 2^68) is INVALID_ARGUMENT naming the product, for every
// compression that would otherwise reach the engine, and kvcd keeps serving afterwards. Before
// the sizes were overflow-checked, the wrapped product passed validation and the capacity check,
// the compression thread allocated for the real shape, and std::bad_alloc aborted kvcd.
#include <cstdint>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"
#include "testing/shared_kvcd.h"

namespace kvc {
namespace {

using kvcache::v1::PutCacheRequest;
using ::testing::HasSubstr;

constexpr uint32_t kHeads = 901467965;  // Hkv = Hq
constexpr uint32_t kSeqLen = 213156309;
constexpr uint32_t kHeadDim = 96;

class KvcdOverflowTest : public testing::SharedKvcdTest<KvcdOverflowTest> {
 public:
  static std::vector<std::string> KvcdFlags() { return {"--backend=cpu", "--threads=2"}; }
};

// The header, then K and V chunks of the size the wrapped 64-bit product claims (2 * 2144 bytes
// for f16): exactly what an upload of the unchecked shape would have been asked to send.
std::vector<PutCacheRequest> HugeUpload(const std::string& id,
                                        const kvcache::v1::CompressionConfig& compression) {
  PutCacheRequest h;
  auto* header = h.mutable_header();
  header->set_cache_id(id);
  *header->mutable_shape() = testing::Shape(1, kHeads, kHeads, kHeadDim, kSeqLen, 0);
  header->set_dtype(kvcache::v1::DTYPE_F16);
  header->set_layout(kvcache::v1::LAYOUT_HND);
  *header->mutable_compression() = compression;
  std::vector<PutCacheRequest> out = {h};
  const uint64_t wrapped = uint64_t{kHeads} * kSeqLen * kHeadDim * 2;  // unsigned: wraps
  EXPECT_LT(wrapped, uint64_t{1} << 20);
  for (auto kind : {kvcache::v1::TENSOR_K, kvcache::v1::TENSOR_V}) {
    PutCacheRequest r;
    r.mutable_chunk()->set_layer(0);
    r.mutable_chunk()->set_tensor(kind);
    r.mutable_chunk()->set_offset(0);
    r.set_data(std::string(wrapped, '\x01'));
    out.push_back(std::move(r));
  }
  return out;
}

TEST_F(KvcdOverflowTest, HugeShapeIsInvalidArgumentAndKvcdKeepsServing) {
  struct Case {
    std::string name;
    kvcache::v1::CompressionConfig compression;
  };
  std::vector<Case> cases;
  for (const char* policy : {"knorm", "random", "streaming"}) {
    Case c{policy, {}};
    c.compression.mutable_eviction()->set_policy(policy);
    cases.push_back(c);
  }
  Case quant{"quant8", {}};
  quant.compression.mutable_quant()->set_bits(8);
  cases.push_back(quant);

  auto stub = testing::NewStub(kvcd_->address());
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    grpc::Status s =
        testing::Put(stub.get(), HugeUpload("overflow/" + c.name, c.compression), nullptr);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("header.shape: num_kv_heads*seq_len*head_dim = "
                                             "901467965*213156309*96 overflows 64 bits"));
    ASSERT_TRUE(kvcd_->running()) << kvcd_->output();
  }

  // The same kvcd still stores and serves a normal cache.
  testing::TestCache small =
      testing::MakeTestCache("overflow/after", testing::Shape(2, 2, 4, 32, 64, 8),
                             kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 7);
  *small.header.mutable_compression() = testing::FullCompression();
  grpc::Status put = testing::PutCache(stub.get(), small);
  ASSERT_TRUE(put.ok()) << put.error_message() << "\n" << kvcd_->output();
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("overflow/after");
  testing::Fetched fetched;
  grpc::Status got = testing::Get(stub.get(), get, &fetched);
  ASSERT_TRUE(got.ok()) << got.error_message();
  EXPECT_EQ(fetched.info.cache_id(), "overflow/after");
  EXPECT_EQ(fetched.info.shape().num_layers(), 2u);
  EXPECT_TRUE(kvcd_->running());
  // None of the rejected uploads left anything behind.
  testing::StoreView view = testing::ViewStore(stub.get());
  EXPECT_EQ(view.ids, std::vector<std::string>{"overflow/after"});
}

}  // namespace
}  // namespace kvc

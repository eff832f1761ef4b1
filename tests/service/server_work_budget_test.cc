// The work budget of an upload (IngestLimits::work_*, kvc/cost.h), checked at its header before
// any byte is staged: realistic requests of every policy are accepted (Llama-3-8B at 32K tokens
// with W = 32 and 64, keyformer with W = S at modest S), the hostile shapes of the hardening
// review are refused with RESOURCE_EXHAUSTED naming the term and the limit, and the scratch the
// spec needs is added to what the upload reserves from the staging budget.
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"
#include "kvc/thread_pool.h"
#include "server/ingest.h"
#include "testing/kvc_rpc.h"

namespace kvc::server {
namespace {

namespace pb = kvcache::v1;
using ::testing::AllOf;
using ::testing::HasSubstr;

class ServerWorkBudgetTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto backend = CreateCpuBackend(BackendOptions{});
    ASSERT_TRUE(backend.ok());
    backend_ = *std::move(backend);
    CacheStore::Options so;
    so.capacity_bytes = uint64_t{1} << 42;  // any compact cache fits: only the budget decides
    auto store = CacheStore::Create(so);
    ASSERT_TRUE(store.ok());
    store_ = *std::move(store);
    limits_.max_cache_bytes = uint64_t{1} << 42;
    limits_.engine_threads = 16;
  }

  absl::Status Header(const pb::PutCacheHeader& h) {
    upload_ = std::make_shared<Upload>(backend_.get(), store_.get(), &pool_, limits_, &staging_);
    return upload_->OnHeader(h, h.cache_id());
  }

  static pb::PutCacheHeader Make(const pb::ModelShape& shape, const std::string& policy,
                                 double keep = 0.25) {
    pb::PutCacheHeader h;
    h.set_cache_id("c");
    *h.mutable_shape() = shape;
    h.set_dtype(pb::DTYPE_F16);
    h.mutable_compression()->mutable_eviction()->set_policy(policy);
    h.mutable_compression()->mutable_eviction()->set_keep_ratio(keep);
    pb::RopeSpec* rope = h.mutable_rope();
    rope->set_theta(500000);
    rope->set_style(pb::ROPE_HALF_SPLIT);
    return h;
  }

  std::unique_ptr<Backend> backend_;
  std::unique_ptr<CacheStore> store_;
  ThreadPool pool_{2};
  BufferPool staging_{0};
  IngestLimits limits_;
  std::shared_ptr<Upload> upload_;
};

TEST_F(ServerWorkBudgetTest, RealisticRequestsOfEveryPolicyAreAccepted) {
  for (uint32_t w : {32u, 64u}) {
    const pb::ModelShape llama = testing::Shape(32, 8, 32, 128, 32768, w);
    for (const char* policy : {"none", "streaming", "h2o", "snapkv", "keyformer", "knorm", "random",
                               "keydiff", "expected"}) {
      pb::PutCacheHeader h = Make(llama, policy);
      h.mutable_compression()->mutable_channels()->set_key_policy("think");
      h.mutable_compression()->mutable_channels()->set_key_lambda(0.5);
      h.mutable_compression()->mutable_quant()->set_bits(4);
      EXPECT_TRUE(Header(h).ok()) << policy << " W=" << w << ": " << Header(h);
    }
  }
  for (uint32_t s : {1024u, 4096u}) {
    const pb::ModelShape wide = testing::Shape(32, 8, 32, 128, s, s);
    EXPECT_TRUE(Header(Make(wide, "keyformer", 0.5)).ok()) << "keyformer W = S = " << s;
  }
  // The statistics sent by the client instead of Q_obs.
  pb::PutCacheHeader stats = Make(testing::Shape(32, 8, 32, 128, 32768, 0), "expected");
  stats.mutable_compression()->mutable_eviction()->set_query_stats(true);
  EXPECT_TRUE(Header(stats).ok()) << Header(stats);
  // A spec that keeps everything costs no engine work and reserves only its bytes.
  ASSERT_TRUE(Header(Make(testing::Shape(1, 8, 32, 128, 4096, 0), "none", 1)).ok());
  EXPECT_EQ(upload_->reserved_bytes(), upload_->declared_bytes());
}

TEST_F(ServerWorkBudgetTest, HostileShapesAreRefusedNamingTheTermAndTheLimit) {
  // Expected attention, 16384 query heads per KV head, S = 16384, D = 8, W = 1, 2 layers: a
  // 1.5 MiB upload that asked for about 1e11 flops.
  absl::Status s = Header(Make(testing::Shape(2, 1, 16384, 8, 16384, 1), "expected"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("header.compression: the spec needs"),
                    HasSubstr("--work_flops_per_byte=8192 x 1572864 bytes"),
                    HasSubstr("--work_base_flops=1e+09"), HasSubstr("expected scores")));
  EXPECT_EQ(upload_->reject_reason(), RejectReason::kWork);
  // keyformer with W = S = 65536 on one layer of two KV heads: quadratic in S per byte.
  s = Header(Make(testing::Shape(1, 2, 16, 128, 65536, 65536), "keyformer", 0.5));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(), HasSubstr("attention scores"));
  // 4096 query heads of D = 256, W = 1: the CUDA backend holds every head's covariance (1 GiB
  // for a 2 MiB upload), over the scratch budget; the CPU engine holds one head's at a time.
  const pb::ModelShape cov = testing::Shape(1, 1, 4096, 256, 16, 1);
  limits_.whole_layer_statistics = true;
  s = Header(Make(cov, "expected"));
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_THAT(s.message(),
              AllOf(HasSubstr("bytes of scratch memory"), HasSubstr("--work_scratch_per_byte=4"),
                    HasSubstr("--work_base_scratch_bytes=67108864"),
                    HasSubstr("statistics of all query heads")));
  limits_.whole_layer_statistics = false;
  EXPECT_TRUE(Header(Make(cov, "expected")).ok());
  EXPECT_LT(upload_->reserved_bytes() - upload_->declared_bytes(), uint64_t{64} << 20);
}

TEST_F(ServerWorkBudgetTest, HorizonAndPoolKernelAreCappedQuotingTheValueSent) {
  pb::PutCacheHeader h = Make(testing::Shape(2, 1, 1, 8, 4096, 8), "expected");
  h.mutable_compression()->mutable_eviction()->set_horizon(1u << 30);
  absl::Status s = Header(h);
  EXPECT_EQ(s, absl::InvalidArgumentError("header.compression.eviction.horizon: 1073741824 "
                                          "exceeds 1048576 (future positions the statistics "
                                          "are averaged over)"));
  h.mutable_compression()->mutable_eviction()->set_horizon(4000000000u);
  EXPECT_THAT(Header(h).message(), HasSubstr("horizon: 4000000000 exceeds 1048576"));
  h.mutable_compression()->mutable_eviction()->set_horizon(1u << 20);
  EXPECT_TRUE(Header(h).ok());
  pb::PutCacheHeader snap = Make(testing::Shape(1, 1, 1, 8, 4096, 8), "snapkv");
  snap.mutable_compression()->mutable_eviction()->set_pool_kernel(2147483647u);
  EXPECT_EQ(Header(snap),
            absl::InvalidArgumentError("header.compression.eviction.pool_kernel: 2147483647 "
                                       "exceeds 1023 (pooling costs seq_len * pool_kernel per "
                                       "head)"));
}

TEST_F(ServerWorkBudgetTest, TheBudgetFollowsItsFlags) {
  const pb::PutCacheHeader h = Make(testing::Shape(1, 2, 16, 128, 8192, 8192), "h2o", 0.5);
  ASSERT_TRUE(Header(h).ok());
  const WorkCost cost = upload_->cost();
  const uint64_t bytes = upload_->declared_bytes();
  // Just below what the spec costs: refused; at it: accepted.
  limits_.work_base_flops = 0;
  limits_.work_flops_per_byte = static_cast<double>(cost.flops) / bytes * 0.99;
  EXPECT_EQ(Header(h).code(), absl::StatusCode::kResourceExhausted);
  limits_.work_flops_per_byte = static_cast<double>(cost.flops) / bytes * 1.01;
  EXPECT_TRUE(Header(h).ok());
  limits_.work_base_scratch_bytes = 0;
  limits_.work_scratch_per_byte = static_cast<double>(cost.scratch_bytes) / bytes * 0.99;
  EXPECT_EQ(Header(h).code(), absl::StatusCode::kResourceExhausted);
  limits_.work_scratch_per_byte = static_cast<double>(cost.scratch_bytes) / bytes * 1.01;
  ASSERT_TRUE(Header(h).ok());
  EXPECT_EQ(upload_->reserved_bytes(), bytes + cost.scratch_bytes);
  EXPECT_GT(cost.scratch_bytes, 0u);
}

}  // namespace
}  // namespace kvc::server

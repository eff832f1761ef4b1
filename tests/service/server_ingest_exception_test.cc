// An exception thrown while a layer compresses on the pool (std::bad_alloc from an allocation the
// engine could not make, or anything else) fails that upload with RESOURCE_EXHAUSTED or INTERNAL
// and the server keeps serving; before, it escaped the pool thread and terminated kvcd. The
// throwing engine is injected in-process, so this test runs the KvCache service on an in-process
// gRPC server.
#include <atomic>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"
#include "kvc/thread_pool.h"
#include "server/service_impl.h"
#include "testing/kvc_rpc.h"
#include "testing/service_on_loopback.h"

namespace kvc::server {
namespace {

using ::testing::HasSubstr;

// The CPU engine, or an exception instead of it.
class ThrowingBackend final : public Backend {
 public:
  enum class Mode { kCompress, kBadAlloc, kRuntimeError };
  explicit ThrowingBackend(std::unique_ptr<Backend> real) : real_(std::move(real)) {}
  std::string_view name() const override { return "throwing"; }
  std::string description() const override { return "throwing"; }
  absl::StatusOr<CompactLayer> Compress(const LayerInput& in, const CompressionSpec& spec,
                                        CompressTimings* timings) override {
    switch (mode.load()) {
      case Mode::kBadAlloc:
        throw std::bad_alloc();
      case Mode::kRuntimeError:
        throw std::runtime_error("engine exploded");
      case Mode::kCompress:
        break;
    }
    return real_->Compress(in, spec, timings);
  }
  absl::Status Attend(const CompactLayerView& cache, const DecodeQuery& query,
                      float* out) override {
    return real_->Attend(cache, query, out);
  }
  std::atomic<Mode> mode{Mode::kCompress};

 private:
  std::unique_ptr<Backend> real_;
};

class ServerIngestExceptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = CreateCpuBackend(BackendOptions{});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backend_ = std::make_unique<ThrowingBackend>(*std::move(cpu));
    ASSERT_TRUE(loopback_.Start(backend_.get(), &pool_));
    stub_ = loopback_.stub();
  }

  // Two layers with eviction, channel pruning and quantization: each goes through Compress.
  static testing::TestCache Cache(const std::string& id) {
    testing::TestCache c = testing::MakeTestCache(
        id, testing::Shape(2, 2, 4, 32, 64, 8), kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 3);
    *c.header.mutable_compression() = testing::FullCompression();
    return c;
  }

  std::unique_ptr<ThrowingBackend> backend_;
  ThreadPool pool_{3};  // two compression workers
  testing::ServiceOnLoopback loopback_;  // declared last: stops serving first
  kvcache::v1::KvCache::Stub* stub_ = nullptr;
};

TEST_F(ServerIngestExceptionTest, ExceptionsFailTheUploadAndTheServerKeepsServing) {
  backend_->mode = ThrowingBackend::Mode::kBadAlloc;
  grpc::Status s = testing::PutCache(stub_, Cache("oom"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("out of memory"));

  backend_->mode = ThrowingBackend::Mode::kRuntimeError;
  s = testing::PutCache(stub_, Cache("boom"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("engine exploded"));
  EXPECT_EQ(testing::ViewStore(stub_).entries, 0u);

  // The same server (and pool) compresses, stores and serves the next upload.
  backend_->mode = ThrowingBackend::Mode::kCompress;
  s = testing::PutCache(stub_, Cache("fine"));
  ASSERT_TRUE(s.ok()) << s.error_message();
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("fine");
  testing::Fetched fetched;
  s = testing::Get(stub_, get, &fetched);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(fetched.info.cache_id(), "fine");
  EXPECT_EQ(testing::ViewStore(stub_).ids, std::vector<std::string>{"fine"});
}

}  // namespace
}  // namespace kvc::server

// An exception thrown while a stream is served (std::bad_alloc from a failed allocation, or
// anything else), in the engine or outside it, ends that stream with RESOURCE_EXHAUSTED or
// INTERNAL and gives back everything it held; kvcd serves the next request. Before, gRPC
// swallowed an exception thrown in a reactor's reaction (or its constructor) and never called
// OnDone, an exception in a pool job was only logged, and an exception while finalizing an
// upload lost its completion: each left the stream open for good, holding its
// --max_concurrent_streams slot (and a lease or the upload's staging), so the client waited
// forever and kvcd refused new streams once the slots were gone.
//
// The failures are injected in-process through the interfaces kvcd is built from (Backend,
// CacheStore, the upload's compress observer), on a server that allows one stream at a time: a
// slot that is not given back makes the next request fail.
#include <atomic>
#include <chrono>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/buffer_pool.h"
#include "kvc/cache_store.h"
#include "kvc/thread_pool.h"
#include "server/ingest.h"
#include "server/service_impl.h"
#include "server/wire.h"
#include "testing/kvc_rpc.h"
#include "testing/service_on_loopback.h"

namespace kvc::server {
namespace {

using ::testing::HasSubstr;

enum class Throw { kNothing, kBadAlloc, kRuntimeError };

void MaybeThrow(const std::atomic<Throw>& what) {
  switch (what.load()) {
    case Throw::kBadAlloc:
      throw std::bad_alloc();
    case Throw::kRuntimeError:
      throw std::runtime_error("injected failure");
    case Throw::kNothing:
      break;
  }
}

// The CPU engine, throwing when asked: from CanScoreKeys, which the upload's header asks on the
// PutCache reactor's own callback (OnReadDone), outside any pool job; or from Compress, on the
// pool, where the engine's exceptions are caught (CallNoThrow) and fail that upload.
class ThrowingBackend final : public Backend {
 public:
  explicit ThrowingBackend(std::unique_ptr<Backend> real) : real_(std::move(real)) {}
  std::string_view name() const override { return "throwing"; }
  std::string description() const override { return "throwing"; }
  bool CanScoreKeys() const override {
    MaybeThrow(on_header);
    return real_->CanScoreKeys();
  }
  absl::StatusOr<KeyScores> ScoreKeys(const LayerInput& in, const CompressionSpec& spec) override {
    return real_->ScoreKeys(in, spec);
  }
  absl::StatusOr<CompactLayer> CompressScored(const LayerInput& in, const CompressionSpec& spec,
                                              KeyScores scores, CompressTimings* t) override {
    MaybeThrow(on_compress);
    return real_->CompressScored(in, spec, std::move(scores), t);
  }
  absl::StatusOr<CompactLayer> Compress(const LayerInput& in, const CompressionSpec& spec,
                                        CompressTimings* timings) override {
    MaybeThrow(on_compress);
    return real_->Compress(in, spec, timings);
  }
  absl::Status Attend(const CompactLayerView& cache, const DecodeQuery& query,
                      float* out) override {
    return real_->Attend(cache, query, out);
  }
  std::atomic<Throw> on_header{Throw::kNothing};
  std::atomic<Throw> on_compress{Throw::kNothing};

 private:
  std::unique_ptr<Backend> real_;
};

// A store that passes everything to a real one, throwing from Insert (an upload's finalization,
// on a pool thread) or Acquire (a GetCache's constructor) when asked.
class ThrowingStore final : public CacheStore {
 public:
  absl::Status Insert(std::shared_ptr<const CacheEntry> entry, bool overwrite) override {
    MaybeThrow(on_insert);
    return real->Insert(std::move(entry), overwrite);
  }
  absl::Status CheckCanFit(uint64_t bytes) const override { return real->CheckCanFit(bytes); }
  absl::StatusOr<Lease> Acquire(const std::string& id) override {
    MaybeThrow(on_acquire);
    return real->Acquire(id);
  }
  absl::StatusOr<std::shared_ptr<const CacheEntry>> Peek(const std::string& id) const override {
    return real->Peek(id);
  }
  absl::StatusOr<uint64_t> Delete(const std::string& id) override { return real->Delete(id); }
  std::vector<std::shared_ptr<const CacheEntry>> List(const std::string& prefix,
                                                      const std::string& start_after,
                                                      size_t limit) const override {
    return real->List(prefix, start_after, limit);
  }
  size_t ExpireNow() override { return real->ExpireNow(); }
  Stats GetStats() const override { return real->GetStats(); }

  CacheStore* real = nullptr;
  std::atomic<Throw> on_insert{Throw::kNothing};
  std::atomic<Throw> on_acquire{Throw::kNothing};
};

// Two layers with eviction, channel pruning and quantization.
testing::TestCache Cache(const std::string& id) {
  testing::TestCache c = testing::MakeTestCache(
      id, testing::Shape(2, 2, 4, 32, 64, 8), kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 3);
  *c.header.mutable_compression() = testing::FullCompression();
  return c;
}

// Every call of these tests is bounded: a stream left open fails its deadline instead of hanging.
constexpr absl::Duration kDeadline = absl::Seconds(60);

class ServerStreamExceptionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = CreateCpuBackend(BackendOptions{});
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    backend_ = std::make_unique<ThrowingBackend>(*std::move(cpu));
    ASSERT_TRUE(loopback_.Start(backend_.get(), &pool_, [this](ServiceState* state) {
      store_.real = state->store;
      state->store = &store_;
      state->config.max_concurrent_streams = 1;  // a slot not given back refuses the next one
    }));
    stub_ = loopback_.stub();
  }

  // A failed upload's jobs may still be running: they reach the store, which goes first.
  void TearDown() override {
    EXPECT_TRUE(pool_.WaitIdle(std::chrono::steady_clock::now() + std::chrono::seconds(60)));
  }

  // The client may learn a stream's status before the server has given its slot back (OnDone),
  // so a refusal for the slot is retried until a deadline: a slot that is never given back fails
  // the call that needs it.
  template <typename Call>
  static grpc::Status WhenASlotIsFree(Call call) {
    const absl::Time deadline = absl::Now() + kDeadline;
    for (;;) {
      grpc::Status s = call();
      if (s.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED ||
          s.error_message().find("too many concurrent streams") == std::string::npos ||
          absl::Now() > deadline) {
        return s;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
  }

  grpc::Status Put(const std::string& id) {
    const std::vector<kvcache::v1::PutCacheRequest> requests =
        testing::MakeRequests(Cache(id), 16 << 10);
    return WhenASlotIsFree([&] { return testing::Put(stub_, requests, nullptr, kDeadline); });
  }

  grpc::Status Get(const std::string& id, kvcache::v1::Format format, testing::Fetched* out) {
    kvcache::v1::GetCacheRequest get;
    get.set_cache_id(id);
    get.set_format(format);
    return WhenASlotIsFree([&] {
      *out = testing::Fetched();
      return testing::Get(stub_, get, out, kDeadline);
    });
  }

  // The server still takes a stream, stores an upload and serves it.
  void ExpectServing(const std::string& id) {
    grpc::Status s = Put(id);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    testing::Fetched fetched;
    s = Get(id, kvcache::v1::FORMAT_DENSE, &fetched);
    ASSERT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    EXPECT_EQ(fetched.info.cache_id(), id);
  }

  std::unique_ptr<ThrowingBackend> backend_;
  ThrowingStore store_;
  ThreadPool pool_{3};
  testing::ServiceOnLoopback loopback_;  // declared last: stops serving first
  kvcache::v1::KvCache::Stub* stub_ = nullptr;
};

// An exception while a layer compresses on the pool (the engine: it once escaped the pool thread
// and terminated kvcd) or on the PutCache reactor's callback (the header's query of the backend)
// fails that upload, and the server keeps serving.
TEST_F(ServerStreamExceptionTest, AnUploadsExceptionFailsItAndTheServerKeepsServing) {
  for (std::atomic<Throw>* at : {&backend_->on_compress, &backend_->on_header}) {
    const std::string where = at == &backend_->on_compress ? "engine" : "header";
    SCOPED_TRACE(where);
    *at = Throw::kBadAlloc;
    grpc::Status s = Put(where + "-oom");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("out of memory"));

    *at = Throw::kRuntimeError;
    s = Put(where + "-boom");
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INTERNAL) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("injected failure"));
    EXPECT_EQ(testing::ViewStore(stub_).entries, 0u);

    *at = Throw::kNothing;
    ExpectServing(where + "-fine");
    EXPECT_EQ(testing::ViewStore(stub_).ids, std::vector<std::string>{where + "-fine"});
    ASSERT_TRUE(loopback_.store()->Delete(where + "-fine").ok());
  }
}

TEST_F(ServerStreamExceptionTest, AnExceptionWhileFinalizingAnUploadAnswersTheClient) {
  store_.on_insert = Throw::kBadAlloc;
  grpc::Status s = Put("insert-oom");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("out of memory"));
  EXPECT_EQ(testing::ViewStore(stub_).entries, 0u);

  store_.on_insert = Throw::kNothing;
  ExpectServing("after-insert");
}

TEST_F(ServerStreamExceptionTest, AnExceptionInTheGetCacheConstructorEndsTheStream) {
  ASSERT_TRUE(Put("stored").ok());
  for (Throw t : {Throw::kBadAlloc, Throw::kRuntimeError}) {
    store_.on_acquire = t;
    for (auto format : {kvcache::v1::FORMAT_PACKED, kvcache::v1::FORMAT_DENSE}) {
      testing::Fetched fetched;
      grpc::Status s = Get("stored", format, &fetched);
      EXPECT_EQ(s.error_code(), t == Throw::kBadAlloc ? grpc::StatusCode::RESOURCE_EXHAUSTED
                                                      : grpc::StatusCode::INTERNAL)
          << s.error_message();
      EXPECT_THAT(s.error_message(),
                  HasSubstr(t == Throw::kBadAlloc ? "out of memory" : "injected failure"));
    }
  }
  store_.on_acquire = Throw::kNothing;
  testing::Fetched fetched;
  grpc::Status s = Get("stored", kvcache::v1::FORMAT_PACKED, &fetched);
  ASSERT_TRUE(s.ok()) << s.error_message();
  ExpectServing("after-acquire");
}

// Sends every chunk of `cache` to `upload` after its header; the first error, if any.
absl::Status Feed(Upload* upload, const testing::TestCache& cache) {
  std::vector<kvcache::v1::PutCacheRequest> requests = testing::MakeRequests(cache, 16 << 10);
  if (!requests.front().has_header()) return absl::InternalError("no header");
  if (absl::Status s = upload->OnHeader(requests.front().header(), cache.header.cache_id());
      !s.ok()) {
    return s;
  }
  for (size_t i = 1; i < requests.size(); ++i) {
    grpc::ByteBuffer buffer = SerializeToByteBuffer(requests[i]);
    absl::StatusOr<RawPutRequest> raw = ParsePutRequest(&buffer);
    if (!raw.ok()) return raw.status();
    if (absl::Status s = upload->OnChunk(*raw); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// The upload's answer, as the done callback that Finish (called here) hands it.
class Answer {
 public:
  explicit Answer(Upload* upload) {
    upload->Finish(
        [done = done_, result = result_](absl::StatusOr<kvcache::v1::PutCacheResponse> r) {
          *result = std::move(r);
          done->Notify();
        });
  }
  bool arrived() const { return done_->HasBeenNotified(); }
  // The answer, or DEADLINE_EXCEEDED when it never comes.
  absl::StatusOr<kvcache::v1::PutCacheResponse> Wait() const {
    if (!done_->WaitForNotificationWithTimeout(kDeadline)) {
      return absl::DeadlineExceededError("the upload never answered");
    }
    return *result_;
  }

 private:
  // Shared with the callback, which may outlive the test's wait.
  const std::shared_ptr<absl::Notification> done_ = std::make_shared<absl::Notification>();
  const std::shared_ptr<absl::StatusOr<kvcache::v1::PutCacheResponse>> result_ =
      std::make_shared<absl::StatusOr<kvcache::v1::PutCacheResponse>>();
};

struct UploadParts {
  UploadParts() {
    auto b = CreateCpuBackend(BackendOptions{});
    auto s = CacheStore::Create(CacheStore::Options{});
    if (b.ok()) backend = *std::move(b);
    if (s.ok()) real_store = *std::move(s);
    store.real = real_store.get();
  }
  std::unique_ptr<Backend> backend;
  std::unique_ptr<CacheStore> real_store;
  ThrowingStore store;
  BufferPool staging{64 << 20};
};

// An exception in an upload's pool job outside the engine (here the compress observer, which
// kvcd points at its metrics) fails the upload at once: the job's bookkeeping is half done, so
// the upload does not wait for it to finish.
TEST(UploadJobExceptionTest, AJobThatThrowsFailsTheUploadAtOnce) {
  UploadParts parts;
  ASSERT_NE(parts.backend, nullptr);
  ThreadPool pool(3);
  auto upload = std::make_shared<Upload>(parts.backend.get(), &parts.store, &pool, IngestLimits{},
                                         &parts.staging);
  std::atomic<int> thrown{0};
  upload->set_compress_observer([&thrown](int delta) {
    if (delta > 0) {
      ++thrown;
      throw std::bad_alloc();
    }
  });
  const absl::Status fed = Feed(upload.get(), Cache("job"));
  // A chunk after the failed job may already report it; otherwise the upload's answer does.
  const absl::Status result = fed.ok() ? Answer(upload.get()).Wait().status() : fed;
  EXPECT_GE(thrown.load(), 1);
  EXPECT_EQ(result.code(), absl::StatusCode::kResourceExhausted) << result;
  EXPECT_EQ(parts.real_store->GetStats().entries, 0u);
  // The jobs still running drop their results; they use the staging pool, so wait for them.
  EXPECT_TRUE(pool.WaitIdle(std::chrono::steady_clock::now() + std::chrono::seconds(60)));
}

// The last layer's job finalizes the upload (the client had closed its stream first): an
// exception while finalizing (here the store's insert) is the client's answer.
TEST(UploadJobExceptionTest, FinalizingOnAPoolThreadAnswersWhenItThrows) {
  UploadParts parts;
  ASSERT_NE(parts.backend, nullptr);
  parts.store.on_insert = Throw::kBadAlloc;
  ThreadPool pool(2);  // one worker, held until every chunk is in and the stream is closed
  absl::Notification release;
  pool.Schedule([&release] { release.WaitForNotification(); });
  auto upload = std::make_shared<Upload>(parts.backend.get(), &parts.store, &pool, IngestLimits{},
                                         &parts.staging);
  ASSERT_TRUE(Feed(upload.get(), Cache("finalize")).ok());
  const Answer answer(upload.get());
  EXPECT_FALSE(answer.arrived());  // its layers wait behind the held worker
  release.Notify();
  const absl::Status result = answer.Wait().status();
  EXPECT_EQ(result.code(), absl::StatusCode::kResourceExhausted) << result;
  EXPECT_THAT(std::string(result.message()), HasSubstr("out of memory"));
  EXPECT_EQ(parts.real_store->GetStats().entries, 0u);
  EXPECT_TRUE(pool.WaitIdle(std::chrono::steady_clock::now() + std::chrono::seconds(60)));
}

// Cancel (the stream's OnCancel, which gRPC may run on another thread while a reaction runs,
// e.g. when a tiny deadline expires) racing the header that sizes the upload's layers: the
// cancellation walked the layers while the header was still sizing them, and kvcd crashed
// (SIGSEGV in DropHeldLayers, seen in a soak with tiny deadlines). Many layers widen the window.
TEST(UploadCancelRaceTest, CancelWhileTheHeaderIsAcceptedIsSafe) {
  UploadParts parts;
  ASSERT_NE(parts.backend, nullptr);
  ThreadPool pool(3);
  testing::TestCache cache = testing::MakeTestCache(
      "race", testing::Shape(1, 1, 1, 32, 32, 8), kvcache::v1::DTYPE_F16,
      kvcache::v1::LAYOUT_HND, 1);
  *cache.header.mutable_compression() = testing::FullCompression();
  kvcache::v1::PutCacheHeader header = cache.header;
  header.mutable_shape()->set_num_layers(4096);
  IngestLimits limits;
  limits.max_cache_bytes = 1ull << 40;
  limits.work_base_flops = 1e15;
  limits.work_base_scratch_bytes = 1ull << 40;
  for (int round = 0; round < 300; ++round) {
    auto upload = std::make_shared<Upload>(parts.backend.get(), &parts.store, &pool, limits,
                                           &parts.staging);
    std::atomic<bool> go{false};
    std::thread canceller([&] {
      while (!go.load()) {
      }
      upload->Cancel(absl::CancelledError("cancelled while the header was read"));
    });
    go = true;
    const absl::Status s = upload->OnHeader(header, "race");
    canceller.join();
    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kCancelled) << s;
  }
}

}  // namespace
}  // namespace kvc::server

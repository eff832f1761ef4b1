// Clients that hold stream resources without using them: idle PutCache and GetCache streams are
// ended after --stream_idle_seconds (slot, staging and read lease freed), one peer or tenant gets
// at most --max_streams_per_peer streams, and stalled uploads cannot stage more than
// --staging_bytes (kvcd's resident memory stays under the documented bound).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using kvcache::v1::PutCacheRequest;
using ::testing::AnyOf;
using ::testing::HasSubstr;
using testing::KvcdProcess;
using testing::TestCache;

std::unique_ptr<KvcdProcess> StartKvcd(std::vector<std::string> flags) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = std::move(flags);
  opts.flags.push_back("--backend=cpu");
  auto p = KvcdProcess::Start(opts);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? *std::move(p) : nullptr;
}

// A PutCache stream that sent some messages and then nothing.
struct StalledPut {
  grpc::ClientContext ctx;
  kvcache::v1::PutCacheResponse resp;
  std::unique_ptr<grpc::ClientWriter<PutCacheRequest>> writer;
};

std::unique_ptr<StalledPut> SendHeaderOnly(kvcache::v1::KvCache::Stub* stub, PutCacheRequest header,
                                           const std::string& id) {
  auto p = std::make_unique<StalledPut>();
  p->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
  p->writer = stub->PutCache(&p->ctx, &p->resp);
  header.mutable_header()->set_cache_id(id);
  p->writer->Write(header);
  return p;
}

// 1 layer, 4 KV heads, D = 128, S = 4096, f16: 8 MiB of K + V, more than gRPC buffers for a
// reader that does not read.
TestCache Big(const std::string& id) {
  return testing::MakeTestCache(id, testing::Shape(1, 4, 4, 128, 4096, 0), kvcache::v1::DTYPE_F16,
                                kvcache::v1::LAYOUT_HND, 7);
}

TestCache Small(const std::string& id) {
  return testing::MakeTestCache(id, testing::Shape(1, 1, 1, 8, 16, 0), kvcache::v1::DTYPE_F32,
                                kvcache::v1::LAYOUT_HND, 3);
}

double Metric(const KvcdProcess& kvcd, const std::string& series) {
  auto text = testing::HttpGet(kvcd.metrics_address(), "/metrics");
  if (!text.ok()) return -1;
  auto v = testing::MetricValue(*text, series);
  return v.ok() ? *v : -1;
}

TEST(KvcdStreamsTest, IdleUploadsAreEndedAndFreeTheirSlots) {
  auto kvcd = StartKvcd(
      {"--stream_idle_seconds=1", "--max_concurrent_streams=4", "--max_streams_per_peer=4"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  const auto requests = testing::MakeRequests(Small("x"), 4096);
  // Four streams send a header and then nothing: every slot is taken.
  std::vector<std::unique_ptr<StalledPut>> stalled;
  for (int i = 0; i < 4; ++i) {
    stalled.push_back(SendHeaderOnly(stub.get(), requests[0], "idle/" + std::to_string(i)));
  }
  // The reaper ends them: the slots come back and an ordinary upload gets through.
  ASSERT_TRUE(testing::WaitForMetric(kvcd->metrics_address(),
                                     "kvc_rejected_requests_total{reason=\"stream_idle\"}", 4,
                                     absl::Seconds(30))
                  .ok());
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 0, absl::Seconds(30))
          .ok());
  for (auto& p : stalled) {
    grpc::Status s = p->writer->Finish();
    EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("--stream_idle_seconds"));
  }
  grpc::Status s = testing::PutCache(stub.get(), Small("after"));
  EXPECT_TRUE(s.ok()) << s.error_message();
  // Nothing of the idle uploads was stored.
  EXPECT_THAT(testing::ViewStore(stub.get()).ids, ::testing::ElementsAre("after"));
}

TEST(KvcdStreamsTest, AnUploadThatKeepsSendingIsNotIdle) {
  auto kvcd = StartKvcd({"--stream_idle_seconds=1.5"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  const auto requests = testing::MakeRequests(Small("slow"), 256);
  ASSERT_GE(requests.size(), 4u);
  grpc::ClientContext ctx;
  kvcache::v1::PutCacheResponse resp;
  auto writer = stub->PutCache(&ctx, &resp);
  // Messages 0.5 s apart: the stream lasts well past the idle time, but is never idle for it.
  for (const auto& r : requests) {
    ASSERT_TRUE(writer->Write(r));
    absl::SleepFor(absl::Milliseconds(500));
  }
  writer->WritesDone();
  grpc::Status s = writer->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST(KvcdStreamsTest, AReaderThatStopsReadingLosesItsLease) {
  auto kvcd = StartKvcd({"--stream_idle_seconds=2", "--store_bytes=12MiB",
                         "--max_cache_bytes=12MiB", "--max_chunk_bytes=16KiB"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  ASSERT_TRUE(testing::PutCache(stub.get(), Big("big1")).ok());
  grpc::ClientContext ctx;
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("big1");
  auto reader = stub->GetCache(&ctx, get);
  kvcache::v1::GetCacheResponse first;
  ASSERT_TRUE(reader->Read(&first));  // then reads nothing more
  {
    grpc::ClientContext c;
    kvcache::v1::DeleteCacheRequest del;
    del.set_cache_id("big1");
    kvcache::v1::DeleteCacheResponse resp;
    ASSERT_TRUE(stub->DeleteCache(&c, del, &resp).ok());
  }
  // The deleted entry's bytes stay charged while the lease lives, so big2 cannot fit; once the
  // idle reader is ended they are freed and the upload gets through.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  grpc::Status put = testing::PutCache(stub.get(), Big("big2"));
  int refused = 0;
  while (!put.ok() && absl::Now() < deadline) {
    ASSERT_EQ(put.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << put.error_message();
    ++refused;
    absl::SleepFor(absl::Milliseconds(100));
    put = testing::PutCache(stub.get(), Big("big2"));
  }
  ASSERT_TRUE(put.ok()) << put.error_message() << " after " << refused << " refusals";
  EXPECT_GE(Metric(*kvcd, "kvc_rejected_requests_total{reason=\"stream_idle\"}"), 1.0);
  EXPECT_THAT(testing::ViewStore(stub.get()).ids, ::testing::ElementsAre("big2"));
  kvcache::v1::GetCacheResponse msg;
  while (reader->Read(&msg)) {
  }
  EXPECT_THAT(reader->Finish().error_code(),
              AnyOf(grpc::StatusCode::CANCELLED, grpc::StatusCode::DEADLINE_EXCEEDED));
}

// Streams whose gaps straddle the idle time, so that the reaper ends some of them just as their
// next message or read arrives: kvcd must neither crash nor leak a slot, and every stream ends
// either normally or with DEADLINE_EXCEEDED / CANCELLED.
TEST(KvcdStreamsTest, ReapingRacesWithTrafficSafely) {
  auto kvcd = StartKvcd({"--stream_idle_seconds=0.3", "--max_concurrent_streams=64",
                         "--max_streams_per_peer=64", "--store_bytes=64MiB",
                         "--max_cache_bytes=16MiB", "--max_chunk_bytes=16KiB"});
  ASSERT_NE(kvcd, nullptr);
  {
    auto stub = testing::NewStub(kvcd->address());
    ASSERT_TRUE(testing::PutCache(stub.get(), Big("read")).ok());
  }
  constexpr int kClients = 12;
  std::vector<std::thread> clients;
  std::vector<std::string> unexpected(kClients);
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto stub = testing::NewStub(kvcd->address());
      for (int round = 0; round < 3; ++round) {
        // Gaps from 0.1 to 0.6 s around the 0.3 s idle time.
        const absl::Duration gap = absl::Milliseconds(100 + 50 * ((c + round) % 11));
        grpc::Status s;
        if (c % 2 == 0) {
          const auto requests = testing::MakeRequests(Small("race/" + std::to_string(c)), 256);
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
          kvcache::v1::PutCacheResponse resp;
          auto writer = stub->PutCache(&ctx, &resp);
          PutCacheRequest header = requests[0];
          header.mutable_header()->set_overwrite(true);
          bool ok = writer->Write(header);
          for (size_t r = 1; ok && r < requests.size(); ++r) {
            absl::SleepFor(gap);
            ok = writer->Write(requests[r]);
          }
          writer->WritesDone();
          s = writer->Finish();
        } else {
          grpc::ClientContext ctx;
          ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
          kvcache::v1::GetCacheRequest get;
          get.set_cache_id("read");
          auto reader = stub->GetCache(&ctx, get);
          kvcache::v1::GetCacheResponse msg;
          for (int n = 0; reader->Read(&msg); ++n) {
            if (n % 64 == 0) absl::SleepFor(gap);
          }
          s = reader->Finish();
        }
        if (!s.ok() && s.error_code() != grpc::StatusCode::DEADLINE_EXCEEDED &&
            s.error_code() != grpc::StatusCode::CANCELLED) {
          unexpected[c] = std::to_string(s.error_code()) + " " + s.error_message();
        }
      }
    });
  }
  for (auto& t : clients) t.join();
  for (const auto& u : unexpected) EXPECT_EQ(u, "");
  ASSERT_TRUE(kvcd->running()) << kvcd->output();
  EXPECT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 0, absl::Seconds(30))
          .ok());
  EXPECT_GT(Metric(*kvcd, "kvc_rejected_requests_total{reason=\"stream_idle\"}"), 0.0);
  auto stub = testing::NewStub(kvcd->address());
  grpc::Status s = testing::PutCache(stub.get(), Small("after"));
  EXPECT_TRUE(s.ok()) << s.error_message();
}

// A DENSE reader that cancels early: kvcd is already exporting the first layer on its I/O pool
// (or the next one, while a layer streams), and the stream's reactor is deleted before that
// export ends. The export must not read the deleted reactor (it once read its RoPE setting: a use
// after free, which the sanitizer stage's kvcd reports as a crash and a release kvcd may crash
// on).
TEST(KvcdStreamsTest, ADenseReaderCancellingMidLayerLeavesTheNextExportSafe) {
  auto kvcd = StartKvcd({"--store_bytes=64MiB", "--max_cache_bytes=32MiB",
                         "--max_chunk_bytes=64KiB"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  // 4 layers of 8 MiB (K + V, f16): each export takes long enough to outlive the stream.
  const TestCache cache = testing::MakeTestCache(
      "dense", testing::Shape(4, 4, 4, 128, 4096, 0), kvcache::v1::DTYPE_F16,
      kvcache::v1::LAYOUT_HND, 11);
  ASSERT_TRUE(testing::PutCache(stub.get(), cache).ok());
  // Reads a DENSE copy of the cache: `take` messages then a cancel, or (take < 0) all of it.
  // Returns the stream's status; *messages counts what was read.
  auto read_dense = [&](int take, int* messages) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    kvcache::v1::GetCacheRequest get;
    get.set_cache_id("dense");
    get.set_format(kvcache::v1::FORMAT_DENSE);
    auto reader = stub->GetCache(&ctx, get);
    kvcache::v1::GetCacheResponse msg;
    *messages = 0;
    while ((take < 0 || *messages < take) && reader->Read(&msg)) ++*messages;
    if (take >= 0) ctx.TryCancel();
    while (reader->Read(&msg)) {
    }
    return reader->Finish();
  };
  constexpr int kRounds = 30;
  int messages = 0;
  for (int round = 0; round < kRounds; ++round) {
    // Nothing, the info message (layer 0 is exporting), or data of layer 0 (layer 1 is).
    const grpc::Status cancelled = read_dense(round % 3, &messages);
    ASSERT_EQ(cancelled.error_code(), grpc::StatusCode::CANCELLED)
        << "round " << round << ": " << cancelled.error_message() << "\nkvcd:\n"
        << kvcd->OutputTail(4096);
  }
  // Every abandoned export has run to its end by the time a full read is done (same pool).
  const grpc::Status s = read_dense(-1, &messages);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_GT(messages, 4);
  EXPECT_TRUE(kvcd->CheckAlive().ok()) << kvcd->output();
}

class KvcdPeerShareTest : public ::testing::Test {
 protected:
  static constexpr char kTokenA[] = "token-alpha-0123456789";
  static constexpr char kTokenB[] = "token-beta-9876543210";
  void SetUp() override {
    tokens_ = ::testing::TempDir() + "/kvcd_peer_tokens_" + std::to_string(getpid());
    std::ofstream(tokens_) << kTokenA << " alpha\n" << kTokenB << " beta\n";
  }
  void TearDown() override { std::remove(tokens_.c_str()); }
  std::string tokens_;
};

TEST_F(KvcdPeerShareTest, OneTenantCannotTakeEverySlot) {
  auto kvcd = StartKvcd({"--auth_tokens_file=" + tokens_, "--max_concurrent_streams=8",
                         "--max_streams_per_peer=2", "--stream_idle_seconds=120"});
  ASSERT_NE(kvcd, nullptr);
  auto a = testing::NewStub(kvcd->address(), kTokenA);
  auto b = testing::NewStub(kvcd->address(), kTokenB);
  const auto requests = testing::MakeRequests(Small("x"), 4096);
  std::vector<std::unique_ptr<StalledPut>> held;
  for (int i = 0; i < 2; ++i)
    held.push_back(SendHeaderOnly(a.get(), requests[0], "a" + std::to_string(i)));
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 2, absl::Seconds(30))
          .ok());
  // Alpha's third stream is refused, naming the limit; beta still gets through.
  grpc::Status s = testing::PutCache(a.get(), Small("a2"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("--max_streams_per_peer=2"));
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("a2");
  testing::Fetched f;
  EXPECT_EQ(testing::Get(a.get(), get, &f).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  s = testing::PutCache(b.get(), Small("b0"));
  EXPECT_TRUE(s.ok()) << s.error_message();
  get.set_cache_id("b0");
  s = testing::Get(b.get(), get, &f);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_GE(Metric(*kvcd, "kvc_rejected_requests_total{reason=\"peer_streams\"}"), 2.0);
  // Alpha's slots come back when its streams end.
  for (auto& p : held) {
    p->ctx.TryCancel();
    p->writer->Finish();
  }
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 0, absl::Seconds(30))
          .ok());
  s = testing::PutCache(a.get(), Small("a2"));
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST(KvcdStreamsTest, WithoutTokensThePeerIsTheClientAddress) {
  auto kvcd = StartKvcd(
      {"--max_concurrent_streams=8", "--max_streams_per_peer=2", "--stream_idle_seconds=120"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = testing::NewStub(kvcd->address());
  const auto requests = testing::MakeRequests(Small("x"), 4096);
  std::vector<std::unique_ptr<StalledPut>> held;
  std::vector<std::unique_ptr<kvcache::v1::KvCache::Stub>> others;
  // Two connections from 127.0.0.1 share one peer's share.
  for (int i = 0; i < 2; ++i) {
    others.push_back(testing::NewStub(kvcd->address()));
    held.push_back(SendHeaderOnly(others.back().get(), requests[0], "p" + std::to_string(i)));
  }
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 2, absl::Seconds(30))
          .ok());
  grpc::Status s = testing::PutCache(stub.get(), Small("p2"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("from 127.0.0.1 (--max_streams_per_peer=2)"));
  for (auto& p : held) {
    p->ctx.TryCancel();
    p->writer->Finish();
  }
}

// kvcd's resident memory (VmRSS), in bytes; -1 when unreadable.
int64_t ResidentBytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    long long kib = 0;
    if (std::sscanf(line.c_str(), "VmRSS: %lld kB", &kib) == 1) return kib * 1024;
  }
  return -1;
}

// The bound deploy/OPERATIONS.md states: resident memory <= store + staging + buffer pool + a
// fixed overhead (binary, threads, gRPC buffers of the open streams); 128 MiB covers kvcd with
// this test's 16 streams of at most 1 MiB messages (an idle kvcd takes about 30 MiB).
TEST(KvcdStreamsTest, StalledUploadsCannotStageMoreThanTheBudget) {
  constexpr int64_t kMiB = 1 << 20;
  constexpr int64_t kStore = 64 * kMiB, kStaging = 72 * kMiB, kPool = 32 * kMiB;
  constexpr int64_t kFixed = 128 * kMiB;
  auto kvcd = StartKvcd({"--store_bytes=64MiB", "--staging_bytes=72MiB", "--max_cache_bytes=33MiB",
                         "--buffer_pool_bytes=32MiB", "--stream_idle_seconds=2",
                         "--max_concurrent_streams=64", "--max_streams_per_peer=64"});
  ASSERT_NE(kvcd, nullptr);
  ASSERT_GT(ResidentBytes(kvcd->pid()), 0) << "no /proc/PID/status";
  std::atomic<int64_t> peak{0};
  std::atomic<bool> stop{false};
  std::thread sampler([&] {
    while (!stop) {
      peak = std::max<int64_t>(peak, ResidentBytes(kvcd->pid()));
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  // 1 layer of 16 MiB K + 16 MiB V + 32 KiB Q_obs, compressed (so it is staged, and the engine
  // scratch its spec needs, about 2.5 MiB, is reserved with it): two uploads fit the staging
  // budget, a third does not.
  TestCache cache = testing::MakeTestCache("stalled", testing::Shape(1, 8, 8, 128, 8192, 16),
                                           kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 11);
  *cache.header.mutable_compression() = testing::FullCompression();
  std::vector<PutCacheRequest> requests = testing::MakeRequests(cache, 1 << 20);
  // All but the last KiB: the last chunk loses its final KiB and is never completed.
  PutCacheRequest& last = requests.back();
  last.mutable_data()->resize(last.data().size() - 1024);

  constexpr int kUploads = 16;
  std::vector<grpc::Status> status(kUploads);
  std::vector<std::thread> clients;
  for (int i = 0; i < kUploads; ++i) {
    clients.emplace_back([&, i] {
      auto stub = testing::NewStub(kvcd->address());
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      kvcache::v1::PutCacheResponse resp;
      auto writer = stub->PutCache(&ctx, &resp);
      PutCacheRequest header = requests[0];
      header.mutable_header()->set_cache_id("stalled/" + std::to_string(i));
      bool sent = writer->Write(header);
      for (size_t r = 1; sent && r < requests.size(); ++r) sent = writer->Write(requests[r]);
      // Then nothing, until kvcd ends the stream (refused at the header, or idle).
      status[i] = writer->Finish();
    });
  }
  for (auto& t : clients) t.join();
  // Every upload ended: two fit the staging budget and were ended as idle, the rest refused.
  int idle = 0, refused = 0;
  for (const auto& s : status) {
    if (s.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
      ++idle;
      EXPECT_THAT(s.error_message(), HasSubstr("--stream_idle_seconds"));
    } else {
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      EXPECT_THAT(s.error_message(), HasSubstr("--staging_bytes=75497472"));
      ++refused;
    }
  }
  EXPECT_EQ(idle, 2);
  EXPECT_EQ(refused, kUploads - 2);
  EXPECT_EQ(Metric(*kvcd, "kvc_rejected_requests_total{reason=\"staging\"}"), kUploads - 2);
  EXPECT_EQ(Metric(*kvcd, "kvc_staging_capacity_bytes"), kStaging);
  // The staging comes back once kvcd has dropped the ended uploads (just after their clients saw
  // the end): then an upload of the same size is accepted and stored.
  EXPECT_TRUE(testing::WaitForMetric(kvcd->metrics_address(), "kvc_staging_reserved_bytes", 0,
                                     absl::Seconds(60))
                  .ok())
      << "staging still reserved: " << Metric(*kvcd, "kvc_staging_reserved_bytes");
  auto stub = testing::NewStub(kvcd->address());
  cache.header.set_cache_id("after");
  grpc::Status s = testing::Put(stub.get(), testing::MakeRequests(cache, 1 << 20), nullptr);
  EXPECT_TRUE(s.ok()) << s.error_message();
  stop = true;
  sampler.join();
  const int64_t bound = kStore + kStaging + kPool + kFixed;
  EXPECT_LE(peak.load(), bound) << "peak RSS " << peak / kMiB << " MiB over the bound "
                                << bound / kMiB << " MiB";
  std::printf("kvcd peak RSS %lld MiB (bound %lld MiB)\n", static_cast<long long>(peak / kMiB),
              static_cast<long long>(bound / kMiB));
}

}  // namespace
}  // namespace kvc

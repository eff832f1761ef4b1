// The transfer service's limits against a real kvcd: Transfer and Fetch streams take
// --max_concurrent_streams slots like PutCache and GetCache, an open stream that sends nothing
// holds no kvcd thread and is ended after the idle time, and a session is its opener's alone
// and expires when unused.
#include <dirent.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvcache/v1/transfer.grpc.pb.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using kvcache::v1::FetchRequest;
using kvcache::v1::FetchResponse;
using kvcache::v1::KvCacheTransfer;
using kvcache::v1::OpenTransferSessionRequest;
using kvcache::v1::OpenTransferSessionResponse;
using kvcache::v1::TransferAck;
using kvcache::v1::TransferAnnouncement;
using testing::KvcdProcess;

// The threads of process `pid` (its /proc/PID/task entries).
int Threads(pid_t pid) {
  DIR* d = opendir(absl::StrCat("/proc/", pid, "/task").c_str());
  if (d == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

std::unique_ptr<KvcdProcess> StartKvcd(std::vector<std::string> flags) {
  KvcdProcess::Options o;
  o.binary = KVCD_PATH;
  o.flags = {"--backend=cpu", "--transfer=auto"};
  o.flags.insert(o.flags.end(), flags.begin(), flags.end());
  auto k = KvcdProcess::Start(o);
  EXPECT_TRUE(k.ok()) << k.status();
  return k.ok() ? *std::move(k) : nullptr;
}

// A Transfer stream that never sends anything.
struct IdleTransfer {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<TransferAnnouncement, TransferAck>> s;
  explicit IdleTransfer(KvCacheTransfer::Stub* stub) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
    s = stub->Transfer(&ctx);
  }
  grpc::Status End() {
    s->WritesDone();
    TransferAck ack;
    while (s->Read(&ack)) {
    }
    return s->Finish();
  }
};

std::string Started(const char* method) {
  return absl::StrCat(R"(grpc_server_started_total{grpc_method=")", method, R"("})");
}

// Before: each such stream was a sync handler parked on a kvcd thread (300 streams, 318 threads),
// and none of them counted as a stream.
TEST(TransferLimitsKvcdTest, IdleTransferStreamsHoldNoThreads) {
  auto kvcd = StartKvcd({"--max_concurrent_streams=400"});
  ASSERT_NE(kvcd, nullptr);
  auto channel = grpc::CreateChannel(kvcd->address(), grpc::InsecureChannelCredentials());
  auto stub = KvCacheTransfer::NewStub(channel);
  {
    IdleTransfer warm(stub.get());  // gRPC's own threads start with the first calls
    EXPECT_TRUE(warm.End().ok());
  }
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 0, absl::Seconds(30))
          .ok());
  const int before = Threads(kvcd->pid());
  ASSERT_GT(before, 0);
  constexpr int kStreams = 300;
  std::vector<std::unique_ptr<IdleTransfer>> streams;
  for (int i = 0; i < kStreams; ++i) streams.push_back(std::make_unique<IdleTransfer>(stub.get()));
  // Every stream reached kvcd, and each holds a slot.
  const absl::Status started = testing::WaitForMetric(kvcd->metrics_address(), Started("Transfer"),
                                                      kStreams + 1, absl::Seconds(60));
  ASSERT_TRUE(started.ok()) << started;
  const absl::Status counted = testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams",
                                                      kStreams, absl::Seconds(30));
  EXPECT_TRUE(counted.ok()) << counted;
  const int during = Threads(kvcd->pid());
  std::printf("kvcd threads: %d before, %d with %d idle Transfer streams\n", before, during,
              kStreams);
  // gRPC may add a few threads of its own under load; one per stream it must not.
  EXPECT_LT(during - before, 40) << before << " -> " << during;
  for (auto& s : streams) EXPECT_TRUE(s->End().ok());
  EXPECT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 0, absl::Seconds(30))
          .ok());
}

TEST(TransferLimitsKvcdTest, TransferAndFetchCountAgainstMaxConcurrentStreams) {
  auto kvcd = StartKvcd({"--max_concurrent_streams=3"});
  ASSERT_NE(kvcd, nullptr);
  auto channel = grpc::CreateChannel(kvcd->address(), grpc::InsecureChannelCredentials());
  auto stub = KvCacheTransfer::NewStub(channel);
  auto kv = testing::NewStub(kvcd->address());
  std::vector<std::unique_ptr<IdleTransfer>> held;
  for (int i = 0; i < 3; ++i) held.push_back(std::make_unique<IdleTransfer>(stub.get()));
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 3, absl::Seconds(30))
          .ok());

  IdleTransfer fourth(stub.get());
  const grpc::Status t = fourth.End();
  EXPECT_EQ(t.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << t.error_message();
  EXPECT_NE(t.error_message().find("--max_concurrent_streams=3"), std::string::npos);
  {
    grpc::ClientContext ctx;
    auto f = stub->Fetch(&ctx);
    f->WritesDone();
    FetchResponse r;
    while (f->Read(&r)) {
    }
    EXPECT_EQ(f->Finish().error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  }
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("absent");
  testing::Fetched fetched;
  EXPECT_EQ(testing::Get(kv.get(), get, &fetched).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED);

  // A slot given back is usable again, by any kind of stream.
  EXPECT_TRUE(held.back()->End().ok());
  held.pop_back();
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 2, absl::Seconds(30))
          .ok());
  EXPECT_EQ(testing::Get(kv.get(), get, &fetched).error_code(), grpc::StatusCode::NOT_FOUND);
  for (auto& s : held) EXPECT_TRUE(s->End().ok());
}

// A stream slot cannot be held forever by a client that opens a stream and sends nothing.
TEST(TransferLimitsKvcdTest, SilentStreamsAreEndedAndGiveTheirSlotBack) {
  auto kvcd = StartKvcd({"--max_concurrent_streams=2", "--transfer_session_idle_seconds=1"});
  ASSERT_NE(kvcd, nullptr);
  auto channel = grpc::CreateChannel(kvcd->address(), grpc::InsecureChannelCredentials());
  auto stub = KvCacheTransfer::NewStub(channel);
  IdleTransfer silent(stub.get());
  grpc::ClientContext fetch_ctx;
  fetch_ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  auto fetch = stub->Fetch(&fetch_ctx);
  ASSERT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 2, absl::Seconds(30))
          .ok());
  // kvcd ends both about a second later (the client's own deadline is two minutes away).
  const absl::Time start = absl::Now();
  TransferAck ack;
  EXPECT_FALSE(silent.s->Read(&ack));
  const grpc::Status t = silent.s->Finish();
  FetchResponse r;
  EXPECT_FALSE(fetch->Read(&r));
  const grpc::Status f = fetch->Finish();
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));
  EXPECT_EQ(t.error_code(), grpc::StatusCode::CANCELLED) << t.error_message();
  EXPECT_EQ(f.error_code(), grpc::StatusCode::CANCELLED) << f.error_message();
  EXPECT_TRUE(
      testing::WaitForMetric(kvcd->metrics_address(), "kvc_active_streams", 0, absl::Seconds(30))
          .ok());
  EXPECT_TRUE(
      testing::WaitForMetric(
          kvcd->metrics_address(),
          R"(grpc_server_handled_total{grpc_code="DEADLINE_EXCEEDED",grpc_method="Transfer"})", 1,
          absl::Seconds(30))
          .ok());
}

grpc::Status OpenSession(KvCacheTransfer::Stub* stub, const std::string& client,
                         OpenTransferSessionResponse* resp, const std::string& secret = "") {
  OpenTransferSessionRequest req;
  req.set_client_id(client);
  req.set_transport(kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
  req.set_session_secret(secret);
  grpc::ClientContext ctx;
  return stub->OpenTransferSession(&ctx, req, resp);
}

// Before: re-opening a client id returned its session (id included), which anyone could then
// close or feed.
TEST(TransferLimitsKvcdTest, OpeningAKnownClientIdRevealsNothing) {
  auto kvcd = StartKvcd({});
  ASSERT_NE(kvcd, nullptr);
  auto stub = KvCacheTransfer::NewStub(
      grpc::CreateChannel(kvcd->address(), grpc::InsecureChannelCredentials()));
  OpenTransferSessionResponse owner, intruder;
  ASSERT_TRUE(OpenSession(stub.get(), "prefill-7", &owner).ok());
  const grpc::Status st = OpenSession(stub.get(), "prefill-7", &intruder);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();
  EXPECT_TRUE(intruder.session_id().empty());
  kvcache::v1::CloseTransferSessionRequest close;
  close.set_client_id("prefill-7");
  close.set_session_id(owner.session_id());
  kvcache::v1::CloseTransferSessionResponse resp;
  {
    grpc::ClientContext ctx;
    EXPECT_EQ(stub->CloseTransferSession(&ctx, close, &resp).error_code(),
              grpc::StatusCode::PERMISSION_DENIED);
  }
  OpenTransferSessionResponse again;
  ASSERT_TRUE(OpenSession(stub.get(), "prefill-7", &again, owner.session_secret()).ok());
  EXPECT_TRUE(again.reused());
  close.set_session_secret(owner.session_secret());
  grpc::ClientContext ctx;
  EXPECT_TRUE(stub->CloseTransferSession(&ctx, close, &resp).ok());
}

// Before: 64 opens with new client ids filled the session table for good.
TEST(TransferLimitsKvcdTest, UnusedSessionsExpireAndFreeTheTable) {
  auto kvcd = StartKvcd({"--transfer_max_sessions=4", "--transfer_session_idle_seconds=1"});
  ASSERT_NE(kvcd, nullptr);
  auto stub = KvCacheTransfer::NewStub(
      grpc::CreateChannel(kvcd->address(), grpc::InsecureChannelCredentials()));
  OpenTransferSessionResponse r;
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(OpenSession(stub.get(), absl::StrCat("c", i), &r).ok());
  EXPECT_EQ(r.idle_timeout_seconds(), 1u);
  const grpc::Status full = OpenSession(stub.get(), "late", &r);
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << full.error_message();
  // Once the four have been idle for a second, there is room again.
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  grpc::Status late;
  do {
    absl::SleepFor(absl::Milliseconds(200));
    late = OpenSession(stub.get(), "late", &r);
  } while (!late.ok() && absl::Now() < give_up);
  EXPECT_TRUE(late.ok()) << late.error_message();
}

}  // namespace
}  // namespace kvc

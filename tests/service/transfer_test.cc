// The transfer control plane over real gRPC on loopback, with an in-process fake data plane (two
// endpoints joined through a shared queue): session creation and caching per client id, the
// announce / POSTED / send / RECEIVED sequence, rejection of duplicate, out-of-order and
// mis-sized announcements (a repeated tensor is the sink's to refuse), teardown, limits, the
// fallback to gRPC bytes, and a long-lived session's memory staying bounded.
#include "kvc/transfer.h"

#include <atomic>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/transfer_client.h"
#include "kvcache/v1/transfer.grpc.pb.h"
#include "testing/fake_communicator.h"
#include "testing/gate.h"
#include "transfer/transfer_sessions.h"

namespace kvc::transfer {
namespace {

using kvcache::v1::KvCacheTransfer;
using kvcache::v1::OpenTransferSessionRequest;
using kvcache::v1::OpenTransferSessionResponse;
using kvcache::v1::TransferAck;
using kvcache::v1::TransferAnnouncement;

using testing::FakeFactory;
using testing::Gate;

// The secrets of the sessions this test opened, by session id, so announcements can carry them.
std::map<std::string, std::string>& Secrets() {
  static auto* secrets = new std::map<std::string, std::string>();
  return *secrets;
}
void Remember(const OpenTransferSessionResponse& r) {
  Secrets()[r.session_id()] = r.session_secret();
}

struct Received {
  TensorHeader header;
  std::vector<uint8_t> bytes;
};

class RecordingSink final : public TransferSink {
 public:
  absl::Status Consume(const TensorHeader& h, absl::Span<const uint8_t> bytes) override {
    std::shared_ptr<Gate> gate;
    {
      absl::MutexLock lock(&mu_);
      gate = gate_;
    }
    if (gate) gate->Pass();
    absl::MutexLock lock(&mu_);
    if (throw_) throw std::bad_alloc();  // as an allocation the sink could not make
    if (!fail_.ok()) return fail_;
    got_.push_back({h, std::vector<uint8_t>(bytes.begin(), bytes.end())});
    return absl::OkStatus();
  }
  std::vector<Received> got() {
    absl::MutexLock lock(&mu_);
    return got_;
  }
  void Fail(absl::Status s) {
    absl::MutexLock lock(&mu_);
    fail_ = std::move(s);
  }
  void Throw(bool on) {
    absl::MutexLock lock(&mu_);
    throw_ = on;
  }
  // From now on every tensor waits at the returned gate until it is opened.
  std::shared_ptr<Gate> Hold() {
    absl::MutexLock lock(&mu_);
    gate_ = std::make_shared<Gate>();
    return gate_;
  }

 private:
  absl::Mutex mu_;
  std::shared_ptr<Gate> gate_ ABSL_GUARDED_BY(mu_);
  bool throw_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<Received> got_ ABSL_GUARDED_BY(mu_);
  absl::Status fail_ ABSL_GUARDED_BY(mu_);
};

// ---- fixture: a real gRPC server on an ephemeral loopback port ----

class TransferTest : public ::testing::Test {
 protected:
  void Start(TransferLimits limits = {}, bool enable_nccl = true) {
    limits.join_timeout = std::min(limits.join_timeout, absl::Seconds(5));
    limits.recv_timeout = std::min(limits.recv_timeout, absl::Seconds(5));
    TransferServiceOptions o;
    o.limits = limits;
    o.enable_nccl = enable_nccl;
    o.factory = &server_factory_;
    o.sink = &sink_;
    service_ = CreateTransferService(o).value();
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    ASSERT_GT(port, 0);
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    stub_ = KvCacheTransfer::NewStub(channel_);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  grpc::Status Open(const std::string& client, kvcache::v1::TransferTransport t,
                    OpenTransferSessionResponse* resp, const std::string& secret = "") {
    OpenTransferSessionRequest req;
    req.set_client_id(client);
    req.set_transport(t);
    req.set_session_secret(secret);
    grpc::ClientContext ctx;
    grpc::Status st = stub_->OpenTransferSession(&ctx, req, resp);
    if (st.ok()) Remember(*resp);
    return st;
  }

  TransferClient::Options ClientOptions(const std::string& id, bool with_factory = true) {
    TransferClient::Options o;
    o.client_id = id;
    o.factory = with_factory ? &server_factory_ : nullptr;  // the fake hub serves both sides
    o.join_timeout = absl::Seconds(5);
    o.send_timeout = absl::Seconds(5);
    return o;
  }

  FakeFactory server_factory_;
  RecordingSink sink_;
  std::unique_ptr<grpc::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<KvCacheTransfer::Stub> stub_;
};

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 31);
  return v;
}

TEST_F(TransferTest, NcclSessionsAreCreatedAndCachedPerClient) {
  Start();
  OpenTransferSessionResponse a, b, c;
  ASSERT_TRUE(Open("client-a", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &a).ok());
  EXPECT_FALSE(a.session_id().empty());
  EXPECT_FALSE(a.nccl_unique_id().empty());
  EXPECT_EQ(a.server_rank(), 0);
  EXPECT_EQ(a.client_rank(), 1);
  EXPECT_FALSE(a.reused());
  EXPECT_EQ(a.transport(), kvcache::v1::TRANSFER_TRANSPORT_NCCL);
  EXPECT_EQ(a.session_secret().size(), 16u);
  ASSERT_TRUE(
      Open("client-a", kvcache::v1::TRANSFER_TRANSPORT_UNSPECIFIED, &b, a.session_secret()).ok());
  EXPECT_TRUE(b.reused());
  EXPECT_EQ(b.session_id(), a.session_id());
  EXPECT_EQ(b.nccl_unique_id(), a.nccl_unique_id());
  ASSERT_TRUE(Open("client-b", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &c).ok());
  EXPECT_FALSE(c.reused());
  EXPECT_NE(c.session_id(), a.session_id());
  EXPECT_NE(c.nccl_unique_id(), a.nccl_unique_id());
}

TEST_F(TransferTest, ClientSendsLayersOverTheDataPlaneInSequence) {
  Start();
  TransferClient client(channel_, ClientOptions("prefill-0"));
  ASSERT_TRUE(client.Open().ok());
  EXPECT_EQ(client.transport(), kvcache::v1::TRANSFER_TRANSPORT_NCCL);
  EXPECT_EQ(client.fallback_reason(), "");
  std::vector<std::vector<uint8_t>> sent;
  for (uint32_t layer = 0; layer < 3; ++layer) {
    for (auto kind : {kvcache::v1::TENSOR_K, kvcache::v1::TENSOR_V}) {
      sent.push_back(Bytes(1000 + layer * 7 + kind, static_cast<uint8_t>(layer * 2 + kind)));
      const absl::Status s =
          client.Send("cache-1", layer, kind, sent.back().data(), sent.back().size());
      ASSERT_TRUE(s.ok()) << s;
    }
  }
  const std::vector<Received> got = sink_.got();
  ASSERT_EQ(got.size(), 6u);
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(got[i].header.sequence, i);
    EXPECT_EQ(got[i].header.client_id, "prefill-0");
    EXPECT_EQ(got[i].header.cache_id, "cache-1");
    EXPECT_EQ(got[i].header.layer, i / 2);
    EXPECT_EQ(got[i].bytes, sent[i]) << "tensor " << i;
  }
  EXPECT_TRUE(client.Close().ok());
}

TEST_F(TransferTest, ReopenedClientContinuesTheSequenceOnTheCachedGroup) {
  Start();
  TransferClient client(channel_, ClientOptions("c"));
  ASSERT_TRUE(client.Open().ok());
  const std::vector<uint8_t> x = Bytes(64, 1);
  ASSERT_TRUE(client.Send("k", 0, kvcache::v1::TENSOR_K, x.data(), x.size()).ok());
  const int joins = server_factory_.joins();
  // A second open of the same client id reuses the server's session: nobody joins again.
  OpenTransferSessionResponse r;
  ASSERT_TRUE(Open("c", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &r, client.session_secret()).ok());
  EXPECT_TRUE(r.reused());
  EXPECT_EQ(r.next_sequence(), 1u);
  EXPECT_EQ(server_factory_.joins(), joins);
  ASSERT_TRUE(client.Send("k", 0, kvcache::v1::TENSOR_V, x.data(), x.size()).ok());
  EXPECT_EQ(sink_.got().size(), 2u);
}

// Raw stream helpers for the rejection cases.
struct RawStream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<TransferAnnouncement, TransferAck>> s;
};

TransferAnnouncement Announce(const std::string& session, uint64_t seq, const std::string& cache,
                              uint32_t layer, kvcache::v1::TensorKind kind, uint64_t n,
                              const std::string& payload) {
  TransferAnnouncement a;
  a.set_session_id(session);
  if (auto it = Secrets().find(session); it != Secrets().end()) a.set_session_secret(it->second);
  a.set_sequence(seq);
  a.set_cache_id(cache);
  a.set_layer(layer);
  a.set_tensor(kind);
  a.set_num_bytes(n);
  a.set_payload(payload);
  return a;
}

// Sends `a`, expects RECEIVED.
void ExpectReceived(RawStream* rs, const TransferAnnouncement& a) {
  ASSERT_TRUE(rs->s->Write(a));
  TransferAck ack;
  ASSERT_TRUE(rs->s->Read(&ack));
  EXPECT_EQ(ack.sequence(), a.sequence());
  EXPECT_EQ(ack.state(), TransferAck::STATE_RECEIVED);
  EXPECT_EQ(ack.received_bytes(), a.num_bytes());
}

// Sends `a`, expects the stream to end with `code` and a message containing `field`.
void ExpectRejected(RawStream* rs, const TransferAnnouncement& a, grpc::StatusCode code,
                    const std::string& field) {
  rs->s->Write(a);
  TransferAck ack;
  EXPECT_FALSE(rs->s->Read(&ack)) << "got an ack for a bad announcement";
  const grpc::Status st = rs->s->Finish();
  EXPECT_EQ(st.error_code(), code) << st.error_message();
  EXPECT_NE(st.error_message().find(field), std::string::npos) << st.error_message();
}

class TransferRejectTest : public TransferTest {
 protected:
  void SetUp() override {
    TransferLimits l;
    l.max_tensor_bytes = 4096;
    Start(l);
    ASSERT_TRUE(Open("bytes-client", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &open_).ok());
  }
  std::unique_ptr<RawStream> Stream() {
    auto rs = std::make_unique<RawStream>();
    rs->s = stub_->Transfer(&rs->ctx);
    return rs;
  }
  OpenTransferSessionResponse open_;
};

TEST_F(TransferRejectTest, DuplicateSequenceIsRejected) {
  auto rs = Stream();
  ExpectReceived(rs.get(),
                 Announce(open_.session_id(), 0, "c", 0, kvcache::v1::TENSOR_K, 3, "abc"));
  ExpectRejected(rs.get(), Announce(open_.session_id(), 0, "c", 1, kvcache::v1::TENSOR_K, 3, "abc"),
                 grpc::StatusCode::INVALID_ARGUMENT, "sequence");
  EXPECT_EQ(sink_.got().size(), 1u);
}

// While one stream of a session transfers, one more may wait for it; a further one is refused at
// once (UNAVAILABLE) instead of parking a transfer worker, so one client cannot park them all.
TEST_F(TransferRejectTest, ASessionParksAtMostOneStreamBehindTheOneTransferring) {
  const std::string sid = open_.session_id();
  std::shared_ptr<Gate> gate = sink_.Hold();
  auto first = Stream();
  ASSERT_TRUE(first->s->Write(Announce(sid, 0, "c", 0, kvcache::v1::TENSOR_K, 3, "abc")));
  ASSERT_TRUE(gate->WaitEntered(absl::Seconds(30)));  // its worker holds the session's I/O
  struct Outcome {
    bool acked = false;
    TransferAck ack;
    grpc::Status status;
    absl::Notification done;
  };
  std::unique_ptr<RawStream> more[2];
  Outcome out[2];
  std::thread readers[2];
  for (int i = 0; i < 2; ++i) {
    more[i] = std::make_unique<RawStream>();
    more[i]->ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    more[i]->s = stub_->Transfer(&more[i]->ctx);
    ASSERT_TRUE(more[i]->s->Write(Announce(sid, 1, "c", 1, kvcache::v1::TENSOR_K, 3, "def")));
    readers[i] = std::thread([&, i] {
      out[i].acked = more[i]->s->Read(&out[i].ack);
      if (!out[i].acked) out[i].status = more[i]->s->Finish();
      out[i].done.Notify();
    });
  }
  // One of the two is refused while the first still holds the session (the gate is closed).
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  int refused = -1;
  while (refused < 0 && absl::Now() < deadline) {
    for (int i = 0; i < 2; ++i) {
      if (out[i].done.HasBeenNotified()) refused = i;
    }
    absl::SleepFor(absl::Milliseconds(5));
  }
  gate->Open();
  TransferAck ack;
  EXPECT_TRUE(first->s->Read(&ack));
  EXPECT_EQ(ack.state(), TransferAck::STATE_RECEIVED);
  for (std::thread& t : readers) t.join();
  ASSERT_GE(refused, 0) << "no stream was refused while the session was busy";
  EXPECT_FALSE(out[refused].acked);
  EXPECT_EQ(out[refused].status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << out[refused].status.error_message();
  EXPECT_NE(out[refused].status.error_message().find("busy"), std::string::npos);
  // The one that waited carries the next tensor once the first is done.
  const Outcome& waited = out[1 - refused];
  EXPECT_TRUE(waited.acked) << waited.status.error_message();
  EXPECT_EQ(waited.ack.sequence(), 1u);
  EXPECT_EQ(waited.ack.state(), TransferAck::STATE_RECEIVED);
  EXPECT_EQ(sink_.got().size(), 2u);
}

TEST_F(TransferRejectTest, OutOfOrderSequenceIsRejected) {
  auto rs = Stream();
  ExpectRejected(rs.get(), Announce(open_.session_id(), 5, "c", 0, kvcache::v1::TENSOR_K, 3, "abc"),
                 grpc::StatusCode::INVALID_ARGUMENT, "out of order");
  EXPECT_TRUE(sink_.got().empty());
}

// The session keeps no record of carried tensors (a re-upload of a cache id repeats them all): a
// repeated tensor reaches the sink, and the sink's refusal ends the stream with its status.
TEST_F(TransferRejectTest, RepeatedTensorIsRejectedByTheSink) {
  auto rs = Stream();
  ExpectReceived(rs.get(), Announce(open_.session_id(), 0, "c", 2, kvcache::v1::TENSOR_V, 1, "x"));
  ExpectReceived(rs.get(), Announce(open_.session_id(), 1, "c", 2, kvcache::v1::TENSOR_V, 1, "y"));
  ASSERT_EQ(sink_.got().size(), 2u);
  EXPECT_EQ(sink_.got()[1].header.sequence, 1u);
  EXPECT_EQ(sink_.got()[1].bytes, std::vector<uint8_t>{'y'});
  sink_.Fail(absl::InvalidArgumentError("chunk: layer 2 tensor V bytes [0, 1) already received"));
  ExpectRejected(rs.get(), Announce(open_.session_id(), 2, "c", 2, kvcache::v1::TENSOR_V, 1, "z"),
                 grpc::StatusCode::INVALID_ARGUMENT, "already received");
  EXPECT_EQ(sink_.got().size(), 2u);
}

TEST_F(TransferRejectTest, SizeMismatchAndBadFieldsAreRejected) {
  const std::string sid = open_.session_id();
  struct Bad {
    TransferAnnouncement a;
    std::string field;
  };
  const Bad cases[] = {
      {Announce(sid, 0, "c", 0, kvcache::v1::TENSOR_K, 5, "abc"), "payload"},
      {Announce(sid, 0, "c", 0, kvcache::v1::TENSOR_K, 0, ""), "num_bytes"},
      {Announce(sid, 0, "c", 0, kvcache::v1::TENSOR_K, 4097, std::string(4097, 'x')), "num_bytes"},
      {Announce(sid, 0, "", 0, kvcache::v1::TENSOR_K, 1, "x"), "cache_id"},
      {Announce(sid, 0, "c", 0, kvcache::v1::TENSOR_UNSPECIFIED, 1, "x"), "tensor"},
  };
  for (const Bad& b : cases) {
    auto rs = Stream();
    ExpectRejected(rs.get(), b.a, grpc::StatusCode::INVALID_ARGUMENT, b.field);
  }
  auto rs = Stream();
  ExpectRejected(rs.get(), Announce("nope", 0, "c", 0, kvcache::v1::TENSOR_K, 1, "x"),
                 grpc::StatusCode::NOT_FOUND, "session_id");
  EXPECT_TRUE(sink_.got().empty());
  // Nothing was consumed: sequence 0 is still the next one.
  auto ok = Stream();
  ExpectReceived(ok.get(), Announce(sid, 0, "c", 0, kvcache::v1::TENSOR_K, 1, "x"));
}

TEST_F(TransferTest, NcclSenderSizeMismatchFailsTheTensorAndDropsTheGroup) {
  Start();
  OpenTransferSessionResponse r;
  ASSERT_TRUE(Open("m", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &r).ok());
  std::unique_ptr<Communicator> peer =
      server_factory_.Join(r.nccl_unique_id(), 1, absl::Seconds(5), nullptr).value();
  RawStream rs;
  rs.s = stub_->Transfer(&rs.ctx);
  ASSERT_TRUE(rs.s->Write(Announce(r.session_id(), 0, "c", 0, kvcache::v1::TENSOR_K, 100, "")));
  TransferAck ack;
  ASSERT_TRUE(rs.s->Read(&ack));
  EXPECT_EQ(ack.state(), TransferAck::STATE_POSTED);
  const std::vector<uint8_t> half = Bytes(50, 3);
  ASSERT_TRUE(peer->Send(half.data(), half.size(), absl::Seconds(1)).ok());
  EXPECT_FALSE(rs.s->Read(&ack));
  const grpc::Status st = rs.s->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DATA_LOSS) << st.error_message();
  EXPECT_TRUE(sink_.got().empty());
  // The broken group is gone: the next open makes a new one.
  OpenTransferSessionResponse again;
  ASSERT_TRUE(Open("m", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &again).ok());
  EXPECT_FALSE(again.reused());
  EXPECT_NE(again.session_id(), r.session_id());
}

// A client that dies after POSTED (its rank never sends, and nothing closes the group): kvcd's
// receive ends the Transfer stream with DEADLINE_EXCEEDED at recv_timeout, and drops the group.
TEST_F(TransferTest, UploadPeerThatDiesMidTransferEndsItWithinTheTimeout) {
  TransferLimits l;
  l.recv_timeout = absl::Milliseconds(300);
  Start(l);
  OpenTransferSessionResponse r;
  ASSERT_TRUE(Open("dies", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &r).ok());
  std::unique_ptr<Communicator> peer =
      server_factory_.Join(r.nccl_unique_id(), 1, absl::Seconds(5), nullptr).value();
  RawStream rs;
  rs.s = stub_->Transfer(&rs.ctx);
  ASSERT_TRUE(rs.s->Write(Announce(r.session_id(), 0, "c", 0, kvcache::v1::TENSOR_K, 100, "")));
  TransferAck ack;
  ASSERT_TRUE(rs.s->Read(&ack));
  ASSERT_EQ(ack.state(), TransferAck::STATE_POSTED);
  const absl::Time died = absl::Now();
  server_factory_.Kill(1);
  EXPECT_FALSE(rs.s->Read(&ack));
  const grpc::Status st = rs.s->Finish();
  const absl::Duration took = absl::Now() - died;
  EXPECT_EQ(st.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << st.error_message();
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(30));  // bounded by the timeout, not by the dead peer
  EXPECT_TRUE(sink_.got().empty());
  OpenTransferSessionResponse again;
  ASSERT_TRUE(Open("dies", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &again).ok());
  EXPECT_FALSE(again.reused());  // the broken group was dropped
}

// kvcd's rank dies after POSTED: the client's send cannot complete and ends at send_timeout
// with DEADLINE_EXCEEDED; the client is closed (its group's state is unknown).
TEST_F(TransferTest, ClientSendToAPeerThatDiedEndsWithinTheSendTimeout) {
  Start();
  TransferClient::Options o = ClientOptions("survivor");
  o.send_timeout = absl::Milliseconds(300);
  TransferClient client(channel_, o);
  ASSERT_TRUE(client.Open().ok());
  ASSERT_EQ(client.transport(), kvcache::v1::TRANSFER_TRANSPORT_NCCL);
  const std::vector<uint8_t> x = Bytes(64, 1);
  ASSERT_TRUE(client.Send("c", 0, kvcache::v1::TENSOR_K, x.data(), x.size()).ok());
  server_factory_.Kill(0);
  const absl::Time t0 = absl::Now();
  const absl::Status s = client.Send("c", 0, kvcache::v1::TENSOR_V, x.data(), x.size());
  const absl::Duration took = absl::Now() - t0;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(30));
  EXPECT_FALSE(client.is_open());
}

// The producer's event reaches the data plane with the bytes it guards.
TEST_F(TransferTest, SendPassesTheProducersEventToTheDataPlane) {
  Start();
  TransferClient client(channel_, ClientOptions("events"));
  ASSERT_TRUE(client.Open().ok());
  const std::vector<uint8_t> x = Bytes(32, 2);
  int fake_event_a = 0, fake_event_b = 0;  // stand-ins: the fake only records them
  ASSERT_TRUE(client.Send("c", 0, kvcache::v1::TENSOR_K, x.data(), x.size(), &fake_event_a).ok());
  ASSERT_TRUE(client.Send("c", 0, kvcache::v1::TENSOR_V, x.data(), x.size()).ok());
  ASSERT_TRUE(client.Send("c", 1, kvcache::v1::TENSOR_K, x.data(), x.size(), &fake_event_b).ok());
  const std::vector<const void*> want = {&fake_event_a, nullptr, &fake_event_b};
  EXPECT_EQ(server_factory_.ready_events(), want);
}

TEST_F(TransferTest, NcclPayloadInAnnouncementIsRejected) {
  Start();
  OpenTransferSessionResponse r;
  ASSERT_TRUE(Open("p", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &r).ok());
  RawStream rs;
  rs.s = stub_->Transfer(&rs.ctx);
  ExpectRejected(&rs, Announce(r.session_id(), 0, "c", 0, kvcache::v1::TENSOR_K, 1, "x"),
                 grpc::StatusCode::INVALID_ARGUMENT, "payload");
}

TEST_F(TransferTest, ClientThatNeverJoinsTimesOut) {
  TransferLimits l;
  l.join_timeout = absl::Milliseconds(200);
  Start(l);
  OpenTransferSessionResponse r;
  ASSERT_TRUE(Open("ghost", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &r).ok());
  RawStream rs;
  rs.s = stub_->Transfer(&rs.ctx);
  rs.s->Write(Announce(r.session_id(), 0, "c", 0, kvcache::v1::TENSOR_K, 8, ""));
  TransferAck ack;
  EXPECT_FALSE(rs.s->Read(&ack));
  const grpc::Status st = rs.s->Finish();
  EXPECT_TRUE(st.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
              st.error_code() == grpc::StatusCode::FAILED_PRECONDITION)
      << st.error_code() << " " << st.error_message();
}

TEST_F(TransferTest, CloseTearsTheSessionDown) {
  Start();
  TransferClient client(channel_, ClientOptions("t"));
  ASSERT_TRUE(client.Open().ok());
  const std::string sid = client.session_id();
  ASSERT_TRUE(client.Close().ok());
  grpc::ClientContext ctx;
  kvcache::v1::CloseTransferSessionRequest req;
  req.set_client_id("t");
  req.set_session_id(sid);
  kvcache::v1::CloseTransferSessionResponse resp;
  EXPECT_EQ(stub_->CloseTransferSession(&ctx, req, &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  RawStream rs;
  rs.s = stub_->Transfer(&rs.ctx);
  ExpectRejected(&rs, Announce(sid, 0, "c", 0, kvcache::v1::TENSOR_K, 1, ""),
                 grpc::StatusCode::NOT_FOUND, "session_id");
  OpenTransferSessionResponse again;
  ASSERT_TRUE(Open("t", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &again).ok());
  EXPECT_FALSE(again.reused());
}

TEST_F(TransferTest, ClosingASessionCancelsItsPendingJoin) {
  Start();
  OpenTransferSessionResponse r;
  ASSERT_TRUE(Open("never-joins", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &r).ok());
  grpc::ClientContext ctx;
  kvcache::v1::CloseTransferSessionRequest req;
  req.set_client_id("never-joins");
  req.set_session_id(r.session_id());
  req.set_session_secret(r.session_secret());
  kvcache::v1::CloseTransferSessionResponse resp;
  ASSERT_TRUE(stub_->CloseTransferSession(&ctx, req, &resp).ok());
  // The server's rank-0 join ends as CANCELLED, not by running into its timeout.
  for (int i = 0; i < 400 && server_factory_.cancelled_joins() == 0; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(server_factory_.cancelled_joins(), 1);
}

TEST_F(TransferTest, CloseOfAnotherClientsSessionIsNotFound) {
  Start();
  OpenTransferSessionResponse r;
  ASSERT_TRUE(Open("owner", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &r).ok());
  grpc::ClientContext ctx;
  kvcache::v1::CloseTransferSessionRequest req;
  req.set_client_id("intruder");
  req.set_session_id(r.session_id());
  kvcache::v1::CloseTransferSessionResponse resp;
  EXPECT_EQ(stub_->CloseTransferSession(&ctx, req, &resp).error_code(),
            grpc::StatusCode::NOT_FOUND);
  req.set_client_id("owner");
  grpc::ClientContext ctx2;  // the right client id, without the secret
  EXPECT_EQ(stub_->CloseTransferSession(&ctx2, req, &resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  OpenTransferSessionResponse same;
  ASSERT_TRUE(
      Open("owner", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &same, r.session_secret()).ok());
  EXPECT_TRUE(same.reused());
}

TEST_F(TransferTest, UnavailableNcclFallsBackToGrpcBytes) {
  Start();
  server_factory_.SetAvailable(absl::UnavailableError("nccl transport unavailable: no GPU here"));
  OpenTransferSessionResponse r;
  const grpc::Status st = Open("f", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_NE(st.error_message().find("no GPU here"), std::string::npos);

  // The client's own factory works, the server's does not: the server's answer drives fallback.
  FakeFactory client_side;
  TransferClient::Options o = ClientOptions("f");
  o.factory = &client_side;
  TransferClient client(channel_, o);
  ASSERT_TRUE(client.Open().ok());
  EXPECT_EQ(client.transport(), kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
  EXPECT_NE(client.fallback_reason().find("no GPU here"), std::string::npos);
  const std::vector<uint8_t> x = Bytes(3000, 9);
  ASSERT_TRUE(client.Send("c", 4, kvcache::v1::TENSOR_Q_OBS, x.data(), x.size()).ok());
  ASSERT_EQ(sink_.got().size(), 1u);
  EXPECT_EQ(sink_.got()[0].bytes, x);
  EXPECT_EQ(sink_.got()[0].header.tensor, kvcache::v1::TENSOR_Q_OBS);
}

TEST_F(TransferTest, ClientWithoutFactoryAndServerWithoutNcclUseGrpcBytes) {
  Start({}, /*enable_nccl=*/false);
  OpenTransferSessionResponse r;
  EXPECT_EQ(Open("x", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &r).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  TransferClient client(channel_, ClientOptions("x", /*with_factory=*/false));
  ASSERT_TRUE(client.Open().ok());
  EXPECT_EQ(client.transport(), kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
  EXPECT_FALSE(client.fallback_reason().empty());
  const std::vector<uint8_t> x = Bytes(10, 1);
  EXPECT_TRUE(client.Send("c", 0, kvcache::v1::TENSOR_K, x.data(), x.size()).ok());
}

TEST_F(TransferTest, SinkErrorEndsTheStreamAndTheTensorCanBeResent) {
  Start();
  TransferClient client(channel_, ClientOptions("s", /*with_factory=*/false));
  ASSERT_TRUE(client.Open().ok());
  sink_.Fail(absl::ResourceExhaustedError("store: over budget"));
  const std::vector<uint8_t> x = Bytes(10, 1);
  const absl::Status s = client.Send("c", 0, kvcache::v1::TENSOR_K, x.data(), x.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  sink_.Fail(absl::OkStatus());
  ASSERT_TRUE(client.Open().ok());  // reopens the stream on the cached session
  EXPECT_TRUE(client.Send("c", 0, kvcache::v1::TENSOR_K, x.data(), x.size()).ok());
  EXPECT_EQ(sink_.got().size(), 1u);
}

// An exception on the worker that handles an announcement (here the sink's; in kvcd an
// allocation that fails) ends the stream with its status. It used to be logged by the pool and
// the stream left open for good: the client waited out its timeout and the stream kept its slot.
TEST_F(TransferTest, SinkThatThrowsEndsTheStreamAndTheServerCarriesOn) {
  Start();
  TransferClient client(channel_, ClientOptions("t", /*with_factory=*/false));
  ASSERT_TRUE(client.Open().ok());
  sink_.Throw(true);
  const std::vector<uint8_t> x = Bytes(10, 1);
  const absl::Status s = client.Send("c", 0, kvcache::v1::TENSOR_K, x.data(), x.size());
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("out of memory"), std::string::npos) << s;
  sink_.Throw(false);
  ASSERT_TRUE(client.Open().ok());  // reopens the stream on the cached session
  EXPECT_TRUE(client.Send("c", 0, kvcache::v1::TENSOR_K, x.data(), x.size()).ok());
  EXPECT_EQ(sink_.got().size(), 1u);
}

// kvcd that does not answer (here its sink holds the tensor) no longer holds the client: the
// send ends with DEADLINE_EXCEEDED after message_timeout, and the client can open again and go
// on once kvcd does.
TEST_F(TransferTest, ClientGivesUpOnAnAckPastItsMessageTimeout) {
  Start();
  TransferClient::Options o = ClientOptions("slow", /*with_factory=*/false);
  o.message_timeout = absl::Seconds(1);
  TransferClient client(channel_, o);
  ASSERT_TRUE(client.Open().ok());
  std::shared_ptr<Gate> gate = sink_.Hold();
  // Without the client's bound the send would wait for the gate: it opens by itself later, so
  // that such a failure ends the test rather than hanging it.
  const testing::GateBackstop backstop(gate, absl::Seconds(30));
  const std::vector<uint8_t> x = Bytes(10, 1);
  const absl::Time start = absl::Now();
  const absl::Status s = client.Send("c", 0, kvcache::v1::TENSOR_K, x.data(), x.size());
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_NE(s.message().find("message_timeout"), std::string::npos) << s;
  EXPECT_LT(took, absl::Seconds(20));
  EXPECT_FALSE(client.is_open());
  gate->Open();
  // kvcd took the tensor in the end (it was not cancelled on its side): the reopened session
  // carries on from the next sequence.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (sink_.got().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_EQ(sink_.got().size(), 1u);
  ASSERT_TRUE(client.Open().ok());
  EXPECT_TRUE(client.Send("c", 1, kvcache::v1::TENSOR_K, x.data(), x.size()).ok());
  EXPECT_EQ(sink_.got().size(), 2u);
}

TEST_F(TransferTest, ClientRefusesANonPositiveMessageTimeout) {
  Start();
  for (absl::Duration t : {absl::ZeroDuration(), absl::Seconds(-1)}) {
    TransferClient::Options o = ClientOptions("bad-timeout", /*with_factory=*/false);
    o.message_timeout = t;
    TransferClient client(channel_, o);
    const absl::Status s = client.Open();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find("message_timeout"), std::string::npos) << s;
    EXPECT_FALSE(client.is_open());
  }
}

TEST_F(TransferTest, OpenValidatesClientIdAndLimitsSessions) {
  TransferLimits l;
  l.max_sessions = 2;
  Start(l);
  OpenTransferSessionResponse r;
  grpc::Status st = Open("", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("client_id"), std::string::npos);
  st = Open(std::string(129, 'x'), kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(Open(std::string(128, 'x'), kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &r).ok());
  EXPECT_TRUE(Open("two", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &r).ok());
  st = Open("three", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  st = Open("two", static_cast<kvcache::v1::TransferTransport>(9), &r);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("transport"), std::string::npos);
}

TEST(TransferServiceCreate, RejectsMissingSinkAndBadLimits) {
  TransferServiceOptions o;
  EXPECT_NE(CreateTransferService(o).status().message().find("sink"), std::string::npos);
  RecordingSink sink;
  o.sink = &sink;
  o.limits.max_sessions = 0;
  EXPECT_NE(CreateTransferService(o).status().message().find("max_sessions"), std::string::npos);
  o.limits.max_sessions = 1;
  o.limits.max_tensor_bytes = 0;
  EXPECT_NE(CreateTransferService(o).status().message().find("max_tensor_bytes"),
            std::string::npos);
  o.limits.max_tensor_bytes = 1;
  o.limits.recv_timeout = absl::ZeroDuration();
  EXPECT_EQ(CreateTransferService(o).status().code(), absl::StatusCode::kInvalidArgument);
}

// Counts what it receives without keeping the bytes.
class CountingSink final : public TransferSink {
 public:
  absl::Status Consume(const TensorHeader&, absl::Span<const uint8_t>) override {
    tensors_.fetch_add(1);
    return absl::OkStatus();
  }
  int tensors() const { return tensors_.load(); }

 private:
  std::atomic<int> tensors_{0};
};

// A long-lived NCCL session carries many uploads in turn (every other one an overwrite of the
// same cache id, which repeats all its tensors): each tensor is accepted, and the session's
// memory stays at its largest tensor, independent of how many tensors and uploads it carried.
TEST(TransferSessionsTest, ManyUploadsOverOneSessionKeepItsStateBounded) {
  FakeFactory factory;
  CountingSink sink;
  TransferLimits limits;
  limits.max_tensor_bytes = 256;
  limits.join_timeout = absl::Seconds(5);
  limits.recv_timeout = absl::Seconds(5);
  TransferSessions sessions(limits, &factory, &sink);
  OpenTransferSessionRequest req;
  req.set_client_id("long-lived");
  req.set_transport(kvcache::v1::TRANSFER_TRANSPORT_NCCL);
  absl::StatusOr<OpenTransferSessionResponse> open = sessions.Open(req);
  ASSERT_TRUE(open.ok()) << open.status();
  Remember(*open);
  absl::StatusOr<std::unique_ptr<Communicator>> peer =
      factory.Join(open->nccl_unique_id(), 1, absl::Seconds(5), nullptr);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const std::string sid = open->session_id();
  EXPECT_EQ(sessions.RetainedBytes(sid).value(), 0u);
  EXPECT_EQ(sessions.RetainedBytes("nope").status().code(), absl::StatusCode::kNotFound);

  constexpr int kUploads = 400;
  const kvcache::v1::TensorKind kinds[] = {kvcache::v1::TENSOR_K, kvcache::v1::TENSOR_V};
  uint64_t seq = 0;
  uint64_t largest = 0;
  for (int u = 0; u < kUploads; ++u) {
    const std::string cache = u % 2 == 0 ? "overwritten" : absl::StrCat("cache-", u);
    for (uint32_t layer = 0; layer < 2; ++layer) {
      for (kvcache::v1::TensorKind kind : kinds) {
        // Sizes rise to the limit over the first uploads, then vary below it.
        const uint64_t n = std::min<uint64_t>(limits.max_tensor_bytes, 16 + (u * 7 + layer) % 300);
        largest = std::max(largest, n);
        const std::vector<uint8_t> x = Bytes(n, static_cast<uint8_t>(u));
        ASSERT_TRUE((*peer)->Send(x.data(), n, absl::Seconds(5)).ok());
        absl::StatusOr<uint64_t> got = sessions.Handle(
            Announce(sid, seq++, cache, layer, kind, n, ""), [] { return absl::OkStatus(); });
        ASSERT_TRUE(got.ok()) << "upload " << u << " layer " << layer << ": " << got.status();
        EXPECT_EQ(*got, n);
      }
    }
    absl::StatusOr<uint64_t> retained = sessions.RetainedBytes(sid);
    ASSERT_TRUE(retained.ok()) << retained.status();
    ASSERT_EQ(*retained, largest) << "after upload " << u;
  }
  EXPECT_EQ(largest, limits.max_tensor_bytes);
  EXPECT_EQ(sink.tensors(), 4 * kUploads);
  EXPECT_EQ(sessions.size(), 1);
}

// A GRPC_BYTES session holds no buffer at all, however many tensors it carried.
TEST(TransferSessionsTest, GrpcBytesSessionRetainsNothing) {
  CountingSink sink;
  TransferSessions sessions(TransferLimits{}, nullptr, &sink);
  OpenTransferSessionRequest req;
  req.set_client_id("bytes");
  req.set_transport(kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
  absl::StatusOr<OpenTransferSessionResponse> open = sessions.Open(req);
  ASSERT_TRUE(open.ok()) << open.status();
  Remember(*open);
  for (uint64_t seq = 0; seq < 200; ++seq) {
    ASSERT_TRUE(
        sessions
            .Handle(Announce(open->session_id(), seq, "same", 0, kvcache::v1::TENSOR_K, 3, "abc"),
                    [] { return absl::OkStatus(); })
            .ok())
        << seq;
  }
  EXPECT_EQ(sessions.RetainedBytes(open->session_id()).value(), 0u);
  EXPECT_EQ(sink.tensors(), 200);
}

// Knowing a client id is not enough to reach its session: re-opening it reveals nothing, and
// announcing on it, fetching from it or closing it needs the secret only its opener got.
TEST_F(TransferTest, SessionsBelongToTheirOpener) {
  Start();
  OpenTransferSessionResponse owner;
  ASSERT_TRUE(Open("victim", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &owner).ok());
  ASSERT_EQ(owner.session_secret().size(), 16u);
  for (const std::string& guess : {std::string(), std::string(16, '\0'), std::string("x")}) {
    OpenTransferSessionResponse intruder;
    const grpc::Status st =
        Open("victim", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &intruder, guess);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();
    EXPECT_EQ(st.error_message().find(owner.session_id()), std::string::npos);
    EXPECT_TRUE(intruder.session_id().empty());
    // Another transport does not take the client id over either.
    EXPECT_EQ(Open("victim", kvcache::v1::TRANSFER_TRANSPORT_NCCL, &intruder, guess).error_code(),
              grpc::StatusCode::ALREADY_EXISTS);
  }
  // The session id alone (say, leaked in a log) does not let anyone announce or close.
  TransferAnnouncement forged =
      Announce(owner.session_id(), 0, "c", 0, kvcache::v1::TENSOR_K, 1, "x");
  forged.set_session_secret(std::string(16, 'k'));
  RawStream rs;
  rs.s = stub_->Transfer(&rs.ctx);
  ExpectRejected(&rs, forged, grpc::StatusCode::PERMISSION_DENIED, "session_secret");
  grpc::ClientContext ctx;
  kvcache::v1::CloseTransferSessionRequest close;
  close.set_client_id("victim");
  close.set_session_id(owner.session_id());
  kvcache::v1::CloseTransferSessionResponse resp;
  EXPECT_EQ(stub_->CloseTransferSession(&ctx, close, &resp).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(sink_.got().empty());
  // The opener is unaffected: sequence 0 is still next, and its secret closes the session.
  RawStream ok;
  ok.s = stub_->Transfer(&ok.ctx);
  ExpectReceived(&ok, Announce(owner.session_id(), 0, "c", 0, kvcache::v1::TENSOR_K, 1, "x"));
  ok.s->WritesDone();
  EXPECT_TRUE(ok.s->Finish().ok());
  close.set_session_secret(owner.session_secret());
  grpc::ClientContext ctx2;
  EXPECT_TRUE(stub_->CloseTransferSession(&ctx2, close, &resp).ok());
  // Secrets are random per session.
  OpenTransferSessionResponse other;
  ASSERT_TRUE(Open("other", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, &other).ok());
  EXPECT_NE(other.session_secret(), owner.session_secret());
}

// Idle sessions expire (the clock is the test's), which frees their places under max_sessions.
TEST(TransferSessionsTest, IdleSessionsExpireAndFreeTheirPlaces) {
  CountingSink sink;
  TransferLimits limits;
  limits.max_sessions = 2;
  limits.session_idle_timeout = absl::Seconds(60);
  absl::Mutex mu;
  absl::Time now = absl::FromUnixSeconds(1000);
  auto clock = [&] {
    absl::MutexLock lock(&mu);
    return now;
  };
  auto advance = [&](absl::Duration d) {
    absl::MutexLock lock(&mu);
    now += d;
  };
  TransferSessions sessions(limits, nullptr, &sink, nullptr, clock);
  auto open = [&](const std::string& client) {
    OpenTransferSessionRequest req;
    req.set_client_id(client);
    req.set_transport(kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
    absl::StatusOr<OpenTransferSessionResponse> r = sessions.Open(req);
    if (r.ok()) Remember(*r);
    return r;
  };
  absl::StatusOr<OpenTransferSessionResponse> a = open("a"), b = open("b");
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(open("c").status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(open("a").status().code(), absl::StatusCode::kAlreadyExists);
  // `a` is used at 50 s, so only `b` is idle at 70 s.
  advance(absl::Seconds(50));
  auto noop = [] { return absl::OkStatus(); };
  ASSERT_TRUE(
      sessions.Handle(Announce(a->session_id(), 0, "x", 0, kvcache::v1::TENSOR_K, 1, "x"), noop)
          .ok());
  advance(absl::Seconds(20));
  absl::StatusOr<OpenTransferSessionResponse> c = open("c");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(sessions.size(), 2);
  EXPECT_EQ(
      sessions.Handle(Announce(b->session_id(), 0, "x", 0, kvcache::v1::TENSOR_K, 1, "x"), noop)
          .status()
          .code(),
      absl::StatusCode::kNotFound);
  // After its timeout the client id is free again: a new opener gets a new session.
  advance(absl::Seconds(61));
  sessions.Sweep();  // (the background sweep may have been first)
  EXPECT_EQ(sessions.size(), 0);
  absl::StatusOr<OpenTransferSessionResponse> again = open("a");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_FALSE(again->reused());
  EXPECT_NE(again->session_id(), a->session_id());
  EXPECT_EQ(again->idle_timeout_seconds(), 60u);
}

TEST(NcclFactory, ReportsWhyItIsUnavailableWithoutADevice) {
  std::string why_no_cuda;
  if (CudaDeviceAvailable(&why_no_cuda)) GTEST_SKIP() << "a CUDA device is visible";
  std::string why;
  EXPECT_FALSE(NcclTransportAvailable(0, &why));
  EXPECT_NE(why.find("nccl transport unavailable"), std::string::npos) << why;
  auto f = CreateNcclCommunicatorFactory(0);
  EXPECT_FALSE(f->NewUniqueId().ok());
  EXPECT_FALSE(f->Join(std::string(128, '\0'), 0, absl::Milliseconds(10), nullptr).ok());
}

}  // namespace
}  // namespace kvc::transfer

// The fetch direction of the transfer protocol (kvcache/v1/transfer.proto, Fetch) over real gRPC
// on loopback, with the in-process fake data plane and an in-memory source: layers arrive in
// order over NCCL (fake) and GRPC_BYTES sessions, layer ranges, errors of the source (unknown
// cache, corrupt layer) and of the client (bad range, sequences, protocol violations), fetches
// interleaved with uploads on one session, and the reader (the store lease in kvcd) living
// exactly as long as the fetch.
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
#include "kvc/transfer.h"
#include "kvc/transfer_client.h"
#include "kvcache/v1/transfer.grpc.pb.h"
#include "testing/fake_communicator.h"
#include "testing/gate.h"

namespace kvc::transfer {
namespace {

using kvcache::v1::FetchRequest;
using kvcache::v1::FetchResponse;
using kvcache::v1::KvCacheTransfer;
using kvcache::v1::OpenTransferSessionRequest;
using kvcache::v1::OpenTransferSessionResponse;
using testing::FakeFactory;

using Blobs = std::vector<std::vector<uint8_t>>;

std::vector<uint8_t> Bytes(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 31);
  return v;
}

// Caches in memory; a corrupt layer answers DATA_LOSS. Counts live readers and delivered bytes.
class FakeSource final : public TransferSource {
 public:
  void Add(const std::string& id, Blobs layers) {
    absl::MutexLock lock(&mu_);
    Cache& c = caches_[id];
    c.info.set_cache_id(id);
    c.info.set_stored_bytes(layers.size() * 1000 + 7);
    for (size_t l = 0; l < layers.size(); ++l) c.info.add_kept_tokens(static_cast<uint32_t>(l));
    c.layers = std::move(layers);
  }
  void Corrupt(const std::string& id, uint32_t layer) {
    absl::MutexLock lock(&mu_);
    caches_[id].corrupt = static_cast<int>(layer);
  }
  int live_readers() {
    absl::MutexLock lock(&mu_);
    return live_;
  }
  uint64_t delivered() {
    absl::MutexLock lock(&mu_);
    return delivered_;
  }
  void ThrowOnOpen(bool on) {
    absl::MutexLock lock(&mu_);
    throw_on_open_ = on;
  }
  // From now on every Open waits at the returned gate until it is opened.
  std::shared_ptr<testing::Gate> Hold() {
    absl::MutexLock lock(&mu_);
    gate_ = std::make_shared<testing::Gate>();
    return gate_;
  }

  absl::StatusOr<std::unique_ptr<CacheReader>> Open(const std::string&,
                                                    const std::string& cache_id) override {
    std::shared_ptr<testing::Gate> gate;
    {
      absl::MutexLock lock(&mu_);
      gate = gate_;
    }
    if (gate) gate->Pass();
    absl::MutexLock lock(&mu_);
    if (throw_on_open_) throw std::bad_alloc();  // as an allocation the source could not make
    auto it = caches_.find(cache_id);
    if (it == caches_.end()) {
      return absl::NotFoundError(absl::StrCat("cache '", cache_id, "' not found"));
    }
    ++live_;
    return std::unique_ptr<CacheReader>(new Reader(this, it->second));
  }

 private:
  struct Cache {
    kvcache::v1::CacheInfo info;
    Blobs layers;
    int corrupt = -1;
  };
  class Reader final : public CacheReader {
   public:
    Reader(FakeSource* src, Cache c) : src_(src), c_(std::move(c)) {}
    ~Reader() override {
      absl::MutexLock lock(&src_->mu_);
      --src_->live_;
    }
    const kvcache::v1::CacheInfo& info() const override { return c_.info; }
    uint32_t num_layers() const override { return static_cast<uint32_t>(c_.layers.size()); }
    absl::StatusOr<absl::Span<const uint8_t>> Layer(uint32_t layer) override {
      if (static_cast<int>(layer) == c_.corrupt) {
        return absl::DataLossError(absl::StrCat("layer ", layer, " block 0: checksum mismatch"));
      }
      return absl::MakeConstSpan(c_.layers[layer]);
    }
    void Delivered(uint64_t bytes) override {
      absl::MutexLock lock(&src_->mu_);
      src_->delivered_ += bytes;
    }

   private:
    FakeSource* const src_;
    const Cache c_;
  };

  absl::Mutex mu_;
  std::map<std::string, Cache> caches_ ABSL_GUARDED_BY(mu_);
  int live_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t delivered_ ABSL_GUARDED_BY(mu_) = 0;
  bool throw_on_open_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<testing::Gate> gate_ ABSL_GUARDED_BY(mu_);
};

class NullSink final : public TransferSink {
 public:
  absl::Status Consume(const TensorHeader& h, absl::Span<const uint8_t> bytes) override {
    absl::MutexLock lock(&mu_);
    got_.push_back({h.sequence, std::vector<uint8_t>(bytes.begin(), bytes.end())});
    return absl::OkStatus();
  }
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> got() {
    absl::MutexLock lock(&mu_);
    return got_;
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<uint64_t, std::vector<uint8_t>>> got_ ABSL_GUARDED_BY(mu_);
};

class TransferFetchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // Layer 1 is larger than two GRPC_BYTES pieces; layer 3 is empty.
    source_.Add("cache", {Bytes(300, 1), Bytes(1000, 2), Bytes(64, 3), {}, Bytes(5, 4)});
  }
  void Start(bool with_source = true) {
    TransferServiceOptions o;
    o.limits.join_timeout = absl::Seconds(5);
    o.limits.recv_timeout = absl::Seconds(5);
    o.limits.fetch_chunk_bytes = 400;
    o.factory = &factory_;
    o.sink = &sink_;
    o.source = with_source ? &source_ : nullptr;
    service_ = CreateTransferService(o).value();
    grpc::ServerBuilder b;
    int port = 0;
    b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    b.RegisterService(service_.get());
    server_ = b.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    channel_ =
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials());
    stub_ = KvCacheTransfer::NewStub(channel_);
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }

  std::unique_ptr<TransferClient> Client(const std::string& id, bool nccl) {
    TransferClient::Options o;
    o.client_id = id;
    o.factory = nccl ? &factory_ : nullptr;
    o.join_timeout = absl::Seconds(5);
    o.send_timeout = absl::Seconds(5);
    auto c = std::make_unique<TransferClient>(channel_, o);
    EXPECT_TRUE(c->Open().ok());
    EXPECT_EQ(c->transport(), nccl ? kvcache::v1::TRANSFER_TRANSPORT_NCCL
                                   : kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
    return c;
  }

  OpenTransferSessionResponse OpenRaw(const std::string& client, kvcache::v1::TransferTransport t,
                                      const std::string& secret = "") {
    OpenTransferSessionRequest req;
    req.set_client_id(client);
    req.set_transport(t);
    req.set_session_secret(secret);
    grpc::ClientContext ctx;
    OpenTransferSessionResponse resp;
    EXPECT_TRUE(stub_->OpenTransferSession(&ctx, req, &resp).ok());
    return resp;
  }

  FakeFactory factory_;
  FakeSource source_;
  NullSink sink_;
  std::unique_ptr<grpc::Service> service_;
  std::unique_ptr<grpc::Server> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<KvCacheTransfer::Stub> stub_;
};

const Blobs kAll = {Bytes(300, 1), Bytes(1000, 2), Bytes(64, 3), {}, Bytes(5, 4)};

TEST_F(TransferFetchTest, NcclSessionFetchesEveryLayerInOrder) {
  Start();
  auto client = Client("decode-nccl", /*nccl=*/true);
  auto got = client->Fetch("cache");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->info.cache_id(), "cache");
  EXPECT_EQ(got->info.kept_tokens_size(), 5);
  EXPECT_EQ(got->layer_begin, 0u);
  EXPECT_EQ(got->layers, kAll);
  EXPECT_EQ(source_.delivered(), 300u + 1000 + 64 + 5);
  EXPECT_EQ(source_.live_readers(), 0);  // released when the fetch ended
  EXPECT_EQ(factory_.joins(), 2);        // one group, both ranks
}

TEST_F(TransferFetchTest, GrpcBytesSessionFetchesLayersInPieces) {
  Start();
  auto client = Client("decode-bytes", /*nccl=*/false);
  auto got = client->Fetch("cache");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->layers, kAll);

  // On the wire: header, then per layer an announcement and pieces of at most 400 bytes.
  const OpenTransferSessionResponse r =
      OpenRaw("decode-bytes", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES, client->session_secret());
  EXPECT_EQ(r.fetch_chunk_bytes(), 400u);
  grpc::ClientContext ctx;
  auto s = stub_->Fetch(&ctx);
  FetchRequest req;
  req.mutable_start()->set_session_id(r.session_id());
  req.mutable_start()->set_session_secret(r.session_secret());
  req.mutable_start()->set_sequence(r.next_sequence());
  req.mutable_start()->set_cache_id("cache");
  req.mutable_start()->set_layer_begin(1);
  req.mutable_start()->set_layer_end(2);
  ASSERT_TRUE(s->Write(req));
  std::vector<FetchResponse> msgs;
  FetchResponse m;
  while (s->Read(&m)) msgs.push_back(m);
  ASSERT_TRUE(s->Finish().ok());
  ASSERT_EQ(msgs.size(), 5u);  // header, announcement, 400 + 400 + 200
  EXPECT_EQ(msgs[0].header().layer_begin(), 1u);
  EXPECT_EQ(msgs[0].header().layer_end(), 2u);
  EXPECT_EQ(msgs[1].layer().layer(), 1u);
  EXPECT_EQ(msgs[1].layer().num_bytes(), 1000u);
  EXPECT_EQ(msgs[2].payload().offset(), 0u);
  EXPECT_EQ(msgs[3].payload().offset(), 400u);
  EXPECT_EQ(msgs[4].payload().offset(), 800u);
  EXPECT_EQ(msgs[4].payload().data().size(), 200u);
}

TEST_F(TransferFetchTest, LayerRanges) {
  Start();
  for (bool nccl : {true, false}) {
    auto client = Client(nccl ? "range-nccl" : "range-bytes", nccl);
    auto mid = client->Fetch("cache", 1, 3);
    ASSERT_TRUE(mid.ok()) << mid.status();
    EXPECT_EQ(mid->layer_begin, 1u);
    EXPECT_EQ(mid->layers, Blobs(kAll.begin() + 1, kAll.begin() + 3));
    auto tail = client->Fetch("cache", 3);  // layer_end defaults to num_layers
    ASSERT_TRUE(tail.ok()) << tail.status();
    EXPECT_EQ(tail->layers, Blobs(kAll.begin() + 3, kAll.end()));
    auto none = client->Fetch("cache", 5, 5);  // empty, still with the info
    ASSERT_TRUE(none.ok()) << none.status();
    EXPECT_TRUE(none->layers.empty());
    EXPECT_EQ(none->info.cache_id(), "cache");
  }
}

TEST_F(TransferFetchTest, UnknownCacheAndBadRangeChangeNothing) {
  Start();
  for (bool nccl : {true, false}) {
    auto client = Client(nccl ? "bad-nccl" : "bad-bytes", nccl);
    auto unknown = client->Fetch("no-such-cache");
    EXPECT_EQ(unknown.status().code(), absl::StatusCode::kNotFound) << unknown.status();
    EXPECT_NE(unknown.status().message().find("no-such-cache"), std::string::npos);
    for (auto [b, e] : {std::pair<uint32_t, uint32_t>{0, 6}, {3, 2}, {6, 6}}) {
      auto bad = client->Fetch("cache", b, e);
      EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument) << bad.status();
      EXPECT_NE(bad.status().message().find("layer_begin/layer_end"), std::string::npos)
          << bad.status();
    }
    auto empty_id = client->Fetch("");
    EXPECT_EQ(empty_id.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(empty_id.status().message().find("cache_id"), std::string::npos);
    // No sequence was consumed and nothing was delivered; the session still works.
    const uint64_t delivered = source_.delivered();
    EXPECT_EQ(delivered, nccl ? 0u : 300u);  // the NCCL round's good fetch came first
    const OpenTransferSessionResponse r = OpenRaw(
        nccl ? "bad-nccl" : "bad-bytes",
        nccl ? kvcache::v1::TRANSFER_TRANSPORT_NCCL : kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES,
        client->session_secret());
    EXPECT_TRUE(r.reused());
    EXPECT_EQ(r.next_sequence(), 0u);
    auto good = client->Fetch("cache", 0, 1);
    ASSERT_TRUE(good.ok()) << good.status();
    EXPECT_EQ(good->layers[0], kAll[0]);
    EXPECT_EQ(source_.delivered(), delivered + 300);
    ASSERT_TRUE(client->Close().ok());
  }
}

// An exception on the worker that runs a fetch (here the source's; in kvcd an allocation that
// fails) ends the fetch with its status instead of leaving the stream open for good.
TEST_F(TransferFetchTest, SourceThatThrowsEndsTheFetchAndTheServerCarriesOn) {
  Start();
  for (bool nccl : {true, false}) {
    auto client = Client(nccl ? "throw-nccl" : "throw-bytes", nccl);
    source_.ThrowOnOpen(true);
    auto failed = client->Fetch("cache", 0, 1);
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
    EXPECT_NE(failed.status().message().find("out of memory"), std::string::npos)
        << failed.status();
    source_.ThrowOnOpen(false);
    auto good = client->Fetch("cache", 0, 1);
    ASSERT_TRUE(good.ok()) << good.status();
    EXPECT_EQ(good->layers[0], kAll[0]);
    ASSERT_TRUE(client->Close().ok());
  }
}

// kvcd that does not answer a fetch (here its source holds the cache's opening) no longer holds
// the client: the fetch ends with DEADLINE_EXCEEDED after message_timeout.
TEST_F(TransferFetchTest, FetchGivesUpPastItsMessageTimeout) {
  Start();
  TransferClient::Options o;
  o.client_id = "slow-fetch";
  o.message_timeout = absl::Seconds(1);
  TransferClient client(channel_, o);
  ASSERT_TRUE(client.Open().ok());
  std::shared_ptr<testing::Gate> gate = source_.Hold();
  // Without the bound the fetch would wait for the gate: it opens by itself after 30 s.
  const testing::GateBackstop backstop(gate, absl::Seconds(30));
  const absl::Time start = absl::Now();
  auto fetched = client.Fetch("cache", 0, 1);
  EXPECT_EQ(fetched.status().code(), absl::StatusCode::kDeadlineExceeded) << fetched.status();
  EXPECT_NE(fetched.status().message().find("message_timeout"), std::string::npos);
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

TEST_F(TransferFetchTest, CorruptLayerEndsTheFetchBeforeItsBytesAndKeepsTheGroup) {
  Start();
  source_.Corrupt("cache", 2);
  auto client = Client("decode-corrupt", /*nccl=*/true);
  std::vector<uint32_t> layers;
  absl::Status s = client->Fetch(
      "cache", 0, std::nullopt,
      [](const kvcache::v1::CacheInfo&, uint32_t, uint32_t) { return absl::OkStatus(); },
      [&](uint32_t layer, absl::Span<const uint8_t> blob) {
        EXPECT_EQ(std::vector<uint8_t>(blob.begin(), blob.end()), kAll[layer]);
        layers.push_back(layer);
        return absl::OkStatus();
      });
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
  EXPECT_NE(s.message().find("layer 2"), std::string::npos) << s;
  EXPECT_EQ(layers, (std::vector<uint32_t>{0, 1}));
  EXPECT_EQ(source_.delivered(), 1300u);
  EXPECT_EQ(source_.live_readers(), 0);
  // Nothing of layer 2 went onto the data plane: the same group serves the next fetch.
  ASSERT_TRUE(client->is_open());
  auto again = client->Fetch("cache", 3);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->layers, Blobs(kAll.begin() + 3, kAll.end()));
  EXPECT_EQ(factory_.joins(), 2);
}

TEST_F(TransferFetchTest, UploadsAndFetchesInterleaveOnOneSession) {
  Start();
  for (bool nccl : {true, false}) {
    auto client = Client(nccl ? "mixed-nccl" : "mixed-bytes", nccl);
    const size_t before = sink_.got().size();
    const std::vector<uint8_t> t0 = Bytes(77, 9), t1 = Bytes(500, 10);
    ASSERT_TRUE(client->Send("up", 0, kvcache::v1::TENSOR_K, t0.data(), t0.size()).ok());
    auto f0 = client->Fetch("cache", 0, 2);  // sequence 1
    ASSERT_TRUE(f0.ok()) << f0.status();
    ASSERT_TRUE(client->Send("up", 0, kvcache::v1::TENSOR_V, t1.data(), t1.size()).ok());
    auto f1 = client->Fetch("cache", 4);  // sequence 3
    ASSERT_TRUE(f1.ok()) << f1.status();
    EXPECT_EQ(f0->layers, Blobs(kAll.begin(), kAll.begin() + 2));
    EXPECT_EQ(f1->layers, Blobs(kAll.begin() + 4, kAll.end()));
    const auto got = sink_.got();
    ASSERT_EQ(got.size(), before + 2);
    EXPECT_EQ(got[before].first, 0u);
    EXPECT_EQ(got[before].second, t0);
    EXPECT_EQ(got[before + 1].first, 2u);  // the fetch took sequence 1
    EXPECT_EQ(got[before + 1].second, t1);
    ASSERT_TRUE(client->Close().ok());
  }
}

// Raw Fetch streams for the protocol violations.
class TransferFetchRawTest : public TransferFetchTest {
 protected:
  struct Raw {
    grpc::ClientContext ctx;
    std::unique_ptr<grpc::ClientReaderWriter<FetchRequest, FetchResponse>> s;
  };
  std::unique_ptr<Raw> Stream() {
    auto r = std::make_unique<Raw>();
    r->s = stub_->Fetch(&r->ctx);
    return r;
  }
  static FetchRequest StartMsg(const OpenTransferSessionResponse& r, uint64_t seq,
                               const std::string& cache = "cache") {
    FetchRequest req;
    req.mutable_start()->set_session_id(r.session_id());
    req.mutable_start()->set_session_secret(r.session_secret());
    req.mutable_start()->set_sequence(seq);
    req.mutable_start()->set_cache_id(cache);
    return req;
  }
  static FetchRequest Posted(uint32_t layer) {
    FetchRequest req;
    req.mutable_posted()->set_layer(layer);
    return req;
  }
  // Reads to the end; expects `code` with `text` in the message.
  static void ExpectEnds(Raw* raw, grpc::StatusCode code, const std::string& text) {
    FetchResponse m;
    while (raw->s->Read(&m)) {
    }
    const grpc::Status st = raw->s->Finish();
    EXPECT_EQ(st.error_code(), code) << st.error_message();
    EXPECT_NE(st.error_message().find(text), std::string::npos) << st.error_message();
  }
};

TEST_F(TransferFetchRawTest, SequenceMustBeTheSessionsNext) {
  Start();
  const OpenTransferSessionResponse r = OpenRaw("seq", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
  auto ahead = Stream();
  ASSERT_TRUE(ahead->s->Write(StartMsg(r, 1)));
  ExpectEnds(ahead.get(), grpc::StatusCode::INVALID_ARGUMENT, "out of order");
  auto ok = Stream();
  ASSERT_TRUE(ok->s->Write(StartMsg(r, 0)));
  FetchResponse m;
  int n = 0;
  while (ok->s->Read(&m)) ++n;
  EXPECT_TRUE(ok->s->Finish().ok());
  EXPECT_GT(n, 5);
  auto dup = Stream();
  ASSERT_TRUE(dup->s->Write(StartMsg(r, 0)));
  ExpectEnds(dup.get(), grpc::StatusCode::INVALID_ARGUMENT, "duplicate");
  auto unknown = Stream();
  OpenTransferSessionResponse bogus = r;
  bogus.set_session_id("nope");
  ASSERT_TRUE(unknown->s->Write(StartMsg(bogus, 1)));
  ExpectEnds(unknown.get(), grpc::StatusCode::NOT_FOUND, "session_id");
  // The session id without its secret fetches nothing.
  auto forged = Stream();
  OpenTransferSessionResponse wrong = r;
  wrong.set_session_secret(std::string(16, 'k'));
  ASSERT_TRUE(forged->s->Write(StartMsg(wrong, 1)));
  ExpectEnds(forged.get(), grpc::StatusCode::PERMISSION_DENIED, "session_secret");
}

TEST_F(TransferFetchRawTest, FirstMessageMustBeStart) {
  Start();
  auto posted_first = Stream();
  ASSERT_TRUE(posted_first->s->Write(Posted(0)));
  ExpectEnds(posted_first.get(), grpc::StatusCode::INVALID_ARGUMENT, "first message");
  auto nothing = Stream();
  nothing->s->WritesDone();
  ExpectEnds(nothing.get(), grpc::StatusCode::INVALID_ARGUMENT, "before a start");
}

TEST_F(TransferFetchRawTest, NcclPostedMustNameTheAnnouncedLayer) {
  Start();
  const OpenTransferSessionResponse r = OpenRaw("posted", kvcache::v1::TRANSFER_TRANSPORT_NCCL);
  std::unique_ptr<Communicator> peer =
      factory_.Join(r.nccl_unique_id(), 1, absl::Seconds(5), nullptr).value();
  auto raw = Stream();
  ASSERT_TRUE(raw->s->Write(StartMsg(r, 0)));
  FetchResponse m;
  ASSERT_TRUE(raw->s->Read(&m));
  ASSERT_TRUE(m.has_header());
  ASSERT_TRUE(raw->s->Read(&m));
  ASSERT_EQ(m.layer().layer(), 0u);
  ASSERT_TRUE(raw->s->Write(Posted(0)));
  std::vector<uint8_t> buf(m.layer().num_bytes());
  ASSERT_TRUE(peer->Recv(buf.data(), buf.size(), absl::Seconds(5)).ok());
  EXPECT_EQ(buf, kAll[0]);
  ASSERT_TRUE(raw->s->Read(&m));
  ASSERT_EQ(m.layer().layer(), 1u);
  ASSERT_TRUE(raw->s->Write(Posted(2)));
  ExpectEnds(raw.get(), grpc::StatusCode::INVALID_ARGUMENT, "not the announced layer 1");
  EXPECT_EQ(source_.delivered(), 300u);

  // A second start instead of posted; then a client that leaves before posting. Neither sends.
  auto twice = Stream();
  ASSERT_TRUE(twice->s->Write(StartMsg(r, 1)));  // sequence 0 went to the fetch above
  ASSERT_TRUE(twice->s->Read(&m));
  ASSERT_TRUE(twice->s->Read(&m));
  ASSERT_TRUE(twice->s->Write(StartMsg(r, 2)));
  ExpectEnds(twice.get(), grpc::StatusCode::INVALID_ARGUMENT, "second start");
  auto leaves = Stream();
  ASSERT_TRUE(leaves->s->Write(StartMsg(r, 2)));
  ASSERT_TRUE(leaves->s->Read(&m));
  ASSERT_TRUE(leaves->s->Read(&m));
  leaves->s->WritesDone();
  ExpectEnds(leaves.get(), grpc::StatusCode::CANCELLED, "before posting");
  EXPECT_EQ(source_.delivered(), 300u);
  EXPECT_EQ(source_.live_readers(), 0);
  // No stray bytes are queued for the client: the next receive would time out.
  EXPECT_EQ(peer->Recv(buf.data(), 1, absl::Milliseconds(50)).code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(TransferFetchRawTest, ServerWithoutSourceRefusesFetches) {
  Start(/*with_source=*/false);
  const OpenTransferSessionResponse r =
      OpenRaw("nosrc", kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
  auto raw = Stream();
  ASSERT_TRUE(raw->s->Write(StartMsg(r, 0)));
  ExpectEnds(raw.get(), grpc::StatusCode::FAILED_PRECONDITION, "no cache store");
}

TEST_F(TransferFetchTest, ReaderLivesForTheWholeFetch) {
  Start();
  auto client = Client("lease", /*nccl=*/true);
  std::vector<int> live;
  absl::Status s = client->Fetch(
      "cache", 0, std::nullopt,
      [&](const kvcache::v1::CacheInfo&, uint32_t, uint32_t) {
        live.push_back(source_.live_readers());
        return absl::OkStatus();
      },
      [&](uint32_t, absl::Span<const uint8_t>) {
        live.push_back(source_.live_readers());
        return absl::OkStatus();
      });
  ASSERT_TRUE(s.ok()) << s;
  // The info and every layer but the last (kvcd may finish once its last send is done).
  ASSERT_EQ(live.size(), 6u);
  EXPECT_EQ(std::vector<int>(live.begin(), live.begin() + 5), std::vector<int>(5, 1));
  EXPECT_EQ(source_.live_readers(), 0);
  // A callback's error cancels the fetch; the client stays usable.
  s = client->Fetch(
      "cache", 0, std::nullopt,
      [](const kvcache::v1::CacheInfo&, uint32_t, uint32_t) { return absl::OkStatus(); },
      [](uint32_t, absl::Span<const uint8_t>) { return absl::AbortedError("enough"); });
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  auto after = client->Fetch("cache", 4);
  ASSERT_TRUE(after.ok()) << after.status();
}

}  // namespace
}  // namespace kvc::transfer

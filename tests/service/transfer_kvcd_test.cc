// PutCache uploads whose tensors come through the KvCacheTransfer service
// (PutCacheHeader.external_payload), against a real kvcd: the stored cache equals the one of an
// ordinary chunked upload byte for byte, and every way such an upload can go wrong fails it
// cleanly (nothing stored, the cache id usable again). Without a GPU kvcd serves GRPC_BYTES
// sessions; NCCL sessions differ only in how the bytes reach the sink (tests/gpu/README.md).
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kvc/transfer.h"
#include "kvc/transfer_client.h"
#include "server/ingest_registry.h"
#include "server/server.h"
#include "testing/fake_communicator.h"
#include "testing/in_process_kvcd.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"
#include "testing/shared_kvcd.h"

namespace kvc {
namespace {

using kvcache::v1::GetCacheRequest;
using kvcache::v1::PutCacheHeader;
using kvcache::v1::PutCacheRequest;
using kvcache::v1::PutCacheResponse;
using testing::Fetched;
using testing::KvcdProcess;
using testing::TestCache;
using transfer::PutPath;
using transfer::TensorRef;
using transfer::TransferClient;

// 16 KiB per K/V tensor: four pieces of --max_chunk_bytes each when delivered.
constexpr char kChunkLimitFlag[] = "--max_chunk_bytes=4KiB";

TestCache MakeCache(const std::string& id, uint64_t seed = 7) {
  TestCache c = testing::MakeTestCache(id, testing::Shape(3, 2, 4, 32, 128, 16),
                                       kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, seed);
  *c.header.mutable_compression() = testing::FullCompression();
  return c;
}

std::vector<TensorRef> Tensors(const TestCache& c) {
  std::vector<TensorRef> t;
  for (uint32_t l = 0; l < c.k.size(); ++l) {
    t.push_back({l, kvcache::v1::TENSOR_K, c.k[l].data(), c.k[l].size()});
    t.push_back({l, kvcache::v1::TENSOR_V, c.v[l].data(), c.v[l].size()});
    t.push_back({l, kvcache::v1::TENSOR_Q_OBS, c.q[l].data(), c.q[l].size()});
  }
  return t;
}

TransferClient::Options ClientOptions(const std::string& id) {
  TransferClient::Options o;
  o.client_id = id;  // no communicator factory: GRPC_BYTES sessions
  o.join_timeout = absl::Seconds(5);
  o.send_timeout = absl::Seconds(5);
  return o;
}

std::shared_ptr<grpc::Channel> Channel(const std::string& address) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
}

// A PutCache stream with external_payload, driven by hand.
struct ExternalPut {
  grpc::ClientContext ctx;
  PutCacheResponse resp;
  std::unique_ptr<grpc::ClientWriter<PutCacheRequest>> writer;
  bool registered = false;

  ExternalPut(kvcache::v1::KvCache::Stub* stub, PutCacheHeader header) {
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
    writer = stub->PutCache(&ctx, &resp);
    header.set_external_payload(true);
    PutCacheRequest req;
    *req.mutable_header() = header;
    if (writer->Write(req)) writer->WaitForInitialMetadata();
    registered = ctx.GetServerInitialMetadata().count(transfer::kExternalPayloadMetadataKey) > 0;
  }
  grpc::Status Close() {
    writer->WritesDone();
    return writer->Finish();
  }
};

class TransferKvcdTest : public testing::SharedKvcdTest<TransferKvcdTest> {
 public:
  static std::vector<std::string> KvcdFlags() {
    return {"--store_bytes=64MiB", "--backend=cpu", kChunkLimitFlag, "--transfer=auto"};
  }

 protected:
  void SetUp() override {
    SharedKvcdTest::SetUp();
    if (HasFatalFailure()) return;
    channel_ = Channel(kvcd_->address());
    stub_ = testing::NewStub(kvcd_->address());
  }

  // The whole cache as GRPC_BYTES transfers into an external-payload PutCache.
  absl::StatusOr<transfer::TransferPutResult> PutViaTransfer(const TestCache& c,
                                                             const std::string& client_id) {
    TransferClient client(channel_, ClientOptions(client_id));
    auto r = transfer::PutCacheWithTransfer(channel_, &client, c.header, Tensors(c));
    client.Close().IgnoreError();
    return r;
  }

  bool Stored(const std::string& id) {
    const testing::StoreView v = testing::ViewStore(stub_.get());
    for (const std::string& s : v.ids) {
      if (s == id) return true;
    }
    return false;
  }

  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<kvcache::v1::KvCache::Stub> stub_;
};

TEST_F(TransferKvcdTest, TransferredUploadStoresTheSameBytesAsChunks) {
  const TestCache chunked = MakeCache("same-chunks");
  TestCache moved = chunked;
  moved.header.set_cache_id("same-transfer");
  PutCacheResponse chunk_resp;
  ASSERT_TRUE(testing::PutCache(stub_.get(), chunked, &chunk_resp, 4 << 10).ok());

  auto r = PutViaTransfer(moved, "prefill-same");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->path, PutPath::kGrpcBytes);
  EXPECT_FALSE(r->fallback_reason.empty());
  EXPECT_EQ(r->response.cache_id(), "same-transfer");
  EXPECT_EQ(r->response.input_bytes(), chunk_resp.input_bytes());
  EXPECT_EQ(r->response.input_bytes(), chunked.kv_bytes());
  EXPECT_EQ(r->response.stored_bytes(), chunk_resp.stored_bytes());

  Fetched a, b;
  GetCacheRequest req;
  req.set_format(kvcache::v1::FORMAT_PACKED);
  req.set_cache_id("same-chunks");
  ASSERT_TRUE(testing::Get(stub_.get(), req, &a).ok());
  req.set_cache_id("same-transfer");
  ASSERT_TRUE(testing::Get(stub_.get(), req, &b).ok());
  ASSERT_EQ(a.parts.size(), b.parts.size());
  ASSERT_FALSE(a.parts.empty());
  for (const auto& [key, bytes] : a.parts) {
    ASSERT_EQ(b.parts.count(key), 1u);
    EXPECT_EQ(b.parts.at(key), bytes) << "layer " << key.first << " part " << key.second;
  }
}

// kvcd serves fetches from its store (the source kvcd_main.cc wires): the blobs are GetCache
// PACKED's, and uploads and fetches share one session (more in transfer_fetch*_test.cc).
TEST_F(TransferKvcdTest, FetchReturnsTheBlobsOfGetCachePacked) {
  const TestCache c = MakeCache("fetch-me");
  ASSERT_TRUE(testing::PutCache(stub_.get(), c, nullptr, 4 << 10).ok());
  Fetched packed;
  GetCacheRequest req;
  req.set_format(kvcache::v1::FORMAT_PACKED);
  req.set_cache_id("fetch-me");
  ASSERT_TRUE(testing::Get(stub_.get(), req, &packed).ok());

  TransferClient client(channel_, ClientOptions("decode-fetch"));
  ASSERT_TRUE(client.Open().ok());
  auto got = client.Fetch("fetch-me");
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->info.SerializeAsString(), packed.info.SerializeAsString());
  ASSERT_EQ(got->layers.size(), c.k.size());
  for (uint32_t l = 0; l < got->layers.size(); ++l) {
    EXPECT_EQ(std::string(got->layers[l].begin(), got->layers[l].end()),
              packed.part(l, kvcache::v1::PART_PACKED))
        << "layer " << l;
  }
  // An upload through the same session, then a fetch of what it stored.
  TestCache moved = MakeCache("fetch-uploaded", 9);
  auto put = transfer::PutCacheWithTransfer(channel_, &client, moved.header, Tensors(moved));
  ASSERT_TRUE(put.ok()) << put.status();
  auto again = client.Fetch("fetch-uploaded", 1, 2);
  ASSERT_TRUE(again.ok()) << again.status();
  req.set_cache_id("fetch-uploaded");
  Fetched uploaded;
  ASSERT_TRUE(testing::Get(stub_.get(), req, &uploaded).ok());
  ASSERT_EQ(again->layers.size(), 1u);
  EXPECT_EQ(std::string(again->layers[0].begin(), again->layers[0].end()),
            uploaded.part(1, kvcache::v1::PART_PACKED));
  auto missing = client.Fetch("fetch-never-stored");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  client.Close().IgnoreError();
}

TEST_F(TransferKvcdTest, ServerInfoReportsNcclAsTheTransferServiceSeesIt) {
  grpc::ClientContext ctx;
  kvcache::v1::ServerInfo info;
  ASSERT_TRUE(stub_->GetServerInfo(&ctx, kvcache::v1::GetServerInfoRequest(), &info).ok());
  std::string why;
  EXPECT_EQ(info.nccl_available(), transfer::NcclTransportAvailable(0, &why)) << why;
}

TEST_F(TransferKvcdTest, TensorForAnUnregisteredCacheIsNotFound) {
  const TestCache c = MakeCache("never-registered");
  TransferClient client(channel_, ClientOptions("prefill-unknown"));
  ASSERT_TRUE(client.Open().ok());
  absl::Status s =
      client.Send("never-registered", 0, kvcache::v1::TENSOR_K, c.k[0].data(), c.k[0].size());
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  EXPECT_NE(s.message().find("never-registered"), absl::string_view::npos) << s;
  client.Close().IgnoreError();
  EXPECT_FALSE(Stored("never-registered"));
}

TEST_F(TransferKvcdTest, WrongSizeFailsTheTransferAndTheUpload) {
  const TestCache c = MakeCache("wrong-size");
  ExternalPut put(stub_.get(), c.header);
  ASSERT_TRUE(put.registered);
  TransferClient client(channel_, ClientOptions("prefill-size"));
  ASSERT_TRUE(client.Open().ok());
  absl::Status s =
      client.Send("wrong-size", 0, kvcache::v1::TENSOR_K, c.k[0].data(), c.k[0].size() - 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("num_bytes"), absl::string_view::npos) << s;
  // The upload has failed: further tensors are refused, and the stream reports the first error.
  ASSERT_TRUE(client.Open().ok());  // the failed Transfer stream ended; the session stays
  s = client.Send("wrong-size", 0, kvcache::v1::TENSOR_V, c.v[0].data(), c.v[0].size());
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  client.Close().IgnoreError();
  const grpc::Status put_status = put.Close();
  EXPECT_EQ(put_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(put_status.error_message().find("num_bytes"), std::string::npos)
      << put_status.error_message();
  EXPECT_FALSE(Stored("wrong-size"));
}

// Each bad tensor on a fresh upload: too large, too small for Q_obs, a layer out of range (the
// chunk path's own message).
TEST_F(TransferKvcdTest, EachBadTensorFailsItsUpload) {
  const TestCache c = MakeCache("bad-tensor");
  std::vector<uint8_t> big(c.k[0].size() + 2, 1);
  struct Case {
    std::string id;
    uint32_t layer;
    kvcache::v1::TensorKind kind;
    const uint8_t* data;
    uint64_t bytes;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"bad-large", 0, kvcache::v1::TENSOR_K, big.data(), big.size(), "num_bytes"},
      {"bad-q", 2, kvcache::v1::TENSOR_Q_OBS, c.q[2].data(), c.q[2].size() / 2, "num_bytes"},
      {"bad-layer", 3, kvcache::v1::TENSOR_K, c.k[0].data(), c.k[0].size(), "chunk.layer"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.id);
    PutCacheHeader h = c.header;
    h.set_cache_id(k.id);
    ExternalPut put(stub_.get(), h);
    ASSERT_TRUE(put.registered);
    TransferClient client(channel_, ClientOptions("prefill-" + k.id));
    ASSERT_TRUE(client.Open().ok());
    absl::Status s = client.Send(k.id, k.layer, k.kind, k.data, k.bytes);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(k.message), absl::string_view::npos) << s;
    client.Close().IgnoreError();
    EXPECT_EQ(put.Close().error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_FALSE(Stored(k.id));
  }
}

// The library flow: a failed upload stores nothing and closes the client, so that the retry
// with the same client goes through.
TEST_F(TransferKvcdTest, FailedUploadCanBeRetriedWithTheSameClient) {
  const TestCache c = MakeCache("retry");
  std::vector<TensorRef> bad = Tensors(c);
  bad[4].bytes -= 1;  // layer 1 V
  TransferClient client(channel_, ClientOptions("prefill-retry"));
  auto r = transfer::PutCacheWithTransfer(channel_, &client, c.header, bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
  EXPECT_FALSE(client.is_open());
  EXPECT_FALSE(Stored("retry"));
  absl::StatusOr<transfer::TransferPutResult> ok;
  for (int attempt = 0; attempt < 100; ++attempt) {  // until kvcd saw the cancellation
    ok = transfer::PutCacheWithTransfer(channel_, &client, c.header, Tensors(c));
    if (ok.status().code() != absl::StatusCode::kAborted) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->path, PutPath::kGrpcBytes);
  EXPECT_TRUE(Stored("retry"));
  client.Close().IgnoreError();
}

TEST_F(TransferKvcdTest, DuplicateTensorFailsTheUpload) {
  const TestCache c = MakeCache("duplicate");
  ExternalPut put(stub_.get(), c.header);
  ASSERT_TRUE(put.registered);
  // Two sessions: the ingest refuses the repeat whichever session it came through.
  TransferClient a(channel_, ClientOptions("prefill-dup-a"));
  TransferClient b(channel_, ClientOptions("prefill-dup-b"));
  ASSERT_TRUE(a.Open().ok());
  ASSERT_TRUE(b.Open().ok());
  ASSERT_TRUE(a.Send("duplicate", 1, kvcache::v1::TENSOR_V, c.v[1].data(), c.v[1].size()).ok());
  absl::Status s = b.Send("duplicate", 1, kvcache::v1::TENSOR_V, c.v[1].data(), c.v[1].size());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("already received"), absl::string_view::npos) << s;
  a.Close().IgnoreError();
  b.Close().IgnoreError();
  const grpc::Status put_status = put.Close();
  EXPECT_EQ(put_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(put_status.error_message().find("already received"), std::string::npos);
  EXPECT_FALSE(Stored("duplicate"));
}

// A repeat through the same session is refused by kvcd's ingest too (the session keeps no
// record of the tensors it carried), and fails the upload.
TEST_F(TransferKvcdTest, DuplicateTensorThroughOneSessionFailsTheUpload) {
  const TestCache c = MakeCache("duplicate-one-session");
  ExternalPut put(stub_.get(), c.header);
  ASSERT_TRUE(put.registered);
  TransferClient client(channel_, ClientOptions("prefill-dup-one"));
  ASSERT_TRUE(client.Open().ok());
  const std::string& id = c.header.cache_id();
  ASSERT_TRUE(client.Send(id, 0, kvcache::v1::TENSOR_K, c.k[0].data(), c.k[0].size()).ok());
  absl::Status s = client.Send(id, 0, kvcache::v1::TENSOR_K, c.k[0].data(), c.k[0].size());
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("already received"), absl::string_view::npos) << s;
  client.Close().IgnoreError();
  const grpc::Status put_status = put.Close();
  EXPECT_EQ(put_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(Stored(id));
}

// One client (one long-lived session) carries many uploads in turn, then overwrites one of them
// with other bytes: the session refuses none of the repeated tensors, and the overwrite's bytes
// are what is stored (equal to an ordinary chunked upload of them).
TEST_F(TransferKvcdTest, UploadsAndAnOverwriteShareOneSession) {
  TransferClient client(channel_, ClientOptions("prefill-long-lived"));
  std::string session;
  for (int i = 0; i < 8; ++i) {
    const TestCache c = MakeCache(absl::StrCat("long-lived-", i), 100 + i);
    auto r = transfer::PutCacheWithTransfer(channel_, &client, c.header, Tensors(c));
    ASSERT_TRUE(r.ok()) << "upload " << i << ": " << r.status();
    if (i == 0) session = client.session_id();
    EXPECT_EQ(client.session_id(), session) << "upload " << i << " needed a new session";
  }
  TestCache again = MakeCache("long-lived-3", 999);
  again.header.set_overwrite(true);
  auto r = transfer::PutCacheWithTransfer(channel_, &client, again.header, Tensors(again));
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(client.session_id(), session);
  client.Close().IgnoreError();

  TestCache chunked = again;
  chunked.header.set_cache_id("long-lived-3-chunks");
  chunked.header.set_overwrite(false);
  PutCacheResponse chunk_resp;
  ASSERT_TRUE(testing::PutCache(stub_.get(), chunked, &chunk_resp, 4 << 10).ok());
  Fetched a, b;
  GetCacheRequest req;
  req.set_format(kvcache::v1::FORMAT_PACKED);
  req.set_cache_id("long-lived-3-chunks");
  ASSERT_TRUE(testing::Get(stub_.get(), req, &a).ok());
  req.set_cache_id("long-lived-3");
  ASSERT_TRUE(testing::Get(stub_.get(), req, &b).ok());
  ASSERT_FALSE(a.parts.empty());
  EXPECT_EQ(a.parts, b.parts);
}

TEST_F(TransferKvcdTest, ChunkMessageOnAnExternalStreamIsInvalid) {
  const TestCache c = MakeCache("chunk-on-external");
  std::vector<PutCacheRequest> reqs = testing::MakeRequests(c, 4 << 10);
  reqs[0].mutable_header()->set_external_payload(true);
  reqs.resize(2);  // the header and one chunk
  PutCacheResponse resp;
  const grpc::Status s = testing::Put(stub_.get(), reqs, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(s.error_message().find("external_payload"), std::string::npos) << s.error_message();
  EXPECT_FALSE(Stored("chunk-on-external"));
  // The registration is gone: the id can be uploaded again.
  auto r = PutViaTransfer(c, "prefill-after-chunk");
  EXPECT_TRUE(r.ok()) << r.status();
}

TEST_F(TransferKvcdTest, ClosingBeforeAllTensorsArrivedStoresNothing) {
  const TestCache c = MakeCache("early-close");
  ExternalPut put(stub_.get(), c.header);
  ASSERT_TRUE(put.registered);
  TransferClient client(channel_, ClientOptions("prefill-early"));
  ASSERT_TRUE(client.Open().ok());
  const std::vector<TensorRef> all = Tensors(c);
  for (size_t i = 0; i + 1 < all.size(); ++i) {  // all but layer 2's Q_obs
    ASSERT_TRUE(
        client.Send("early-close", all[i].layer, all[i].tensor, all[i].data, all[i].bytes).ok());
  }
  const grpc::Status put_status = put.Close();
  EXPECT_EQ(put_status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_FALSE(Stored("early-close"));
  // The stream ended, so the last tensor has nowhere to go.
  absl::Status s = client.Send("early-close", all.back().layer, all.back().tensor, all.back().data,
                               all.back().bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << s;
  client.Close().IgnoreError();
}

TEST_F(TransferKvcdTest, CancelMidwayStoresNothingAndFreesTheId) {
  const TestCache c = MakeCache("cancelled");
  {
    ExternalPut put(stub_.get(), c.header);
    ASSERT_TRUE(put.registered);
    TransferClient client(channel_, ClientOptions("prefill-cancel"));
    ASSERT_TRUE(client.Open().ok());
    const std::vector<TensorRef> all = Tensors(c);
    for (size_t i = 0; i < 4; ++i) {  // layer 0 complete (compressing), layer 1 begun
      ASSERT_TRUE(
          client.Send("cancelled", all[i].layer, all[i].tensor, all[i].data, all[i].bytes).ok());
    }
    put.ctx.TryCancel();
    EXPECT_EQ(put.writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
    client.Close().IgnoreError();
  }
  // kvcd unregisters the upload when it sees the cancellation (asynchronously): until then a
  // new external upload of the id is ABORTED; afterwards the whole upload works.
  absl::StatusOr<transfer::TransferPutResult> r;
  for (int attempt = 0; attempt < 100; ++attempt) {
    EXPECT_FALSE(Stored("cancelled"));
    r = PutViaTransfer(c, absl::StrCat("prefill-cancel-", attempt));
    if (r.status().code() != absl::StatusCode::kAborted) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->response.input_bytes(), c.kv_bytes());
  EXPECT_TRUE(Stored("cancelled"));
}

TEST_F(TransferKvcdTest, SecondExternalUploadOfAnOpenIdIsAborted) {
  const TestCache c = MakeCache("twice");
  ExternalPut first(stub_.get(), c.header);
  ASSERT_TRUE(first.registered);
  ExternalPut second(stub_.get(), c.header);
  EXPECT_FALSE(second.registered);
  EXPECT_EQ(second.Close().error_code(), grpc::StatusCode::ABORTED);
  EXPECT_EQ(first.Close().error_code(), grpc::StatusCode::INVALID_ARGUMENT);  // no tensors
  EXPECT_FALSE(Stored("twice"));
}

// With --transfer=off the client uploads with chunks and says so; a hand-made external header
// is refused.
TEST(TransferKvcdOffTest, FallsBackToChunksWhenKvcdServesNoTransfer) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = {"--store_bytes=64MiB", "--backend=cpu", kChunkLimitFlag, "--transfer=off"};
  auto kvcd = KvcdProcess::Start(opts);
  ASSERT_TRUE(kvcd.ok()) << kvcd.status();
  auto channel = Channel((*kvcd)->address());
  auto stub = testing::NewStub((*kvcd)->address());

  const TestCache c = MakeCache("off");
  ExternalPut put(stub.get(), c.header);
  EXPECT_FALSE(put.registered);
  EXPECT_EQ(put.Close().error_code(), grpc::StatusCode::FAILED_PRECONDITION);

  TransferClient client(channel, ClientOptions("prefill-off"));
  transfer::TransferPutOptions po;
  po.chunk_bytes = 4 << 10;
  auto r = transfer::PutCacheWithTransfer(channel, &client, c.header, Tensors(c), po);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->path, PutPath::kChunks);
  EXPECT_NE(r->fallback_reason.find("no transfer service"), std::string::npos)
      << r->fallback_reason;
  EXPECT_EQ(r->response.input_bytes(), c.kv_bytes());

  po.allow_chunks_fallback = false;
  TestCache c2 = MakeCache("off-strict");
  TransferClient strict(channel, ClientOptions("prefill-off-strict"));
  auto r2 = transfer::PutCacheWithTransfer(channel, &strict, c2.header, Tensors(c2), po);
  EXPECT_EQ(r2.status().code(), absl::StatusCode::kUnimplemented) << r2.status();
}

// A kvcd whose messages are limited to 12 KiB, below the tensors and layers the tests move.
absl::StatusOr<std::unique_ptr<KvcdProcess>> StartWithSmallMessages() {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = {"--store_bytes=64MiB", "--backend=cpu", kChunkLimitFlag,
                "--max_message_bytes=12KiB"};
  return KvcdProcess::Start(opts);
}

// GRPC_BYTES carries a whole tensor per message: tensors over kvcd's message limit go as chunks.
TEST(TransferKvcdOffTest, TensorsOverTheMessageLimitGoAsChunks) {
  auto kvcd = StartWithSmallMessages();
  ASSERT_TRUE(kvcd.ok()) << kvcd.status();
  auto channel = Channel((*kvcd)->address());
  const TestCache c = MakeCache("big-tensors");  // 16 KiB K and V tensors
  TransferClient client(channel, ClientOptions("prefill-big"));
  transfer::TransferPutOptions po;
  po.chunk_bytes = 64 << 10;  // clamped to kvcd's max_chunk_bytes
  auto r = transfer::PutCacheWithTransfer(channel, &client, c.header, Tensors(c), po);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->path, PutPath::kChunks);
  EXPECT_NE(r->fallback_reason.find("max_message_bytes"), std::string::npos) << r->fallback_reason;
  EXPECT_EQ(r->response.input_bytes(), c.kv_bytes());
}

// GRPC_BYTES fetches cut a layer into pieces of --max_chunk_bytes, so layers larger than
// --max_message_bytes still arrive whole.
TEST(TransferKvcdOffTest, FetchedLayersOverTheMessageLimitArriveInPieces) {
  auto kvcd = StartWithSmallMessages();
  ASSERT_TRUE(kvcd.ok()) << kvcd.status();
  auto channel = Channel((*kvcd)->address());
  auto stub = testing::NewStub((*kvcd)->address());
  TestCache c = MakeCache("big-layers");
  c.header.clear_compression();  // uncompressed: 32 KiB+ per layer blob
  ASSERT_TRUE(testing::PutCache(stub.get(), c, nullptr, 4 << 10).ok());
  Fetched packed;
  GetCacheRequest req;
  req.set_cache_id("big-layers");
  req.set_format(kvcache::v1::FORMAT_PACKED);
  ASSERT_TRUE(testing::Get(stub.get(), req, &packed).ok());
  TransferClient client(channel, ClientOptions("decode-big"));
  ASSERT_TRUE(client.Open().ok());
  auto got = client.Fetch("big-layers");
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->layers.size(), c.k.size());
  for (uint32_t l = 0; l < got->layers.size(); ++l) {
    EXPECT_GT(got->layers[l].size(), 12u << 10);
    EXPECT_EQ(std::string(got->layers[l].begin(), got->layers[l].end()),
              packed.part(l, kvcache::v1::PART_PACKED))
        << "layer " << l;
  }
  client.Close().IgnoreError();
}

// The transfer service's RPCs appear in the per-method series next to the KvCache methods'.
TEST(TransferKvcdOffTest, TransferRpcsAreCountedPerMethodAndCode) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = {"--store_bytes=64MiB", "--backend=cpu", kChunkLimitFlag};
  auto kvcd = KvcdProcess::Start(opts);
  ASSERT_TRUE(kvcd.ok()) << kvcd.status();
  ASSERT_FALSE((*kvcd)->metrics_address().empty());
  auto stub = testing::NewStub((*kvcd)->address());
  const TestCache c = MakeCache("counted");
  ASSERT_TRUE(testing::PutCache(stub.get(), c, nullptr, 4 << 10).ok());
  {
    TransferClient client(Channel((*kvcd)->address()), ClientOptions("decode-counted"));
    ASSERT_TRUE(client.Open().ok());
    ASSERT_TRUE(client.Fetch("counted").ok());
    EXPECT_EQ(client.Fetch("never-stored").status().code(), absl::StatusCode::kNotFound);
    ASSERT_TRUE(client.Close().ok());
  }
  const std::string& m = (*kvcd)->metrics_address();
  for (const auto& [series, value] : std::vector<std::pair<std::string, double>>{
           {R"(grpc_server_started_total{grpc_method="Fetch"})", 2},
           {R"(grpc_server_handled_total{grpc_code="OK",grpc_method="Fetch"})", 1},
           {R"(grpc_server_handled_total{grpc_code="NOT_FOUND",grpc_method="Fetch"})", 1},
           {R"(grpc_server_handled_total{grpc_code="OK",grpc_method="OpenTransferSession"})", 1},
           {R"(grpc_server_handled_total{grpc_code="OK",grpc_method="CloseTransferSession"})", 1},
           {R"(grpc_server_handling_seconds_count{grpc_method="Fetch"})", 2},
       }) {
    EXPECT_TRUE(testing::WaitForMetric(m, series, value).ok())
        << series << ": " << testing::WaitForMetric(m, series, value, absl::ZeroDuration());
  }
}

TEST(TransferKvcdOffTest, BadTransferFlagExitsWithCode2) {
  KvcdProcess::Options opts;
  opts.binary = KVCD_PATH;
  opts.flags = {"--transfer=maybe"};
  opts.wait_for_ready = false;
  auto kvcd = KvcdProcess::Start(opts);
  ASSERT_TRUE(kvcd.ok()) << kvcd.status();
  auto code = (*kvcd)->Wait(absl::Seconds(20));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 2);
  EXPECT_NE((*kvcd)->output().find("--transfer"), std::string::npos) << (*kvcd)->output();
}

// The NCCL session path into kvcd's ingest, with the fake data plane standing in for NCCL: kvcd
// wired as kvcd_main.cc wires it (registry, sink, extra service), in process, so both ranks
// share the fake. Only the communicator differs from a real NCCL deployment (tests/gpu/README.md
// says how to run the real one on two GPUs).
TEST(TransferNcclPathTest, NcclSessionUploadStoresTheSameBytesAsChunks) {
  testing::FakeFactory fake;
  server::IngestRegistry registry;
  server::TransferIngestSink sink(&registry);
  server::KvcServer::Options options = testing::InProcessKvcdOptions(4 << 10);
  options.extra_services.push_back(
      [&](const server::ServerResources& r) -> absl::StatusOr<std::unique_ptr<grpc::Service>> {
        transfer::TransferServiceOptions t;
        t.sink = &sink;
        t.factory = &fake;
        r.state->ingest = &registry;
        return transfer::CreateTransferService(t);
      });
  auto server = server::KvcServer::Create(std::move(options));
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = Channel((*server)->address());
  auto stub = testing::NewStub((*server)->address());

  const TestCache chunked = MakeCache("nccl-chunks", 11);
  ASSERT_TRUE(testing::PutCache(stub.get(), chunked, nullptr, 4 << 10).ok());
  TestCache moved = chunked;
  moved.header.set_cache_id("nccl-transfer");
  TransferClient::Options co = ClientOptions("prefill-nccl");
  co.factory = &fake;
  TransferClient client(channel, co);
  // Each tensor's producer event goes with it to the data plane (stand-ins: the fake records).
  std::vector<TensorRef> tensors = Tensors(moved);
  std::vector<int> events(tensors.size());
  std::vector<const void*> want;
  for (size_t i = 0; i < tensors.size(); ++i) {
    tensors[i].ready_event = &events[i];
    want.push_back(&events[i]);
  }
  auto r = transfer::PutCacheWithTransfer(channel, &client, moved.header, tensors);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->path, PutPath::kNccl);
  EXPECT_EQ(r->fallback_reason, "");
  EXPECT_EQ(r->response.input_bytes(), chunked.kv_bytes());
  EXPECT_EQ(fake.ready_events(), want);
  // The session (and its group) is reused by the next upload.
  TestCache second = MakeCache("nccl-second", 12);
  auto r2 = transfer::PutCacheWithTransfer(channel, &client, second.header, Tensors(second));
  ASSERT_TRUE(r2.ok()) << r2.status();
  EXPECT_EQ(r2->path, PutPath::kNccl);
  EXPECT_EQ(fake.joins(), 2);  // one group: kvcd's rank 0 and the client's rank 1
  ASSERT_TRUE(client.Close().ok());
  EXPECT_EQ(registry.size(), 0);

  Fetched a, b;
  GetCacheRequest req;
  req.set_format(kvcache::v1::FORMAT_PACKED);
  req.set_cache_id("nccl-chunks");
  ASSERT_TRUE(testing::Get(stub.get(), req, &a).ok());
  req.set_cache_id("nccl-transfer");
  ASSERT_TRUE(testing::Get(stub.get(), req, &b).ok());
  ASSERT_FALSE(a.parts.empty());
  EXPECT_EQ(a.parts, b.parts);
}

}  // namespace
}  // namespace kvc

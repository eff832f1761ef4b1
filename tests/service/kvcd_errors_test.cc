// Every bad input and limit of PutCache/GetCache gets its documented status code, a message
// naming the problem, and leaves the store exactly as it was; unparsable unary requests are
// INVALID_ARGUMENT, and a flood of them does not flood kvcd's log.
#include <cmath>
#include <cstdio>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "grpcpp/generic/generic_stub.h"
#include "gtest/gtest.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"
#include "testing/shared_kvcd.h"

namespace kvc {
namespace {

using kvcache::v1::PutCacheRequest;
using ::testing::HasSubstr;
using testing::KvcdProcess;
using testing::StoreView;
using testing::TestCache;

// A KvCache unary call whose request is `request` as is: the generated stub could not send
// bytes protobuf refuses to parse (a string that is not UTF-8).
grpc::Status RawUnary(const std::shared_ptr<grpc::Channel>& channel, const std::string& method,
                      const std::string& request) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(30)));
  grpc::Slice slice(request);
  grpc::ByteBuffer req(&slice, 1), resp;
  std::promise<grpc::Status> done;
  stub.UnaryCall(&ctx, "/kvcache.v1.KvCache/" + method, grpc::StubOptions(), &req, &resp,
                 [&done](grpc::Status s) { done.set_value(std::move(s)); });
  return done.get_future().get();
}

// Field 1 (cache_id, prefix) holding the bytes FF FE, which are not UTF-8.
const std::string kNotUtf8("\x0a\x02\xff\xfe", 4);
// Field 1 announcing 5 bytes of which 2 ("ab") follow.
const std::string kTruncated("\x0a\x05\x61\x62", 4);

// Lines of `text` containing `needle`.
int CountLines(const std::string& text, const std::string& needle) {
  std::istringstream in(text);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += line.find(needle) != std::string::npos;
  return n;
}

// The sum of N over kvcd's "[libprotobuf] N log lines suppressed" lines.
uint64_t SuppressedLines(const std::string& text) {
  std::istringstream in(text);
  uint64_t total = 0;
  const std::string prefix = "[libprotobuf] ";
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(prefix, 0) == 0 && line.find("log lines suppressed") != std::string::npos) {
      total += std::stoull(line.substr(prefix.size()));
    }
  }
  return total;
}

class KvcdErrorsTest : public testing::SharedKvcdTest<KvcdErrorsTest> {
 public:
  static std::vector<std::string> KvcdFlags() {
    return {"--store_bytes=4MiB",       "--backend=cpu",
            "--max_chunk_bytes=16KiB",  "--max_message_bytes=64KiB",
            "--max_cache_bytes=512KiB", "--max_concurrent_streams=4",
            "--max_streams_per_peer=4"};
  }

 protected:
  void SetUp() override {
    SharedKvcdTest::SetUp();
    if (HasFatalFailure()) return;
    // Streams of the previous test (cancelled, past their deadline) may still hold their slot.
    ASSERT_NO_FATAL_FAILURE(SettleStreams(0));
    stub_ = testing::NewStub(kvcd_->address());
    // One stored cache, so "unchanged" is checked against a non-empty store.
    TestCache base = Small("base");
    grpc::Status s = testing::PutCache(stub_.get(), base);
    ASSERT_TRUE(s.ok() || s.error_code() == grpc::StatusCode::ALREADY_EXISTS) << s.error_message();
    before_ = testing::ViewStore(stub_.get());
    ASSERT_GE(before_.entries, 1u);
    // That upload's own slot, too, is given back only in its OnDone.
    ASSERT_NO_FATAL_FAILURE(SettleStreams(0));
  }
  void TearDown() override {
    if (stub_ == nullptr) return;  // SetUp failed before the store was looked at
    StoreView after = testing::ViewStore(stub_.get());
    EXPECT_EQ(after.used_bytes, before_.used_bytes);
    EXPECT_EQ(after.entries, before_.entries);
    EXPECT_EQ(after.ids, before_.ids);
  }

  static TestCache Small(const std::string& id) {
    return testing::MakeTestCache(id, testing::Shape(2, 2, 4, 32, 64, 8), kvcache::v1::DTYPE_F16,
                                  kvcache::v1::LAYOUT_HND, 42);
  }

  // A stream gives its slot back in the reactor's OnDone, which gRPC may run just after the
  // client saw the final status. With only 4 slots, back-to-back rejected uploads could otherwise
  // see RESOURCE_EXHAUSTED instead of the error under test: wait until `open` slots are held.
  static void SettleStreams(int open) {
    absl::Status s = testing::WaitForMetric(kvcd_->metrics_address(), "kvc_active_streams", open);
    ASSERT_TRUE(s.ok()) << s;
  }

  // Uploads `requests` and expects `code` with `text` in the message; `open_streams` are the
  // uploads the test itself holds open meanwhile.
  void ExpectPut(const std::vector<PutCacheRequest>& requests, grpc::StatusCode code,
                 const std::string& text, int open_streams = 0) {
    grpc::Status s = testing::Put(stub_.get(), requests, nullptr);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(text));
    SettleStreams(open_streams);
  }

  std::unique_ptr<kvcache::v1::KvCache::Stub> stub_;
  StoreView before_;
};

TEST_F(KvcdErrorsTest, BadHeaderFieldsAreInvalidArgumentNamingTheField) {
  struct Case {
    std::function<void(kvcache::v1::PutCacheHeader*)> mutate;
    std::string text;
  };
  const std::vector<Case> cases = {
      {[](auto* h) { h->mutable_shape()->set_head_dim(300); }, "head_dim"},
      {[](auto* h) { h->mutable_shape()->set_num_layers(0); }, "num_layers"},
      {[](auto* h) { h->mutable_shape()->set_num_q_heads(3); }, "num_q_heads"},
      {[](auto* h) { h->mutable_shape()->set_obs_window(65); }, "obs_window"},
      {[](auto* h) { h->set_dtype(kvcache::v1::DTYPE_UNSPECIFIED); }, "dtype"},
      {[](auto* h) { h->set_layout(static_cast<kvcache::v1::Layout>(7)); }, "layout"},
      {[](auto* h) { h->set_cache_id(""); }, "cache_id"},
      {[](auto* h) { h->set_cache_id("has space"); }, "cache_id"},
      {[](auto* h) { h->set_cache_id(std::string(257, 'a')); }, "cache_id"},
      {[](auto* h) { h->mutable_compression()->mutable_eviction()->set_policy("bogus"); },
       "eviction.policy"},
      {[](auto* h) { h->mutable_compression()->mutable_eviction()->set_keep_ratio(1.5); },
       "keep_ratio"},
      {[](auto* h) { h->mutable_compression()->mutable_channels()->set_key_lambda(1.5); },
       "key_lambda"},
      {[](auto* h) { h->mutable_compression()->mutable_quant()->set_bits(3); }, "bits"},
      {[](auto* h) {
         h->mutable_compression()->mutable_quant()->set_bits(8);
         h->mutable_compression()->mutable_quant()->set_value_bits(5);
       },
       "quant.value_bits: 5 is not one of 0, 2, 4, 8"},
      {[](auto* h) { h->mutable_compression()->mutable_quant()->set_value_bits(4); },
       "quant.value_bits: 4 needs quant.bits > 0"},
      {[](auto* h) {
         h->mutable_compression()->mutable_quant()->set_bits(8);
         h->mutable_compression()->mutable_quant()->set_value_bits(1u << 31);
       },
       "quant.value_bits: 2147483648 is not one of 0, 2, 4, 8"},
      {[](auto* h) { h->mutable_compression()->mutable_eviction()->set_pool("median"); }, "pool"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    TestCache c = Small("bad/header");
    cases[i].mutate(&c.header);
    ExpectPut(testing::MakeRequests(c, 16 << 10), grpc::StatusCode::INVALID_ARGUMENT,
              cases[i].text);
  }
}

TEST_F(KvcdErrorsTest, StreamStructureErrors) {
  TestCache c = Small("bad/structure");
  auto requests = testing::MakeRequests(c, 16 << 10);
  // No header at all, and a chunk first.
  ExpectPut({}, grpc::StatusCode::INVALID_ARGUMENT, "without a PutCacheHeader");
  ExpectPut({requests.begin() + 1, requests.end()}, grpc::StatusCode::INVALID_ARGUMENT,
            "first message must be a PutCacheHeader");
  // Header twice.
  auto twice = requests;
  twice.insert(twice.begin() + 2, requests[0]);
  ExpectPut(twice, grpc::StatusCode::INVALID_ARGUMENT, "second PutCacheHeader");
  // A message with neither header nor chunk.
  auto empty = requests;
  empty.insert(empty.begin() + 1, PutCacheRequest());
  ExpectPut(empty, grpc::StatusCode::INVALID_ARGUMENT, "neither header nor chunk");
}

TEST_F(KvcdErrorsTest, BadChunksAreRejected) {
  TestCache c = Small("bad/chunk");
  const auto good = testing::MakeRequests(c, 4096);
  auto with = [&](std::function<void(PutCacheRequest*)> mutate) {
    auto r = good;
    mutate(&r[1]);
    return r;
  };
  ExpectPut(with([](auto* r) { r->mutable_chunk()->set_layer(2); }),
            grpc::StatusCode::INVALID_ARGUMENT, "chunk.layer: 2 is outside [0, 2)");
  ExpectPut(with([](auto* r) { r->mutable_chunk()->set_tensor(kvcache::v1::TENSOR_UNSPECIFIED); }),
            grpc::StatusCode::INVALID_ARGUMENT, "chunk.tensor");
  ExpectPut(with([](auto* r) { r->mutable_chunk()->set_offset(8190); }),
            grpc::StatusCode::INVALID_ARGUMENT, "is outside layer 0 tensor K of 8192 bytes");
  // The same bytes twice (an overlapping chunk).
  auto dup = good;
  PutCacheRequest overlap = good[1];
  overlap.mutable_chunk()->set_offset(100);
  overlap.set_data(overlap.data().substr(0, 50));
  dup.insert(dup.begin() + 2, overlap);
  ExpectPut(dup, grpc::StatusCode::INVALID_ARGUMENT, "already received");
}

TEST_F(KvcdErrorsTest, TruncatedStreamNamesTheMissingBytes) {
  TestCache c = Small("bad/truncated");
  auto requests = testing::MakeRequests(c, 4096);
  // Drop the first chunk of layer 1's V (each K/V tensor is 8192 bytes = 2 chunks; Q_obs 2048).
  // Order per layer: K K V V Q, so layer 1 V starts at index 1 + 5 + 2.
  ASSERT_EQ(requests[8].chunk().layer(), 1u);
  ASSERT_EQ(requests[8].chunk().tensor(), kvcache::v1::TENSOR_V);
  requests.erase(requests.begin() + 8);
  ExpectPut(requests, grpc::StatusCode::INVALID_ARGUMENT,
            "layer 1 tensor V: 4096 of 8192 bytes received");
}

TEST_F(KvcdErrorsTest, ChunkOverMaxChunkBytesIsResourceExhausted) {
  TestCache c = Small("bad/bigchunk");
  c.header.mutable_shape()->set_seq_len(256);
  c = testing::MakeTestCache("bad/bigchunk", c.header.shape(), kvcache::v1::DTYPE_F16,
                             kvcache::v1::LAYOUT_HND, 1);
  // 20 KiB: over --max_chunk_bytes=16KiB, under --max_message_bytes=64KiB.
  ExpectPut(testing::MakeRequests(c, 20 << 10), grpc::StatusCode::RESOURCE_EXHAUSTED,
            "max_chunk_bytes");
}

TEST_F(KvcdErrorsTest, MessageOverMaxMessageBytesIsResourceExhausted) {
  TestCache c = testing::MakeTestCache("bad/bigmessage", testing::Shape(1, 2, 2, 64, 512, 0),
                                       kvcache::v1::DTYPE_F32, kvcache::v1::LAYOUT_HND, 1);
  // 128 KiB chunks: over --max_message_bytes=64KiB; gRPC itself refuses the message.
  grpc::Status s = testing::Put(stub_.get(), testing::MakeRequests(c, 128 << 10), nullptr);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
}

TEST_F(KvcdErrorsTest, CacheOverMaxCacheBytesIsRejectedAtTheHeader) {
  TestCache c = Small("bad/huge");
  c.header.mutable_shape()->set_seq_len(4096);  // 2 layers * 2 * 2 * 4096 * 32 * 2 B = 2 MiB
  // Only the header is sent: the rejection must not wait for the payload.
  PutCacheRequest header;
  *header.mutable_header() = c.header;
  ExpectPut({header}, grpc::StatusCode::RESOURCE_EXHAUSTED, "bytes per cache");
}

TEST_F(KvcdErrorsTest, DuplicateIdIsAlreadyExistsUnlessOverwrite) {
  TestCache c = Small("base");  // stored by SetUp
  ExpectPut(testing::MakeRequests(c, 16 << 10), grpc::StatusCode::ALREADY_EXISTS, "overwrite");
  // Overwrite with the same bytes keeps the store the same size and content.
  c.header.set_overwrite(true);
  kvcache::v1::PutCacheResponse resp;
  grpc::Status s = testing::Put(stub_.get(), testing::MakeRequests(c, 16 << 10), &resp);
  EXPECT_TRUE(s.ok()) << s.error_message();
}

TEST_F(KvcdErrorsTest, UnknownCacheIsNotFoundEverywhere) {
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("no/such");
  testing::Fetched fetched;
  EXPECT_EQ(testing::Get(stub_.get(), get, &fetched).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext c1, c2;
  kvcache::v1::StatCacheRequest stat;
  stat.set_cache_id("no/such");
  kvcache::v1::CacheInfo info;
  EXPECT_EQ(stub_->StatCache(&c1, stat, &info).error_code(), grpc::StatusCode::NOT_FOUND);
  kvcache::v1::DeleteCacheRequest del;
  del.set_cache_id("no/such");
  kvcache::v1::DeleteCacheResponse dr;
  EXPECT_EQ(stub_->DeleteCache(&c2, del, &dr).error_code(), grpc::StatusCode::NOT_FOUND);
}

// gRPC's generated handler answers a request it cannot parse with UNIMPLEMENTED and no message;
// kvcd parses its unary requests itself and names the message.
TEST_F(KvcdErrorsTest, UnparsableUnaryRequestsAreInvalidArgument) {
  auto channel = grpc::CreateChannel(kvcd_->address(), grpc::InsecureChannelCredentials());
  struct Case {
    std::string method, request_type, bytes;
  };
  const std::vector<Case> cases = {
      {"StatCache", "StatCacheRequest", kNotUtf8},
      {"StatCache", "StatCacheRequest", kTruncated},
      {"DeleteCache", "DeleteCacheRequest", kNotUtf8},
      {"DeleteCache", "DeleteCacheRequest", kTruncated},
      {"ListCaches", "ListCachesRequest", kNotUtf8},
      {"ListCaches", "ListCachesRequest", kTruncated},
      // GetServerInfoRequest has no fields: FF FE is an unknown field, but a truncated one fails.
      {"GetServerInfo", "GetServerInfoRequest", kTruncated},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.method + " " + std::to_string(c.bytes == kNotUtf8));
    grpc::Status s = RawUnary(channel, c.method, c.bytes);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("malformed kvcache.v1." + c.request_type));
  }
  // The raw path still serves well-formed requests.
  kvcache::v1::StatCacheRequest stat;
  stat.set_cache_id("base");
  EXPECT_TRUE(RawUnary(channel, "StatCache", stat.SerializeAsString()).ok());
}

// Protobuf logs a line for every string it refuses as not UTF-8; kvcd writes at most a few such
// lines a second and then one saying how many it dropped.
TEST_F(KvcdErrorsTest, NonUtf8IdsDoNotFloodTheLog) {
  auto channel = grpc::CreateChannel(kvcd_->address(), grpc::InsecureChannelCredentials());
  constexpr char kLine[] = "invalid UTF-8";
  const int lines_before = CountLines(kvcd_->output(), kLine);
  const uint64_t suppressed_before = SuppressedLines(kvcd_->output());
  const absl::Time start = absl::Now();
  int sent = 0;
  for (; sent < 200; ++sent) EXPECT_FALSE(RawUnary(channel, "StatCache", kNotUtf8).ok());
  // The count of dropped lines is written with the next line kvcd logs after a window ends, and
  // output arrives asynchronously: keep sending one more now and then until every request sent
  // is accounted for by a line or the count.
  int lines = 0;
  uint64_t suppressed = 0;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  for (;;) {
    const std::string out = kvcd_->output();
    lines = CountLines(out, kLine) - lines_before;
    suppressed = SuppressedLines(out) - suppressed_before;
    if (suppressed > 0 && lines + suppressed >= static_cast<uint64_t>(sent)) break;
    if (absl::Now() > deadline) break;
    absl::SleepFor(absl::Milliseconds(250));
    EXPECT_FALSE(RawUnary(channel, "StatCache", kNotUtf8).ok());
    ++sent;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  std::printf("%d protobuf log lines and %llu counted as dropped for %d requests in %.2f s\n",
              lines, static_cast<unsigned long long>(suppressed), sent, seconds);
  EXPECT_GT(suppressed, 0u) << lines << " lines for " << sent << " requests";
  EXPECT_GE(lines + suppressed, static_cast<uint64_t>(sent));
  // 5 lines a second (kProtobufLogLinesPerSecond), in every started second; one more second's
  // worth for a window already open at the start and lines of earlier tests still in the pipe.
  EXPECT_LE(lines, 5 * (static_cast<int>(std::ceil(seconds)) + 2))
      << sent << " requests in " << seconds << " s";
}

TEST_F(KvcdErrorsTest, BadGetRequests) {
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("base");
  get.set_layer_begin(1);
  get.set_layer_end(5);
  testing::Fetched f1, f2, f3;
  grpc::Status s = testing::Get(stub_.get(), get, &f1);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("layer_end"));
  get.clear_layer_end();
  get.set_format(static_cast<kvcache::v1::Format>(9));
  s = testing::Get(stub_.get(), get, &f2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("format"));
  get.set_cache_id("bad id");
  EXPECT_EQ(testing::Get(stub_.get(), get, &f3).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(KvcdErrorsTest, ClientCancelMidUploadStoresNothing) {
  TestCache c = Small("bad/cancel");
  const auto requests = testing::MakeRequests(c, 4096);
  for (size_t sent : {requests.size() / 2, requests.size()}) {
    // Half the payload, then the whole payload but no WritesDone: both cancelled.
    grpc::ClientContext ctx;
    kvcache::v1::PutCacheResponse resp;
    auto writer = stub_->PutCache(&ctx, &resp);
    for (size_t i = 0; i < sent; ++i) ASSERT_TRUE(writer->Write(requests[i]));
    absl::SleepFor(absl::Milliseconds(100));  // let the server place (and compress) them
    ctx.TryCancel();
    EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  absl::SleepFor(absl::Milliseconds(200));
}

TEST_F(KvcdErrorsTest, DeadlineExceededMidUploadStoresNothing) {
  TestCache c = Small("bad/deadline");
  const auto requests = testing::MakeRequests(c, 4096);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(300)));
  kvcache::v1::PutCacheResponse resp;
  auto writer = stub_->PutCache(&ctx, &resp);
  for (size_t i = 0; i < requests.size() - 1; ++i) writer->Write(requests[i]);
  absl::SleepFor(absl::Milliseconds(600));
  writer->Write(requests.back());
  writer->WritesDone();
  EXPECT_EQ(writer->Finish().error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  absl::SleepFor(absl::Milliseconds(200));
}

TEST_F(KvcdErrorsTest, StreamsOverTheConcurrencyLimitAreResourceExhausted) {
  TestCache c = Small("bad/streams");
  const auto requests = testing::MakeRequests(c, 4096);
  struct Open {
    grpc::ClientContext ctx;
    kvcache::v1::PutCacheResponse resp;
    std::unique_ptr<grpc::ClientWriter<PutCacheRequest>> writer;
  };
  std::vector<std::unique_ptr<Open>> open;
  for (int i = 0; i < 4; ++i) {  // --max_concurrent_streams=4
    auto o = std::make_unique<Open>();
    o->writer = stub_->PutCache(&o->ctx, &o->resp);
    PutCacheRequest h = requests[0];
    h.mutable_header()->set_cache_id("bad/streams" + std::to_string(i));
    ASSERT_TRUE(o->writer->Write(h));
    open.push_back(std::move(o));
  }
  SettleStreams(4);  // every stream holds its slot
  ExpectPut(requests, grpc::StatusCode::RESOURCE_EXHAUSTED, "max_concurrent_streams", 4);
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("base");
  testing::Fetched f;
  EXPECT_EQ(testing::Get(stub_.get(), get, &f).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  for (auto& o : open) {
    o->ctx.TryCancel();
    o->writer->Finish();
  }
  SettleStreams(0);
  // Slots are released: a new upload works again (and is deleted to keep the store unchanged).
  grpc::Status s = testing::Put(stub_.get(), requests, nullptr);
  EXPECT_TRUE(s.ok()) << s.error_message();
  grpc::ClientContext ctx;
  kvcache::v1::DeleteCacheRequest del;
  del.set_cache_id("bad/streams");
  kvcache::v1::DeleteCacheResponse dr;
  EXPECT_TRUE(stub_->DeleteCache(&ctx, del, &dr).ok());
}

}  // namespace
}  // namespace kvc

// Client options, status conversion and client-side validation (no server needed: every case
// here fails before or at the connection).
#include "kvc/client.h"

#include <grpcpp/support/status.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kvc {
namespace {

namespace pb = kvcache::v1;

TEST(FromGrpcStatus, KeepsEveryCodeAndMessage) {
  EXPECT_TRUE(FromGrpcStatus(grpc::Status::OK).ok());
  for (int c = 1; c <= 16; ++c) {
    const absl::Status s =
        FromGrpcStatus(grpc::Status(static_cast<grpc::StatusCode>(c), "msg " + std::to_string(c)));
    EXPECT_EQ(static_cast<int>(s.code()), c);
    EXPECT_EQ(s.message(), "msg " + std::to_string(c));
  }
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::UNAVAILABLE, "down")).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(FromGrpcStatus(grpc::Status(grpc::StatusCode::NOT_FOUND, "x")).code(),
            absl::StatusCode::kNotFound);
}

TEST(StatusCodeName, GrpcSpelling) {
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kUnavailable), "UNAVAILABLE");
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kNotFound), "NOT_FOUND");
  EXPECT_EQ(StatusCodeName(absl::StatusCode::kInvalidArgument), "INVALID_ARGUMENT");
}

absl::Status CreateWith(void (*edit)(ClientOptions*)) {
  ClientOptions o;
  edit(&o);
  return Client::Create(o).status();
}

void ExpectRejected(void (*edit)(ClientOptions*), const std::string& field) {
  const absl::Status s = CreateWith(edit);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_NE(s.message().find(field), absl::string_view::npos) << s;
}

TEST(ClientCreate, ChunkBytesLimits) {
  EXPECT_TRUE(CreateWith([](ClientOptions* o) { o->max_chunk_bytes = kMinChunkBytes; }).ok());
  EXPECT_TRUE(CreateWith([](ClientOptions* o) { o->max_chunk_bytes = kMaxChunkBytes; }).ok());
  ExpectRejected([](ClientOptions* o) { o->max_chunk_bytes = kMinChunkBytes - 1; },
                 "max_chunk_bytes");
  ExpectRejected([](ClientOptions* o) { o->max_chunk_bytes = kMaxChunkBytes + 1; },
                 "max_chunk_bytes");
}

TEST(ClientCreate, OtherLimits) {
  ExpectRejected([](ClientOptions* o) { o->target = ""; }, "target");
  ExpectRejected([](ClientOptions* o) { o->target = "a:1,,b:2"; }, "target");
  ExpectRejected([](ClientOptions* o) { o->max_attempts = 0; }, "max_attempts");
  ExpectRejected([](ClientOptions* o) { o->max_attempts = 11; }, "max_attempts");
  EXPECT_TRUE(CreateWith([](ClientOptions* o) { o->max_attempts = 10; }).ok());
  ExpectRejected([](ClientOptions* o) { o->unary_timeout = absl::ZeroDuration(); },
                 "unary_timeout");
  ExpectRejected([](ClientOptions* o) { o->stream_timeout = absl::Seconds(-1); }, "stream_timeout");
  ExpectRejected([](ClientOptions* o) { o->max_backoff = absl::Milliseconds(1); }, "backoff");
  ExpectRejected([](ClientOptions* o) { o->max_message_bytes = 4 << 20; }, "max_message_bytes");
  ExpectRejected([](ClientOptions* o) { o->max_message_bytes = (1 << 30) + 1; },
                 "max_message_bytes");
  ExpectRejected([](ClientOptions* o) { o->bearer_token = "abc\ndef"; }, "bearer_token");
}

TEST(ClientCreate, TlsOptions) {
  ExpectRejected([](ClientOptions* o) { o->tls_ca_file = "ca.pem"; }, "tls");
  ExpectRejected([](ClientOptions* o) { o->tls_server_name_override = "localhost"; }, "tls");
  ExpectRejected(
      [](ClientOptions* o) {
        o->tls = true;
        o->tls_cert_file = "client.pem";
      },
      "tls_key_file");
  ExpectRejected(
      [](ClientOptions* o) {
        o->tls = true;
        o->tls_key_file = "client.key";
      },
      "tls_cert_file");
  ExpectRejected(
      [](ClientOptions* o) {
        o->tls = true;
        o->tls_ca_file = "/nonexistent/ca.pem";
      },
      "tls_ca_file");
  ExpectRejected(
      [](ClientOptions* o) {
        o->tls = true;
        o->tls_ca_file = "/dev/null";  // readable but empty
      },
      "tls_ca_file");
  // TLS with the system roots needs no files.
  EXPECT_TRUE(CreateWith([](ClientOptions* o) { o->tls = true; }).ok());
}

TEST(ClientCreate, ReplicaSetFromList) {
  ClientOptions o;
  o.target = "127.0.0.1:3,127.0.0.1:1,127.0.0.1:2";
  auto c = Client::Create(o);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ((*c)->replicas(),
            (std::vector<std::string>{"127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"}));
  EXPECT_LT((*c)->ReplicaFor("anything"), 3u);
  EXPECT_EQ((*c)->GetServerInfo(3).status().code(), absl::StatusCode::kInvalidArgument);
}

// A port nothing listens on: bind a socket? Port 1 on loopback is refused for non-root and root
// alike when no service runs there.
std::unique_ptr<Client> UnreachableClient() {
  ClientOptions o;
  o.target = "127.0.0.1:1";
  o.max_attempts = 2;
  o.initial_backoff = absl::Milliseconds(1);
  o.unary_timeout = absl::Seconds(5);
  return *Client::Create(o);
}

TEST(Client, UnreachableServerIsUnavailable) {
  auto c = UnreachableClient();
  EXPECT_EQ(c->StatCache("x").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c->GetCache("x").status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(c->ListCaches().status().code(), absl::StatusCode::kUnavailable);
}

pb::PutCacheHeader SmallHeader() {
  pb::PutCacheHeader h;
  h.set_cache_id("c");
  h.set_dtype(pb::DTYPE_F16);
  pb::ModelShape* s = h.mutable_shape();
  s->set_num_layers(2);
  s->set_num_kv_heads(2);
  s->set_num_q_heads(4);
  s->set_head_dim(8);
  s->set_seq_len(16);
  s->set_obs_window(4);
  return h;
}

TEST(Client, PutCacheValidatesBeforeSending) {
  auto c = UnreachableClient();  // reaching the network would answer UNAVAILABLE instead
  std::vector<uint16_t> kv(2 * 16 * 8), q(4 * 4 * 8);
  const LayerTensors good{kv.data(), kv.data(), q.data()};
  const std::vector<LayerTensors> layers = {good, good};
  auto expect_invalid = [&](const pb::PutCacheHeader& h, absl::Span<const LayerTensors> l,
                            const std::string& field) {
    const absl::Status s = c->PutCache(h, l).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), absl::string_view::npos) << s;
  };
  pb::PutCacheHeader h = SmallHeader();
  expect_invalid(h, absl::MakeConstSpan(layers).subspan(0, 1), "layers");
  h.set_cache_id("");
  expect_invalid(h, layers, "cache_id");
  h = SmallHeader();
  h.set_dtype(pb::DTYPE_UNSPECIFIED);
  expect_invalid(h, layers, "dtype");
  h = SmallHeader();
  h.mutable_shape()->set_obs_window(17);
  expect_invalid(h, layers, "obs_window");
  h = SmallHeader();
  h.mutable_shape()->set_head_dim(0);
  expect_invalid(h, layers, "head_dim");
  h = SmallHeader();
  h.set_layout(static_cast<pb::Layout>(9));
  expect_invalid(h, layers, "layout");
  // Tensor sizes are overflow-checked products, never wrapped.
  h = SmallHeader();
  h.mutable_shape()->set_num_kv_heads(0xFFFFFFFFu);
  h.mutable_shape()->set_seq_len(0xFFFFFFFFu);
  h.mutable_shape()->set_head_dim(0xFFFFFFFFu);
  expect_invalid(h, layers,
                 "header.shape: num_kv_heads*seq_len*head_dim*dtype_bytes = "
                 "4294967295*4294967295*4294967295*2 overflows 64 bits");
  h = SmallHeader();
  h.mutable_shape()->set_num_kv_heads(1u << 20);
  h.mutable_shape()->set_seq_len(1u << 20);
  h.mutable_shape()->set_head_dim(1u << 10);
  expect_invalid(h, layers, "over the limit");
  h = SmallHeader();
  std::vector<LayerTensors> bad = layers;
  bad[1].q_obs = nullptr;
  expect_invalid(h, bad, "q_obs");
  bad = layers;
  bad[0].k = nullptr;
  expect_invalid(h, bad, "layers[0]");
  // A valid request does reach the network.
  EXPECT_EQ(c->PutCache(SmallHeader(), layers).status().code(), absl::StatusCode::kUnavailable);
  // kvzip's reconstruction rows may outnumber the tokens (W = 17 > S = 16).
  std::vector<uint16_t> q17(4 * 17 * 8);
  const LayerTensors rows{kv.data(), kv.data(), q17.data()};
  h = SmallHeader();
  h.mutable_shape()->set_obs_window(17);
  h.mutable_compression()->mutable_eviction()->set_policy("kvzip");
  EXPECT_EQ(c->PutCache(h, {rows, rows}).status().code(), absl::StatusCode::kUnavailable);
}

TEST(Client, GetCacheValidatesOptions) {
  auto c = UnreachableClient();
  GetOptions o;
  o.layer_begin = 3;
  o.layer_end = 3;
  EXPECT_EQ(c->GetCache("x", o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->GetCache("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->StatCache("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->DeleteCache("").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvc

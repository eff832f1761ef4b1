#include "kvc/client.h"

#include <grpcpp/grpcpp.h>
#include <grpcpp/impl/rpc_method.h>
#include <grpcpp/support/sync_stream.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/notification.h"
#include "kvc/buffer_pool.h"
#include "kvc/checked_math.h"
#include "kvc/client_wire.h"
#include "kvc/replicas.h"
#include "kvc/status_macros.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "src/layer_assembler.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;

constexpr char kPutMethod[] = "/kvcache.v1.KvCache/PutCache";
constexpr char kGetMethod[] = "/kvcache.v1.KvCache/GetCache";

absl::Status ValidateOptions(const ClientOptions& o) {
  if (o.target.empty()) return absl::InvalidArgumentError("target: empty");
  if (o.unary_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("unary_timeout: must be positive");
  }
  if (o.stream_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("stream_timeout: must be positive");
  }
  if (o.max_attempts < 1 || o.max_attempts > 10) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_attempts: ", o.max_attempts, " is outside [1, 10]"));
  }
  if (o.initial_backoff < absl::ZeroDuration() || o.max_backoff < o.initial_backoff) {
    return absl::InvalidArgumentError("initial_backoff/max_backoff: need 0 <= initial <= max");
  }
  if (o.keepalive_time < absl::Seconds(10) || o.keepalive_time > absl::Hours(2)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keepalive_time: ", absl::FormatDuration(o.keepalive_time), " is outside [10s, 2h]"));
  }
  if (o.keepalive_timeout < absl::Seconds(1) || o.keepalive_timeout > absl::Minutes(10)) {
    return absl::InvalidArgumentError(absl::StrCat("keepalive_timeout: ",
                                                   absl::FormatDuration(o.keepalive_timeout),
                                                   " is outside [1s, 10m]"));
  }
  if (o.max_chunk_bytes < kMinChunkBytes || o.max_chunk_bytes > kMaxChunkBytes) {
    return absl::InvalidArgumentError(absl::StrCat("max_chunk_bytes: ", o.max_chunk_bytes,
                                                   " is outside [", kMinChunkBytes, ", ",
                                                   kMaxChunkBytes, "]"));
  }
  if (o.max_message_bytes < static_cast<int>(kMaxChunkBytes + 4096) ||
      o.max_message_bytes > (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrCat("max_message_bytes: ", o.max_message_bytes,
                                                   " is outside [", kMaxChunkBytes + 4096, ", ",
                                                   1 << 30, "]"));
  }
  for (char c : o.bearer_token) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("bearer_token: must be printable ASCII");
    }
  }
  if (!o.tls && (!o.tls_ca_file.empty() || !o.tls_cert_file.empty() || !o.tls_key_file.empty() ||
                 !o.tls_server_name_override.empty())) {
    return absl::InvalidArgumentError("tls: must be true when any tls_* field is set");
  }
  if (o.tls_cert_file.empty() != o.tls_key_file.empty()) {
    return absl::InvalidArgumentError(o.tls_cert_file.empty()
                                          ? "tls_cert_file: required with tls_key_file"
                                          : "tls_key_file: required with tls_cert_file");
  }
  return absl::OkStatus();
}

// Reads a PEM file for `field`; only the path appears in errors, never the contents (a key).
absl::StatusOr<std::string> ReadPem(const std::string& field, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read ", path));
  std::string pem((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read ", path));
  if (pem.empty()) return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, " is empty"));
  if (pem.find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", path, " is not PEM"));
  }
  return pem;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentials(
    const ClientOptions& o) {
  if (!o.tls) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  if (!o.tls_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadPem("tls_ca_file", o.tls_ca_file));
  }
  if (!o.tls_cert_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_cert_chain, ReadPem("tls_cert_file", o.tls_cert_file));
    ASSIGN_OR_RETURN(ssl.pem_private_key, ReadPem("tls_key_file", o.tls_key_file));
  }
  return grpc::SslCredentials(ssl);
}

bool Retryable(grpc::StatusCode code) {
  return code == grpc::StatusCode::UNAVAILABLE || code == grpc::StatusCode::RESOURCE_EXHAUSTED;
}

struct Replica {
  std::string address;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<pb::KvCache::Stub> stub;
  std::unique_ptr<grpc::internal::RpcMethod> put_method;
  std::unique_ptr<grpc::internal::RpcMethod> get_method;
};

// Byte sizes of the three tensors of one layer, from the header; rejects what cannot be sent.
struct TensorSizes {
  uint64_t kv = 0;
  uint64_t q = 0;
  uint64_t stats = 0;  // TENSOR_Q_STATS, with eviction.query_stats
};

absl::StatusOr<TensorSizes> SizesFromHeader(const PutHeader& h) {
  const pb::ModelShape& s = h.shape();
  if (h.cache_id().empty()) return absl::InvalidArgumentError("header.cache_id: empty");
  if (s.num_layers() == 0) return absl::InvalidArgumentError("shape.num_layers: must be >= 1");
  if (s.num_kv_heads() == 0) return absl::InvalidArgumentError("shape.num_kv_heads: must be >= 1");
  if (s.num_q_heads() == 0) return absl::InvalidArgumentError("shape.num_q_heads: must be >= 1");
  if (s.head_dim() == 0) return absl::InvalidArgumentError("shape.head_dim: must be >= 1");
  if (s.seq_len() == 0) return absl::InvalidArgumentError("shape.seq_len: must be >= 1");
  // kvzip's rows come from a reconstruction pass after the prompt: they may outnumber its tokens.
  if (s.obs_window() > s.seq_len() && h.compression().eviction().policy() != "kvzip") {
    return absl::InvalidArgumentError(
        absl::StrCat("shape.obs_window: ", s.obs_window(), " exceeds seq_len ", s.seq_len(),
                     " (only kvzip's reconstruction rows may outnumber the tokens)"));
  }
  uint64_t elem = 0;
  switch (h.dtype()) {
    case pb::DTYPE_F32:
      elem = 4;
      break;
    case pb::DTYPE_F16:
    case pb::DTYPE_BF16:
      elem = 2;
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("header.dtype: ", h.dtype(), " is not F32, F16 or BF16"));
  }
  if (h.layout() != pb::LAYOUT_UNSPECIFIED && h.layout() != pb::LAYOUT_HND &&
      h.layout() != pb::LAYOUT_NHD) {
    return absl::InvalidArgumentError(absl::StrCat("header.layout: ", h.layout(), " is unknown"));
  }
  // Overflow-checked (kvc/checked_math.h); anything past 2^48 bytes per tensor is nonsense.
  ASSIGN_OR_RETURN(const uint64_t kv,
                   CheckedProduct("header.shape", {{"num_kv_heads", s.num_kv_heads()},
                                                   {"seq_len", s.seq_len()},
                                                   {"head_dim", s.head_dim()},
                                                   {"dtype_bytes", elem}}));
  ASSIGN_OR_RETURN(const uint64_t q,
                   CheckedProduct("header.shape", {{"num_q_heads", s.num_q_heads()},
                                                   {"obs_window", s.obs_window()},
                                                   {"head_dim", s.head_dim()},
                                                   {"dtype_bytes", elem}}));
  constexpr uint64_t kLimit = uint64_t{1} << 48;
  if (kv > kLimit || q > kLimit) {
    return absl::InvalidArgumentError(absl::StrCat("header.shape: a tensor of ", std::max(kv, q),
                                                   " bytes is over the limit of ", kLimit));
  }
  uint64_t stats = 0;
  if (h.compression().eviction().query_stats() && h.compression().eviction().policy() == "kvzip") {
    // kvzip: each observation row's log-mass over keys not uploaded, [Hq, W].
    ASSIGN_OR_RETURN(stats, CheckedProduct("header.shape", {{"num_q_heads", s.num_q_heads()},
                                                            {"obs_window", s.obs_window()},
                                                            {"float_bytes", 4}}));
  } else if (h.compression().eviction().query_stats()) {
    const uint64_t d = s.head_dim();
    ASSIGN_OR_RETURN(stats, CheckedProduct("header.shape", {{"num_q_heads", s.num_q_heads()},
                                                            {"head_dim+head_dim^2", d + d * d},
                                                            {"float_bytes", 4}}));
    if (stats > kLimit) {
      return absl::InvalidArgumentError(
          absl::StrCat("header.shape: Q_stats of ", stats, " bytes is over the limit of ", kLimit));
    }
  }
  return TensorSizes{kv, q, stats};
}

class ClientImpl final : public Client {
 public:
  ClientImpl(const ClientOptions& options, std::vector<std::string> addresses,
             const std::shared_ptr<grpc::ChannelCredentials>& credentials)
      : options_(options), addresses_(std::move(addresses)) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(options.max_message_bytes);
    args.SetMaxSendMessageSize(options.max_message_bytes);
    // Setting the keepalive time also makes gRPC set TCP_USER_TIMEOUT = keepalive_timeout on the
    // socket: written data that stays unacknowledged (a vanished peer) or unsent (a peer that
    // stopped reading: a zero window) that long fails the connection.
    args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_time)));
    args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                static_cast<int>(absl::ToInt64Milliseconds(options.keepalive_timeout)));
    if (!options.tls_server_name_override.empty()) {
      args.SetSslTargetNameOverride(options.tls_server_name_override);
    }
    for (const std::string& address : addresses_) {
      Replica r;
      r.address = address;
      r.channel = grpc::CreateCustomChannel(address, credentials, args);
      r.stub = pb::KvCache::NewStub(r.channel);
      r.put_method = std::make_unique<grpc::internal::RpcMethod>(
          kPutMethod, grpc::internal::RpcMethod::CLIENT_STREAMING, r.channel);
      r.get_method = std::make_unique<grpc::internal::RpcMethod>(
          kGetMethod, grpc::internal::RpcMethod::SERVER_STREAMING, r.channel);
      replicas_.push_back(std::move(r));
    }
  }

  absl::StatusOr<PutResult> PutCache(const PutHeader& header,
                                     absl::Span<const LayerTensors> layers) override;
  absl::StatusOr<CacheData> GetCache(const std::string& cache_id,
                                     const GetOptions& options) override;
  absl::Status GetCacheStreaming(const std::string& cache_id, const GetOptions& options,
                                 const std::function<absl::Status(const CacheInfo&)>& on_info,
                                 const std::function<absl::Status(LayerData&&)>& on_layer) override;
  absl::StatusOr<CacheInfo> StatCache(const std::string& cache_id) override;
  absl::StatusOr<uint64_t> DeleteCache(const std::string& cache_id) override;
  absl::StatusOr<std::vector<CacheInfo>> ListCaches(const std::string& prefix) override;
  absl::StatusOr<ServerInfo> GetServerInfo(size_t replica) override;

  const std::vector<std::string>& replicas() const override { return addresses_; }
  size_t ReplicaFor(const std::string& cache_id) const override {
    return addresses_.size() == 1 ? 0 : RendezvousOwner(cache_id, addresses_);
  }

 private:
  void Prepare(grpc::ClientContext* ctx, absl::Time deadline) const {
    ctx->set_deadline(absl::ToChronoTime(deadline));
    if (!options_.bearer_token.empty()) {
      ctx->AddMetadata("authorization", "Bearer " + options_.bearer_token);
    }
  }

  // Runs `call(ctx)` until it succeeds, fails for good, runs out of attempts or of time.
  template <typename Call>
  absl::Status WithRetry(const Call& call) const {
    const absl::Time deadline = absl::Now() + options_.unary_timeout;
    absl::Duration backoff = options_.initial_backoff;
    for (int attempt = 1;; ++attempt) {
      grpc::ClientContext ctx;
      Prepare(&ctx, deadline);
      const grpc::Status s = call(&ctx);
      if (s.ok() || !Retryable(s.error_code()) || attempt >= options_.max_attempts ||
          absl::Now() + backoff >= deadline) {
        return FromGrpcStatus(s);
      }
      absl::SleepFor(backoff);
      backoff = std::min(backoff * 2, options_.max_backoff);
    }
  }

  absl::Status GetOnce(const Replica& r, const pb::GetCacheRequest& req,
                       const std::function<absl::Status(const CacheInfo&)>& on_info,
                       const std::function<absl::Status(LayerData&&)>& on_layer, bool* delivered);

  ClientOptions options_;
  std::vector<std::string> addresses_;
  std::vector<Replica> replicas_;
};

absl::StatusOr<PutResult> ClientImpl::PutCache(const PutHeader& header,
                                               absl::Span<const LayerTensors> layers) {
  ASSIGN_OR_RETURN(const TensorSizes sizes, SizesFromHeader(header));
  if (layers.size() != header.shape().num_layers()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layers: ", layers.size(), " given, shape.num_layers is ", header.shape().num_layers()));
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    if (layers[l].k == nullptr || layers[l].v == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("layers[", l, "]: k or v is null"));
    }
    if (sizes.q > 0 && layers[l].q_obs == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers[", l, "].q_obs: null with shape.obs_window > 0"));
    }
    if (sizes.stats > 0 && layers[l].q_stats == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers[", l, "].q_stats: null with eviction.query_stats set"));
    }
    if (sizes.stats == 0 && layers[l].q_stats != nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("layers[", l, "].q_stats: set without eviction.query_stats"));
    }
  }
  const Replica& r = replicas_[ReplicaFor(header.cache_id())];
  // The chunks' slices point into the caller's tensors (no copy). gRPC's transport may still hold
  // one after Finish() returns (a write being flushed when the stream broke: a use after free of
  // the caller's tensors, found by the sanitized soak), so every slice holds a copy of `lease`,
  // and PutCache returns only after the call is destroyed and the transport let go of them all.
  absl::Notification released;
  std::shared_ptr<const void> lease(&released, [](const void* n) {
    static_cast<absl::Notification*>(const_cast<void*>(n))->Notify();
  });
  auto ctx = std::make_unique<grpc::ClientContext>();
  Prepare(ctx.get(), absl::Now() + options_.stream_timeout);
  PutResult result;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(r.channel.get(), *r.put_method,
                                                                    ctx.get(), &result));
  pb::PutCacheRequest first;
  *first.mutable_header() = header;
  // A failed Write means the stream is broken; Finish() then reports the server's status.
  bool ok = writer->Write(FrameMessage(first));
  const std::vector<ChunkSpan> kv_chunks = SplitChunks(sizes.kv, options_.max_chunk_bytes);
  const std::vector<ChunkSpan> q_chunks = SplitChunks(sizes.q, options_.max_chunk_bytes);
  const std::vector<ChunkSpan> stat_chunks = SplitChunks(sizes.stats, options_.max_chunk_bytes);
  pb::ChunkHeader chunk;
  for (size_t l = 0; ok && l < layers.size(); ++l) {
    chunk.set_layer(static_cast<uint32_t>(l));
    // The queries first, then K, then V: kvcd scores a layer from K and the queries while its V
    // is still arriving.
    const std::pair<pb::TensorKind, const void*> tensors[4] = {
        {pb::TENSOR_Q_OBS, layers[l].q_obs},
        {pb::TENSOR_Q_STATS, layers[l].q_stats},
        {pb::TENSOR_K, layers[l].k},
        {pb::TENSOR_V, layers[l].v}};
    for (const auto& [kind, base] : tensors) {
      chunk.set_tensor(kind);
      const std::vector<ChunkSpan>& spans = kind == pb::TENSOR_Q_OBS     ? q_chunks
                                            : kind == pb::TENSOR_Q_STATS ? stat_chunks
                                                                         : kv_chunks;
      for (const ChunkSpan& c : spans) {
        chunk.set_offset(c.offset);
        const uint8_t* data = static_cast<const uint8_t*>(base) + c.offset;
        if (!(ok = writer->Write(FramePutChunk(chunk, data, c.size, lease)))) break;
      }
      if (!ok) break;
    }
  }
  if (ok) writer->WritesDone();
  const grpc::Status status = writer->Finish();
  writer.reset();
  ctx.reset();
  lease.reset();
  // The call is gone, so the transport drops its queued writes; one already on the socket ends
  // when it is written or the connection fails, and the connection fails when that write makes
  // no progress for keepalive_timeout (TCP_USER_TIMEOUT, set with the channel): PutCache returns
  // at most about keepalive_timeout after the stream ended, however the server stalls
  // (stalled_peer_test holds it). Returning earlier would hand the caller memory the transport
  // still reads.
  released.WaitForNotification();
  RETURN_IF_ERROR(FromGrpcStatus(status));
  return result;
}

absl::StatusOr<CacheData> ClientImpl::GetCache(const std::string& cache_id,
                                               const GetOptions& options) {
  CacheData out;
  RETURN_IF_ERROR(GetCacheStreaming(
      cache_id, options,
      [&out](const CacheInfo& info) {
        out.info = info;
        return absl::OkStatus();
      },
      [&out](LayerData&& layer) {
        out.layers.push_back(std::move(layer));
        return absl::OkStatus();
      }));
  return out;
}

absl::Status ClientImpl::GetCacheStreaming(
    const std::string& cache_id, const GetOptions& options,
    const std::function<absl::Status(const CacheInfo&)>& on_info,
    const std::function<absl::Status(LayerData&&)>& on_layer) {
  if (cache_id.empty()) return absl::InvalidArgumentError("cache_id: empty");
  if (!on_layer) return absl::InvalidArgumentError("on_layer: empty callback");
  if (options.layer_end.has_value() && *options.layer_end <= options.layer_begin) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layer_end: ", *options.layer_end, " must exceed layer_begin ", options.layer_begin));
  }
  pb::GetCacheRequest req;
  req.set_cache_id(cache_id);
  req.set_format(options.format == CacheFormat::kDense ? pb::FORMAT_DENSE : pb::FORMAT_PACKED);
  if (options.contiguous_rope.has_value()) {
    if (options.format != CacheFormat::kDense) {
      return absl::InvalidArgumentError("contiguous_rope: needs format kDense");
    }
    req.set_format(pb::FORMAT_DENSE_CONTIGUOUS);
    *req.mutable_rope() = *options.contiguous_rope;
  }
  req.set_layer_begin(options.layer_begin);
  if (options.layer_end.has_value()) req.set_layer_end(*options.layer_end);
  const Replica& r = replicas_[ReplicaFor(cache_id)];
  absl::Duration backoff = options_.initial_backoff;
  for (int attempt = 1;; ++attempt) {
    bool delivered = false;
    absl::Status s = GetOnce(r, req, on_info, on_layer, &delivered);
    if (s.ok() || delivered || s.code() != absl::StatusCode::kUnavailable ||
        attempt >= options_.max_attempts) {
      return s;
    }
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, options_.max_backoff);
  }
}

absl::Status ClientImpl::GetOnce(const Replica& r, const pb::GetCacheRequest& req,
                                 const std::function<absl::Status(const CacheInfo&)>& on_info,
                                 const std::function<absl::Status(LayerData&&)>& on_layer,
                                 bool* delivered) {
  grpc::ClientContext ctx;
  Prepare(&ctx, absl::Now() + options_.stream_timeout);
  std::unique_ptr<grpc::ClientReader<grpc::ByteBuffer>> reader(
      grpc::internal::ClientReaderFactory<grpc::ByteBuffer>::Create(r.channel.get(), *r.get_method,
                                                                    &ctx, req));
  // Any local failure (bad stream content, a callback's error) cancels the call and wins over
  // the CANCELLED that Finish() then reports.
  absl::Status local;
  std::unique_ptr<LayerAssembler> assembler;
  grpc::ByteBuffer buffer;
  pb::GetCacheResponse fields;
  RawData data;
  while (local.ok() && reader->Read(&buffer)) {
    local = ParseRawMessage(buffer, &fields, &data);
    if (!local.ok()) {
      local = absl::InternalError(absl::StrCat("GetCache stream: ", local.message()));
      break;
    }
    if (assembler == nullptr) {
      if (!fields.has_info()) {
        local = absl::InternalError("GetCache stream: first message is not the CacheInfo");
        break;
      }
      assembler = std::make_unique<LayerAssembler>(
          fields.info(),
          req.format() == pb::FORMAT_PACKED ? CacheFormat::kPacked : CacheFormat::kDense,
          req.layer_begin(), req.has_layer_end() ? req.layer_end() : 0);
      *delivered = true;
      if (on_info) local = on_info(fields.info());
      continue;
    }
    if (!fields.has_chunk()) {
      local = absl::InternalError("GetCache stream: a message after the first is not a chunk");
      break;
    }
    local = assembler->Add(fields.chunk(), data, on_layer);
  }
  if (!local.ok()) {
    ctx.TryCancel();
    reader->Finish().ok();  // drains the call; its CANCELLED is not the story
    return local;
  }
  RETURN_IF_ERROR(FromGrpcStatus(reader->Finish()));
  if (assembler == nullptr) return absl::InternalError("GetCache stream: no CacheInfo received");
  return assembler->Finish();
}

absl::StatusOr<CacheInfo> ClientImpl::StatCache(const std::string& cache_id) {
  if (cache_id.empty()) return absl::InvalidArgumentError("cache_id: empty");
  const Replica& r = replicas_[ReplicaFor(cache_id)];
  pb::StatCacheRequest req;
  req.set_cache_id(cache_id);
  CacheInfo info;
  RETURN_IF_ERROR(WithRetry([&](grpc::ClientContext* ctx) {
    info.Clear();
    return r.stub->StatCache(ctx, req, &info);
  }));
  return info;
}

absl::StatusOr<uint64_t> ClientImpl::DeleteCache(const std::string& cache_id) {
  if (cache_id.empty()) return absl::InvalidArgumentError("cache_id: empty");
  const Replica& r = replicas_[ReplicaFor(cache_id)];
  pb::DeleteCacheRequest req;
  req.set_cache_id(cache_id);
  pb::DeleteCacheResponse resp;
  RETURN_IF_ERROR(WithRetry([&](grpc::ClientContext* ctx) {
    resp.Clear();
    return r.stub->DeleteCache(ctx, req, &resp);
  }));
  return resp.freed_bytes();
}

absl::StatusOr<std::vector<CacheInfo>> ClientImpl::ListCaches(const std::string& prefix) {
  std::vector<CacheInfo> all;
  for (const Replica& r : replicas_) {
    pb::ListCachesRequest req;
    req.set_prefix(prefix);
    req.set_page_size(1000);
    std::set<std::string> seen_tokens;
    while (true) {
      pb::ListCachesResponse resp;
      absl::Status s = WithRetry([&](grpc::ClientContext* ctx) {
        resp.Clear();
        return r.stub->ListCaches(ctx, req, &resp);
      });
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat(s.message(), " (replica ", r.address, ")"));
      }
      for (CacheInfo& c : *resp.mutable_caches()) all.push_back(std::move(c));
      if (resp.next_page_token().empty()) break;
      // A server handing out the same token twice would make this loop forever.
      if (!seen_tokens.insert(resp.next_page_token()).second) {
        return absl::InternalError(
            absl::StrCat("ListCaches: replica ", r.address, " repeated page token"));
      }
      req.set_page_token(resp.next_page_token());
    }
  }
  std::sort(all.begin(), all.end(),
            [](const CacheInfo& a, const CacheInfo& b) { return a.cache_id() < b.cache_id(); });
  return all;
}

absl::StatusOr<ServerInfo> ClientImpl::GetServerInfo(size_t replica) {
  if (replica >= replicas_.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("replica: ", replica, " is outside [0, ", replicas_.size(), ")"));
  }
  const Replica& r = replicas_[replica];
  ServerInfo info;
  RETURN_IF_ERROR(WithRetry([&](grpc::ClientContext* ctx) {
    info.Clear();
    return r.stub->GetServerInfo(ctx, pb::GetServerInfoRequest(), &info);
  }));
  return info;
}

}  // namespace

std::string StatusCodeName(absl::StatusCode code) { return absl::StatusCodeToString(code); }

absl::StatusOr<std::unique_ptr<Client>> Client::Create(const ClientOptions& options) {
  RETURN_IF_ERROR(ValidateOptions(options));
  ASSIGN_OR_RETURN(std::vector<std::string> addresses, ResolveTarget(options.target));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ChannelCredentials> credentials,
                   ChannelCredentials(options));
  BufferPool& pool = LargeBuffers();
  if (pool.cap_bytes() < options.buffer_pool_bytes) pool.set_cap(options.buffer_pool_bytes);
  return std::unique_ptr<Client>(new ClientImpl(options, std::move(addresses), credentials));
}

}  // namespace kvc

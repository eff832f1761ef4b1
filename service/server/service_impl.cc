#include "server/service_impl.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvc/gpu_memory.h"
#include "kvc/spec.h"
#include "server/convert.h"
#include "server/upload_table.h"
#include "server/wire.h"

namespace kvc::server {
namespace {

constexpr uint32_t kDefaultPageSize = 100;
constexpr uint32_t kMaxPageSize = 1000;

grpc::Status Draining() {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE, "kvcd is shutting down");
}

// Finishes a unary call and books it.
grpc::ServerUnaryReactor* FinishUnary(grpc::CallbackServerContext* context, RpcRecorder& rec,
                                      const grpc::Status& status) {
  rec.Record(status.error_code());
  auto* reactor = context->DefaultReactor();
  reactor->Finish(status);
  return reactor;
}

// Runs what every unary method shares, in order: the draining check (unless the method answers
// while draining), authentication, parsing the request; then
// `handler(ns, request, &response)`, whose response is sent when it returns OK.
template <typename Request, typename Response, typename Handler>
grpc::ServerUnaryReactor* ServeUnary(ServiceState* state, const char* method, bool while_draining,
                                     grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request_bytes,
                                     grpc::ByteBuffer* response_bytes, Handler handler) {
  RpcRecorder rec(state, method);
  const grpc::Status status = [&] {
    if (state->draining && !while_draining) return Draining();
    auto ns = state->Namespace(*context);
    if (!ns.ok()) return ToGrpc(ns.status());
    Request request;
    if (auto s = ParseMessage(*request_bytes, &request); !s.ok()) return ToGrpc(s);
    Response response;
    grpc::Status s = handler(*ns, request, &response);
    if (s.ok()) *response_bytes = SerializeToByteBuffer(response);
    return s;
  }();
  return FinishUnary(context, rec, status);
}

struct TenantUsage {
  uint64_t entries = 0;
  uint64_t bytes = 0;  // charged bytes (CacheEntry::ChargedBytes) of the live entries
};

// Usage of the live entries whose ids start with `prefix`, listed a page at a time so the store's
// lock is never held across the whole walk.
TenantUsage UsageUnder(const CacheStore& store, const std::string& prefix) {
  constexpr size_t kPage = 1024;
  TenantUsage usage;
  std::string after;
  for (;;) {
    const auto page = store.List(prefix, after, kPage);
    for (const auto& e : page) {
      ++usage.entries;
      usage.bytes += e->ChargedBytes();
    }
    if (page.size() < kPage) return usage;
    after = page.back()->id;
  }
}

}  // namespace

bool ServiceState::TryAcquireStream() {
  int n = active_streams.load();
  do {
    if (n >= static_cast<int>(config.max_concurrent_streams)) return false;
  } while (!active_streams.compare_exchange_weak(n, n + 1));
  if (metrics) metrics->StreamStarted();
  return true;
}

void ServiceState::ReleaseStream() {
  active_streams.fetch_sub(1);
  if (metrics) metrics->StreamFinished();
}

absl::StatusOr<std::string> ServiceState::Namespace(const grpc::ServerContextBase& context) {
  if (auth == nullptr) return std::string();
  auto ns = auth->Authenticate(context);
  if (!ns.ok() && metrics) metrics->RecordRejection(RejectionReason::kUnauthenticated);
  return ns;
}

void ServiceState::RefreshStoreGauges() {
  if (!metrics) return;
  metrics->SetStoreStats(store->GetStats());
  metrics->SetGpuMemoryUsed(GpuMemoryUsedBytes());  // 0 without a live CUDA backend
  if (staging != nullptr) {
    metrics->SetBufferPoolStats(staging->idle_bytes(), staging->cap_bytes(), staging->reused(),
                                staging->mapped());
  }
}

RpcRecorder::RpcRecorder(ServiceState* state, const char* method)
    : state_(state), method_(method), start_(absl::Now()) {
  state_->active_rpcs.fetch_add(1);
  if (state_->metrics) state_->metrics->RecordRpcStarted(method_);
}

RpcRecorder::~RpcRecorder() {
  if (!recorded_) Record(grpc::StatusCode::CANCELLED);
  state_->active_rpcs.fetch_sub(1);
}

void RpcRecorder::Record(grpc::StatusCode code) {
  if (recorded_) return;
  recorded_ = true;
  if (state_->metrics) {
    state_->metrics->RecordRpc(method_, code, absl::ToDoubleSeconds(absl::Now() - start_));
  }
}

grpc::ServerReadReactor<grpc::ByteBuffer>* KvCacheServiceImpl::PutCache(
    grpc::CallbackServerContext* context, grpc::ByteBuffer* response) {
  return NewPutCacheReactor(state_, context, response);
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* KvCacheServiceImpl::GetCache(
    grpc::CallbackServerContext* context, const grpc::ByteBuffer* request) {
  return NewGetCacheReactor(state_, context, request);
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::StatCache(grpc::CallbackServerContext* context,
                                                        const grpc::ByteBuffer* request,
                                                        grpc::ByteBuffer* response) {
  return ServeUnary<kvcache::v1::StatCacheRequest, kvcache::v1::CacheInfo>(
      state_, "StatCache", /*while_draining=*/false, context, request, response,
      [this](const std::string& ns, const kvcache::v1::StatCacheRequest& req,
             kvcache::v1::CacheInfo* info) {
        if (auto s = ValidateCacheId("cache_id", req.cache_id()); !s.ok()) return ToGrpc(s);
        auto entry = state_->store->Peek(ns + req.cache_id());
        if (!entry.ok()) return ToGrpc(entry.status(), ns);
        if (!info->ParseFromString((*entry)->metadata)) {
          return grpc::Status(grpc::StatusCode::DATA_LOSS, "stored metadata is unreadable");
        }
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::DeleteCache(grpc::CallbackServerContext* context,
                                                          const grpc::ByteBuffer* request,
                                                          grpc::ByteBuffer* response) {
  return ServeUnary<kvcache::v1::DeleteCacheRequest, kvcache::v1::DeleteCacheResponse>(
      state_, "DeleteCache", /*while_draining=*/false, context, request, response,
      [this](const std::string& ns, const kvcache::v1::DeleteCacheRequest& req,
             kvcache::v1::DeleteCacheResponse* resp) {
        if (auto s = ValidateCacheId("cache_id", req.cache_id()); !s.ok()) return ToGrpc(s);
        // An upload of this id in flight is stopped too: its client has no use for it any more.
        const int stopped =
            state_->uploads == nullptr
                ? 0
                : state_->uploads->Stop(
                      ns + req.cache_id(),
                      absl::AbortedError(absl::StrCat("cache_id: '", req.cache_id(),
                                                      "' was deleted while its upload was in "
                                                      "progress; the upload was discarded")));
        auto freed = state_->store->Delete(ns + req.cache_id());
        if (!freed.ok() && stopped > 0 && freed.status().code() == absl::StatusCode::kNotFound) {
          freed = uint64_t{0};
        }
        if (!freed.ok()) return ToGrpc(freed.status(), ns);
        resp->set_freed_bytes(*freed);
        if (state_->metrics) state_->metrics->RecordEviction(EvictionReason::kDeleted);
        state_->RefreshStoreGauges();
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::ListCaches(grpc::CallbackServerContext* context,
                                                         const grpc::ByteBuffer* request,
                                                         grpc::ByteBuffer* response) {
  return ServeUnary<kvcache::v1::ListCachesRequest, kvcache::v1::ListCachesResponse>(
      state_, "ListCaches", /*while_draining=*/false, context, request, response,
      [this](const std::string& ns, const kvcache::v1::ListCachesRequest& req,
             kvcache::v1::ListCachesResponse* resp) {
        if (req.prefix().size() > kMaxCacheIdBytes) {
          return grpc::Status(
              grpc::StatusCode::INVALID_ARGUMENT,
              absl::StrCat("prefix: length ", req.prefix().size(), " is over ", kMaxCacheIdBytes));
        }
        if (!req.page_token().empty()) {
          if (auto s = ValidateCacheId("page_token", req.page_token()); !s.ok()) {
            return ToGrpc(s);
          }
        }
        const uint32_t page_size =
            req.page_size() == 0 ? kDefaultPageSize : std::min(req.page_size(), kMaxPageSize);
        // One extra entry tells whether another page follows.
        // Store ids carry the tenant prefix; page tokens and the listing never show it.
        const std::string start_after =
            req.page_token().empty() ? std::string() : ns + req.page_token();
        auto entries = state_->store->List(ns + req.prefix(), start_after, page_size + 1);
        const bool more = entries.size() > page_size;
        if (more) entries.resize(page_size);
        for (const auto& e : entries) {
          if (!resp->add_caches()->ParseFromString(e->metadata)) {
            return grpc::Status(
                grpc::StatusCode::DATA_LOSS,
                absl::StrCat("stored metadata of '", e->id.substr(ns.size()), "' is unreadable"));
          }
        }
        if (more && !entries.empty()) {
          resp->set_next_page_token(entries.back()->id.substr(ns.size()));
        }
        return grpc::Status::OK;
      });
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::GetServerInfo(grpc::CallbackServerContext* context,
                                                            const grpc::ByteBuffer* request,
                                                            grpc::ByteBuffer* response) {
  // Answered while draining too, so clients can see serving == false.
  return ServeUnary<kvcache::v1::GetServerInfoRequest, kvcache::v1::ServerInfo>(
      state_, "GetServerInfo", /*while_draining=*/true, context, request, response,
      [this](const std::string& ns, const kvcache::v1::GetServerInfoRequest& /*req*/,
             kvcache::v1::ServerInfo* info) {
        const ServerConfig& c = state_->config;
        info->set_version(state_->version);
        info->set_backend(std::string(state_->backend->name()));
        info->set_backend_description(state_->backend->description());
        for (const auto& p : EvictionPolicyNames()) info->add_eviction_policies(p);
        for (const auto& p : ChannelPolicyNames()) info->add_channel_policies(p);
        auto* limits = info->mutable_limits();
        limits->set_max_message_bytes(c.max_message_bytes);
        limits->set_max_chunk_bytes(c.max_chunk_bytes);
        limits->set_max_cache_bytes(EffectiveMaxCacheBytes(c));
        limits->set_max_concurrent_streams(c.max_concurrent_streams);
        limits->set_store_capacity_bytes(c.store_bytes);
        limits->set_default_ttl_seconds(c.default_ttl_seconds);
        if (ns.empty()) {
          const CacheStore::Stats stats = state_->store->GetStats();
          info->set_store_used_bytes(stats.used_bytes);
          info->set_store_entries(static_cast<uint32_t>(stats.entries));
        } else {
          // The whole store's counts would tell one tenant how much the others hold.
          const TenantUsage usage = UsageUnder(*state_->store, ns);
          info->set_store_used_bytes(usage.bytes);
          info->set_store_entries(static_cast<uint32_t>(usage.entries));
        }
        info->set_nccl_available(state_->nccl_available);
        info->set_serving(!state_->draining);
        return grpc::Status::OK;
      });
}

}  // namespace kvc::server

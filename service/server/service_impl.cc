#include "server/service_impl.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "kvc/gpu_memory.h"
#include "kvc/spec.h"
#include "server/convert.h"

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

grpc::ServerUnaryReactor* KvCacheServiceImpl::StatCache(
    grpc::CallbackServerContext* context, const kvcache::v1::StatCacheRequest* request,
    kvcache::v1::CacheInfo* response) {
  RpcRecorder rec(state_, "StatCache");
  if (state_->draining) return FinishUnary(context, rec, Draining());
  auto ns = state_->Namespace(*context);
  if (!ns.ok()) return FinishUnary(context, rec, ToGrpc(ns.status()));
  if (auto s = ValidateCacheId("cache_id", request->cache_id()); !s.ok()) {
    return FinishUnary(context, rec, ToGrpc(s));
  }
  auto entry = state_->store->Peek(*ns + request->cache_id());
  if (!entry.ok()) return FinishUnary(context, rec, ToGrpc(entry.status()));
  if (!response->ParseFromString((*entry)->metadata)) {
    return FinishUnary(context, rec,
                       grpc::Status(grpc::StatusCode::DATA_LOSS, "stored metadata is unreadable"));
  }
  return FinishUnary(context, rec, grpc::Status::OK);
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::DeleteCache(
    grpc::CallbackServerContext* context, const kvcache::v1::DeleteCacheRequest* request,
    kvcache::v1::DeleteCacheResponse* response) {
  RpcRecorder rec(state_, "DeleteCache");
  if (state_->draining) return FinishUnary(context, rec, Draining());
  auto ns = state_->Namespace(*context);
  if (!ns.ok()) return FinishUnary(context, rec, ToGrpc(ns.status()));
  if (auto s = ValidateCacheId("cache_id", request->cache_id()); !s.ok()) {
    return FinishUnary(context, rec, ToGrpc(s));
  }
  auto freed = state_->store->Delete(*ns + request->cache_id());
  if (!freed.ok()) return FinishUnary(context, rec, ToGrpc(freed.status()));
  response->set_freed_bytes(*freed);
  if (state_->metrics) state_->metrics->RecordEviction(EvictionReason::kDeleted);
  state_->RefreshStoreGauges();
  return FinishUnary(context, rec, grpc::Status::OK);
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::ListCaches(
    grpc::CallbackServerContext* context, const kvcache::v1::ListCachesRequest* request,
    kvcache::v1::ListCachesResponse* response) {
  RpcRecorder rec(state_, "ListCaches");
  if (state_->draining) return FinishUnary(context, rec, Draining());
  auto ns = state_->Namespace(*context);
  if (!ns.ok()) return FinishUnary(context, rec, ToGrpc(ns.status()));
  if (request->prefix().size() > kMaxCacheIdBytes) {
    return FinishUnary(context, rec,
                       grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                                    absl::StrCat("prefix: length ", request->prefix().size(),
                                                 " is over ", kMaxCacheIdBytes)));
  }
  if (!request->page_token().empty()) {
    if (auto s = ValidateCacheId("page_token", request->page_token()); !s.ok()) {
      return FinishUnary(context, rec, ToGrpc(s));
    }
  }
  const uint32_t page_size =
      request->page_size() == 0 ? kDefaultPageSize : std::min(request->page_size(), kMaxPageSize);
  // One extra entry tells whether another page follows.
  // Store ids carry the tenant prefix; page tokens and the listing never show it.
  const std::string start_after =
      request->page_token().empty() ? std::string() : *ns + request->page_token();
  auto entries = state_->store->List(*ns + request->prefix(), start_after, page_size + 1);
  const bool more = entries.size() > page_size;
  if (more) entries.resize(page_size);
  for (const auto& e : entries) {
    if (!response->add_caches()->ParseFromString(e->metadata)) {
      return FinishUnary(
          context, rec,
          grpc::Status(grpc::StatusCode::DATA_LOSS,
                       absl::StrCat("stored metadata of '", e->id, "' is unreadable")));
    }
  }
  if (more && !entries.empty()) {
    response->set_next_page_token(entries.back()->id.substr(ns->size()));
  }
  return FinishUnary(context, rec, grpc::Status::OK);
}

grpc::ServerUnaryReactor* KvCacheServiceImpl::GetServerInfo(
    grpc::CallbackServerContext* context, const kvcache::v1::GetServerInfoRequest* /*request*/,
    kvcache::v1::ServerInfo* response) {
  RpcRecorder rec(state_, "GetServerInfo");
  // Answered while draining too, so clients can see serving == false.
  auto ns = state_->Namespace(*context);
  if (!ns.ok()) return FinishUnary(context, rec, ToGrpc(ns.status()));
  const ServerConfig& c = state_->config;
  response->set_version(state_->version);
  response->set_backend(std::string(state_->backend->name()));
  response->set_backend_description(state_->backend->description());
  for (const auto& p : EvictionPolicyNames()) response->add_eviction_policies(p);
  for (const auto& p : ChannelPolicyNames()) response->add_channel_policies(p);
  auto* limits = response->mutable_limits();
  limits->set_max_message_bytes(c.max_message_bytes);
  limits->set_max_chunk_bytes(c.max_chunk_bytes);
  limits->set_max_cache_bytes(EffectiveMaxCacheBytes(c));
  limits->set_max_concurrent_streams(c.max_concurrent_streams);
  limits->set_store_capacity_bytes(c.store_bytes);
  limits->set_default_ttl_seconds(c.default_ttl_seconds);
  const CacheStore::Stats stats = state_->store->GetStats();
  response->set_store_used_bytes(stats.used_bytes);
  response->set_store_entries(static_cast<uint32_t>(stats.entries));
  response->set_nccl_available(state_->nccl_available);
  response->set_serving(!state_->draining);
  return FinishUnary(context, rec, grpc::Status::OK);
}

}  // namespace kvc::server

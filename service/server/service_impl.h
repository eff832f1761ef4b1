// The KvCache gRPC service on the callback API. Every method is raw (ByteBuffer in and out, see
// wire.h): PutCache and GetCache so bulk bytes bypass protobuf parsing, the unary ones so that an
// unparsable request gets INVALID_ARGUMENT with a message (gRPC's generated handler answers it with
// UNIMPLEMENTED and none).
//
// Status codes (every message names the offending field):
//   INVALID_ARGUMENT    unparsable request (e.g. a string that is not UTF-8),
//                       bad header/shape/dtype/layout/spec/id, no header, header twice, chunk
//                       before header, unknown layer/tensor, out-of-range or overlapping chunk,
//                       stream closed with bytes missing, bad layer range or format
//   RESOURCE_EXHAUSTED  over --max_message_bytes (from gRPC), --max_chunk_bytes,
//                       --max_cache_bytes, --max_concurrent_streams, --max_streams_per_peer or
//                       --staging_bytes, the spec's work over the upload's budget
//                       (--work_*: the message names the term and the limit), or the store
//                       cannot make room
//   ALREADY_EXISTS      the id exists and the header does not set overwrite
//   NOT_FOUND           unknown or expired cache (the message quotes the caller's id, never
//                       the tenant-qualified store id)
//   DATA_LOSS           stored bytes do not match their checksum (found block by block as a
//                       GetCache sends them)
//   CANCELLED / DEADLINE_EXCEEDED  from the client; the partial upload is discarded and its
//                       compression stops at the next row block
//   DEADLINE_EXCEEDED   also: an upload's compression ran past --compress_timeout_seconds
//   DEADLINE_EXCEEDED   also: the stream moved no bytes for --stream_idle_seconds (a GetCache
//                       client that stopped reading may see CANCELLED instead)
//   ABORTED             PutCache: the cache id was deleted (DeleteCache) while the upload was in
//                       progress; its compression stopped
//   UNAVAILABLE         the server is draining (or, for an upload still compressing after the
//                       drain, shutting down: its compression was abandoned)
//
// Thread-safety: gRPC calls the methods concurrently; all shared state is in ServiceState.
#ifndef KVC_SERVICE_SERVER_SERVICE_IMPL_H_
#define KVC_SERVICE_SERVER_SERVICE_IMPL_H_

#include <atomic>
#include <string>

#include "grpcpp/grpcpp.h"
#include "kvc/backend.h"
#include "kvc/buffer_pool.h"
#include "kvc/cache_store.h"
#include "kvc/metrics.h"
#include "kvc/thread_pool.h"
#include "kvcache/v1/kvcache.grpc.pb.h"
#include "server/auth.h"
#include "server/config.h"
#include "server/stream_guard.h"

namespace kvc::server {

class IngestRegistry;  // server/ingest_registry.h
class UploadTable;     // server/upload_table.h

// What every handler shares. Owned by the server; outlives the gRPC server.
struct ServiceState {
  ServerConfig config;
  Backend* backend = nullptr;
  CacheStore* store = nullptr;
  Metrics* metrics = nullptr;
  // Compression jobs (at a lower CPU priority in kvcd, --compress_nice).
  ThreadPool* pool = nullptr;
  // Cheap jobs that clients wait on: completing uploads that keep everything, DENSE exports.
  // null: `pool`.
  ThreadPool* io_pool = nullptr;
  // The uploads in flight, for DeleteCache and shutdown to stop (server/upload_table.h); null:
  // none tracked.
  UploadTable* uploads = nullptr;
  // PutCache staging buffers (kvc/buffer_pool.h); never null: the process-wide pool unless set.
  BufferPool* staging = &LargeBuffers();
  std::string version;
  bool nccl_available = false;      // set by the transfer service when it is registered
  const TokenAuth* auth = nullptr;  // null: no authentication
  // Uploads fed by the transfer service (PutCacheHeader.external_payload); set by whoever
  // registers that service. null: external_payload uploads are FAILED_PRECONDITION.
  IngestRegistry* ingest = nullptr;
  // Stream protections (server/stream_guard.h), owned by the server; null: not applied.
  StreamReaper* reaper = nullptr;
  PeerStreams* peer_streams = nullptr;
  StagingBudget* staging_budget = nullptr;

  std::atomic<bool> draining{false};
  std::atomic<int> active_streams{0};
  std::atomic<int> active_rpcs{0};  // all RPCs, streams included

  // Takes a stream slot; false when --max_concurrent_streams are already open.
  bool TryAcquireStream();
  void ReleaseStream();
  // The caller's store-id prefix: "" without authentication, else "TENANT/"; UNAUTHENTICATED
  // (and a rejection metric) when the bearer token is missing or unknown.
  absl::StatusOr<std::string> Namespace(const grpc::ServerContextBase& context);
  // Pushes the store's size and entry count, and the CUDA backend's device memory, to the gauges.
  void RefreshStoreGauges();
};

// Books one RPC: counts it as started and in flight, and records its code and latency once.
class RpcRecorder {
 public:
  RpcRecorder(ServiceState* state, const char* method);
  ~RpcRecorder();  // records CANCELLED if Record was never called
  void Record(grpc::StatusCode code);

 private:
  ServiceState* state_;
  const char* method_;
  absl::Time start_;
  bool recorded_ = false;
};

using KvCacheBase = kvcache::v1::KvCache::WithRawCallbackMethod_PutCache<
    kvcache::v1::KvCache::WithRawCallbackMethod_GetCache<
        kvcache::v1::KvCache::WithRawCallbackMethod_StatCache<
            kvcache::v1::KvCache::WithRawCallbackMethod_DeleteCache<
                kvcache::v1::KvCache::WithRawCallbackMethod_ListCaches<
                    kvcache::v1::KvCache::WithRawCallbackMethod_GetServerInfo<
                        kvcache::v1::KvCache::CallbackService>>>>>>;

class KvCacheServiceImpl final : public KvCacheBase {
 public:
  explicit KvCacheServiceImpl(ServiceState* state) : state_(state) {}

  grpc::ServerReadReactor<grpc::ByteBuffer>* PutCache(grpc::CallbackServerContext* context,
                                                      grpc::ByteBuffer* response) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* GetCache(grpc::CallbackServerContext* context,
                                                       const grpc::ByteBuffer* request) override;
  // The unary methods take a serialized StatCacheRequest, DeleteCacheRequest, ListCachesRequest
  // or GetServerInfoRequest and answer a CacheInfo, DeleteCacheResponse, ListCachesResponse or
  // ServerInfo. With authentication, GetServerInfo's store_used_bytes and store_entries count
  // only the caller tenant's own caches.
  grpc::ServerUnaryReactor* StatCache(grpc::CallbackServerContext* context,
                                      const grpc::ByteBuffer* request,
                                      grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* DeleteCache(grpc::CallbackServerContext* context,
                                        const grpc::ByteBuffer* request,
                                        grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListCaches(grpc::CallbackServerContext* context,
                                       const grpc::ByteBuffer* request,
                                       grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* GetServerInfo(grpc::CallbackServerContext* context,
                                          const grpc::ByteBuffer* request,
                                          grpc::ByteBuffer* response) override;

 private:
  ServiceState* const state_;
};

// Factories for the two stream reactors (put_cache.cc, get_cache.cc).
grpc::ServerReadReactor<grpc::ByteBuffer>* NewPutCacheReactor(ServiceState* state,
                                                              grpc::CallbackServerContext* context,
                                                              grpc::ByteBuffer* response);
grpc::ServerWriteReactor<grpc::ByteBuffer>* NewGetCacheReactor(ServiceState* state,
                                                               grpc::CallbackServerContext* context,
                                                               const grpc::ByteBuffer* request);

}  // namespace kvc::server

#endif  // KVC_SERVICE_SERVER_SERVICE_IMPL_H_

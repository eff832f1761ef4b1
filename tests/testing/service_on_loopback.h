// The KvCache service over a test's own backend (e.g. a wrapper that injects failures) and pool,
// with a fresh store the test may reach into, served by an in-process gRPC server on a free loopback port, with a stub to
// it. Header-only: only tests that link kvc_service include it.
#ifndef KVC_TESTS_TESTING_SERVICE_ON_LOOPBACK_H_
#define KVC_TESTS_TESTING_SERVICE_ON_LOOPBACK_H_

#include <functional>
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"
#include "kvc/thread_pool.h"
#include "server/service_impl.h"
#include "testing/kvc_rpc.h"

namespace kvc::testing {

class ServiceOnLoopback {
 public:
  // Serves `backend` (compressing on `pool`; both must outlive this object) with a fresh store of
  // default options; `configure`, when given, adjusts the state first (config, auth). With
  // `bearer_token`, the stub's calls carry it. False when the store or the server cannot start.
  bool Start(Backend* backend, ThreadPool* pool,
             const std::function<void(server::ServiceState*)>& configure = nullptr,
             const std::string& bearer_token = "") {
    auto store = CacheStore::Create(CacheStore::Options{});
    if (!store.ok()) return false;
    store_ = *std::move(store);
    state_.backend = backend;
    state_.store = store_.get();
    state_.pool = pool;
    if (configure) configure(&state_);
    service_ = std::make_unique<server::KvCacheServiceImpl>(&state_);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    if (server_ == nullptr) return false;
    stub_ = NewStub("127.0.0.1:" + std::to_string(port), bearer_token);
    return true;
  }
  ~ServiceOnLoopback() {
    if (server_) server_->Shutdown();
  }
  CacheStore* store() const { return store_.get(); }
  kvcache::v1::KvCache::Stub* stub() const { return stub_.get(); }

 private:
  std::unique_ptr<CacheStore> store_;
  server::ServiceState state_;
  std::unique_ptr<server::KvCacheServiceImpl> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<kvcache::v1::KvCache::Stub> stub_;
};

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_SERVICE_ON_LOOPBACK_H_

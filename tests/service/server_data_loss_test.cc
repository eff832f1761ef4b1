// GetCache verifies the stored checksum before sending anything: a corrupted entry yields
// DATA_LOSS and no bytes. The corruption is injected in-process (the store never corrupts data
// through its API), so this test runs the KvCache service on an in-process gRPC server.
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kvc/backend.h"
#include "kvc/cache_store.h"
#include "server/service_impl.h"
#include "server/thread_pool.h"
#include "testing/kvc_rpc.h"

namespace kvc::server {
namespace {

TEST(ServerDataLossTest, CorruptedEntryIsDataLossAndSendsNothing) {
  auto backend = CreateCpuBackend(BackendOptions{});
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto store = CacheStore::Create(CacheStore::Options{});
  ASSERT_TRUE(store.ok()) << store.status();
  ThreadPool pool(1);
  ServiceState state;
  state.backend = backend->get();
  state.store = store->get();
  state.pool = &pool;
  KvCacheServiceImpl service(&state);
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&service);
  auto server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  auto stub = testing::NewStub("127.0.0.1:" + std::to_string(port));

  auto cache = testing::MakeTestCache("c", testing::Shape(2, 1, 1, 8, 32, 0),
                                      kvcache::v1::DTYPE_F16, kvcache::v1::LAYOUT_HND, 1);
  ASSERT_TRUE(testing::PutCache(stub.get(), cache).ok());
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("c");
  testing::Fetched good;
  ASSERT_TRUE(testing::Get(stub.get(), get, &good).ok());

  // Flip one byte of the stored blob behind the store's back.
  auto entry = (*store)->Peek("c");
  ASSERT_TRUE(entry.ok());
  auto& blob = const_cast<ByteVector&>((*entry)->layers[1]);
  blob[blob.size() / 2] ^= 0x40;

  testing::Fetched bad;
  grpc::Status s = testing::Get(stub.get(), get, &bad);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DATA_LOSS) << s.error_message();
  EXPECT_THAT(s.error_message(), ::testing::HasSubstr("'c'"));
  EXPECT_EQ(bad.messages, 0);
  server->Shutdown();
}

}  // namespace
}  // namespace kvc::server

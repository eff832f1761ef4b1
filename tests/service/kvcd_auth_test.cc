// --auth_tokens_file: every RPC but health needs a known bearer token (UNAUTHENTICATED otherwise),
// and tenants are isolated: same ids, separate caches, listings, store counts and error messages
// show only their own.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kvcache/v1/transfer.grpc.pb.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::KvcdProcess;

constexpr char kTokenA[] = "token-alpha-0123456789";
constexpr char kTokenB[] = "token-beta-9876543210";

std::string WriteFile(const std::string& name, const std::string& contents) {
  const std::string path = ::testing::TempDir() + "/" + name + std::to_string(getpid());
  std::ofstream(path) << contents;
  return path;
}

class KvcdAuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tokens_ = WriteFile("kvcd_tokens_",
                        std::string("# tenants\n") + kTokenA + " alpha\n\n" + kTokenB + " beta\n");
    KvcdProcess::Options opts;
    opts.binary = KVCD_PATH;
    opts.flags = {"--auth_tokens_file=" + tokens_, "--backend=cpu"};
    auto p = KvcdProcess::Start(opts);
    ASSERT_TRUE(p.ok()) << p.status();
    kvcd_ = *std::move(p);
  }
  void TearDown() override { std::remove(tokens_.c_str()); }

  std::string tokens_;
  std::unique_ptr<KvcdProcess> kvcd_;
};

testing::TestCache Cache(const std::string& id, uint64_t seed) {
  return testing::MakeTestCache(id, testing::Shape(1, 1, 1, 8, 16, 0), kvcache::v1::DTYPE_F32,
                                kvcache::v1::LAYOUT_HND, seed);
}

TEST_F(KvcdAuthTest, EveryRpcButHealthNeedsAKnownToken) {
  for (const std::string token : {"", "not-a-known-token"}) {
    SCOPED_TRACE(token);
    auto stub = testing::NewStub(kvcd_->address(), token);
    grpc::Status put = testing::PutCache(stub.get(), Cache("x", 1));
    EXPECT_EQ(put.error_code(), grpc::StatusCode::UNAUTHENTICATED) << put.error_message();
    EXPECT_THAT(put.error_message(), HasSubstr("authorization"));
    kvcache::v1::GetCacheRequest get;
    get.set_cache_id("x");
    testing::Fetched f;
    EXPECT_EQ(testing::Get(stub.get(), get, &f).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext c1, c2, c3, c4;
    kvcache::v1::StatCacheRequest stat;
    stat.set_cache_id("x");
    kvcache::v1::CacheInfo info;
    EXPECT_EQ(stub->StatCache(&c1, stat, &info).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    kvcache::v1::DeleteCacheRequest del;
    del.set_cache_id("x");
    kvcache::v1::DeleteCacheResponse dr;
    EXPECT_EQ(stub->DeleteCache(&c2, del, &dr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    kvcache::v1::ListCachesResponse lr;
    EXPECT_EQ(stub->ListCaches(&c3, {}, &lr).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    kvcache::v1::ServerInfo si;
    EXPECT_EQ(stub->GetServerInfo(&c4, {}, &si).error_code(), grpc::StatusCode::UNAUTHENTICATED);
  }
  // Probes need no token, on either port.
  for (const auto& addr : {kvcd_->address(), kvcd_->health_address()}) {
    auto serving = testing::HealthServing(addr);
    ASSERT_TRUE(serving.ok()) << serving.status();
    EXPECT_TRUE(*serving);
  }
  // Nothing was stored by the refused calls.
  auto a = testing::NewStub(kvcd_->address(), kTokenA);
  EXPECT_EQ(testing::ViewStore(a.get()).used_bytes, 0u);
}

TEST_F(KvcdAuthTest, TenantsSeeOnlyTheirOwnCaches) {
  auto a = testing::NewStub(kvcd_->address(), kTokenA);
  auto b = testing::NewStub(kvcd_->address(), kTokenB);
  const auto cache_a = Cache("shared/id", 1), cache_b = Cache("shared/id", 2);
  ASSERT_TRUE(testing::PutCache(a.get(), cache_a).ok());
  ASSERT_TRUE(testing::PutCache(a.get(), Cache("only/a", 3)).ok());
  // The same id in another tenant is a different cache, not ALREADY_EXISTS.
  ASSERT_TRUE(testing::PutCache(b.get(), cache_b).ok());
  EXPECT_THAT(testing::ViewStore(a.get()).ids, ElementsAre("only/a", "shared/id"));
  EXPECT_THAT(testing::ViewStore(b.get()).ids, ElementsAre("shared/id"));

  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("shared/id");
  get.set_format(kvcache::v1::FORMAT_DENSE);
  testing::Fetched fa, fb;
  ASSERT_TRUE(testing::Get(a.get(), get, &fa).ok());
  ASSERT_TRUE(testing::Get(b.get(), get, &fb).ok());
  auto bytes = [](const std::vector<uint8_t>& v) {
    return std::string(reinterpret_cast<const char*>(v.data()), v.size());
  };
  EXPECT_EQ(fa.part(0, kvcache::v1::PART_K), bytes(cache_a.k[0]));
  EXPECT_EQ(fb.part(0, kvcache::v1::PART_K), bytes(cache_b.k[0]));
  EXPECT_EQ(fa.info.cache_id(), "shared/id");  // ids are shown without the tenant

  // B cannot see, read or delete A's cache.
  get.set_cache_id("only/a");
  testing::Fetched none;
  EXPECT_EQ(testing::Get(b.get(), get, &none).error_code(), grpc::StatusCode::NOT_FOUND);
  grpc::ClientContext c1, c2;
  kvcache::v1::DeleteCacheRequest del;
  del.set_cache_id("only/a");
  kvcache::v1::DeleteCacheResponse dr;
  EXPECT_EQ(b->DeleteCache(&c1, del, &dr).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(a->DeleteCache(&c2, del, &dr).ok());
  EXPECT_THAT(testing::ViewStore(a.get()).ids, ElementsAre("shared/id"));
}

// Errors quote the id the caller sent, never the store's tenant-qualified form.
TEST_F(KvcdAuthTest, NotFoundNamesTheCallersOwnId) {
  auto a = testing::NewStub(kvcd_->address(), kTokenA);
  std::vector<grpc::Status> statuses;
  kvcache::v1::GetCacheRequest get;
  get.set_cache_id("no/such");
  testing::Fetched f;
  statuses.push_back(testing::Get(a.get(), get, &f));
  grpc::ClientContext c1, c2;
  kvcache::v1::StatCacheRequest stat;
  stat.set_cache_id("no/such");
  kvcache::v1::CacheInfo info;
  statuses.push_back(a->StatCache(&c1, stat, &info));
  kvcache::v1::DeleteCacheRequest del;
  del.set_cache_id("no/such");
  kvcache::v1::DeleteCacheResponse dr;
  statuses.push_back(a->DeleteCache(&c2, del, &dr));
  for (size_t i = 0; i < statuses.size(); ++i) {
    const char* const methods[] = {"GetCache", "StatCache", "DeleteCache"};
    SCOPED_TRACE(methods[i]);
    const grpc::Status& s = statuses[i];
    EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("'no/such'"));
    EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr("alpha")));
  }
}

// GetServerInfo's store counts are the caller's own: the whole store's would tell one tenant how
// much the others hold.
TEST_F(KvcdAuthTest, ServerInfoCountsOnlyTheCallersCaches) {
  auto a = testing::NewStub(kvcd_->address(), kTokenA);
  auto b = testing::NewStub(kvcd_->address(), kTokenB);
  ASSERT_TRUE(testing::PutCache(a.get(), Cache("a/one", 1)).ok());
  ASSERT_TRUE(testing::PutCache(a.get(), Cache("a/two", 2)).ok());
  const testing::StoreView a_view = testing::ViewStore(a.get());
  EXPECT_EQ(a_view.entries, 2u);
  EXPECT_GT(a_view.used_bytes, 0u);
  const testing::StoreView b_empty = testing::ViewStore(b.get());
  EXPECT_EQ(b_empty.entries, 0u);
  EXPECT_EQ(b_empty.used_bytes, 0u);
  ASSERT_TRUE(testing::PutCache(b.get(), Cache("b/one", 3)).ok());
  const testing::StoreView b_view = testing::ViewStore(b.get());
  EXPECT_EQ(b_view.entries, 1u);
  EXPECT_GT(b_view.used_bytes, 0u);
  EXPECT_LT(b_view.used_bytes, a_view.used_bytes);  // one cache of the same shape, not three
  EXPECT_EQ(testing::ViewStore(a.get()), a_view);   // B's upload does not show in A's counts
}

// The transfer service has no per-tenant authorization, so kvcd does not serve it with tokens:
// no session can be opened and no tenant's cache can be fetched through it.
TEST_F(KvcdAuthTest, TransferServiceAndItsFetchAreNotServed) {
  auto a = testing::NewStub(kvcd_->address(), kTokenA);
  ASSERT_TRUE(testing::PutCache(a.get(), Cache("private", 3)).ok());
  auto channel = grpc::CreateChannel(kvcd_->address(), grpc::InsecureChannelCredentials());
  auto transfer = kvcache::v1::KvCacheTransfer::NewStub(channel);
  grpc::ClientContext open_ctx;
  open_ctx.AddMetadata("authorization", std::string("Bearer ") + kTokenA);
  kvcache::v1::OpenTransferSessionRequest open;
  open.set_client_id("decode");
  open.set_transport(kvcache::v1::TRANSFER_TRANSPORT_GRPC_BYTES);
  kvcache::v1::OpenTransferSessionResponse session;
  EXPECT_EQ(transfer->OpenTransferSession(&open_ctx, open, &session).error_code(),
            grpc::StatusCode::UNIMPLEMENTED);
  grpc::ClientContext fetch_ctx;
  fetch_ctx.AddMetadata("authorization", std::string("Bearer ") + kTokenA);
  auto fetch = transfer->Fetch(&fetch_ctx);
  kvcache::v1::FetchRequest req;
  req.mutable_start()->set_cache_id("private");
  fetch->Write(req);
  fetch->WritesDone();
  kvcache::v1::FetchResponse resp;
  EXPECT_FALSE(fetch->Read(&resp));
  EXPECT_EQ(fetch->Finish().error_code(), grpc::StatusCode::UNIMPLEMENTED);
}

TEST(KvcdAuthFlagsTest, BadTokenFilesExitWithCode2) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"tok-only-1234567\n", "line 1"},
      {"short alpha\n", "line 1"},
      {"# c\ntoken-123456789 bad/tenant\n", "line 2"},
      {"token-123456789 a\ntoken-123456789 b\n", "duplicate"},
      {"# nothing\n", "no tokens"},
  };
  for (const auto& [contents, text] : cases) {
    const std::string path = WriteFile("kvcd_bad_tokens_", contents);
    KvcdProcess::Options opts;
    opts.binary = KVCD_PATH;
    opts.flags = {"--auth_tokens_file=" + path};
    opts.wait_for_ready = false;
    auto p = KvcdProcess::Start(opts);
    ASSERT_TRUE(p.ok()) << p.status();
    auto code = (*p)->Wait(absl::Seconds(20));
    ASSERT_TRUE(code.ok());
    EXPECT_EQ(*code, 2) << contents;
    absl::SleepFor(absl::Milliseconds(20));
    EXPECT_THAT((*p)->output(), HasSubstr(text)) << contents;
    EXPECT_THAT((*p)->output(), ::testing::Not(HasSubstr("token-123456789"))) << contents;
    std::remove(path.c_str());
  }
}

}  // namespace
}  // namespace kvc

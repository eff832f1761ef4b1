// Three kvcd replicas on loopback behind one 3-address client: every cache lands on its rendezvous
// owner, and when one replica stops, its caches fail with UNAVAILABLE while the others keep
// serving.
#include <gtest/gtest.h>

#include <csignal>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvc/client.h"
#include "kvc/replicas.h"
#include "testing/kvc_rpc.h"
#include "testing/kvcd_process.h"

namespace kvc {
namespace {

namespace pb = kvcache::v1;
using testing::KvcdProcess;

std::unique_ptr<Client> ClientFor(const std::string& target) {
  ClientOptions o;
  o.target = target;
  o.initial_backoff = absl::Milliseconds(5);
  o.unary_timeout = absl::Seconds(5);
  auto c = Client::Create(o);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? std::move(*c) : nullptr;
}

TEST(MultiReplica, RendezvousPlacementAndFailover) {
  std::vector<std::unique_ptr<KvcdProcess>> kvcd;
  std::vector<std::string> addresses;
  for (int i = 0; i < 3; ++i) {
    KvcdProcess::Options o;
    o.binary = KVCD_PATH;
    auto p = KvcdProcess::Start(o);
    ASSERT_TRUE(p.ok()) << p.status();
    addresses.push_back((*p)->address());
    kvcd.push_back(std::move(*p));
  }
  auto client = ClientFor(absl::StrJoin(addresses, ","));
  ASSERT_NE(client, nullptr);
  // The client's replica order is sorted; map it back to the processes.
  const std::vector<std::string>& replicas = client->replicas();
  ASSERT_EQ(replicas.size(), 3u);
  std::vector<std::unique_ptr<Client>> direct;
  std::vector<KvcdProcess*> process;
  for (const std::string& r : replicas) {
    direct.push_back(ClientFor(r));
    for (auto& p : kvcd) {
      if (p->address() == r) process.push_back(p.get());
    }
  }
  ASSERT_EQ(process.size(), 3u);

  // Small caches (fp16, 1 layer, 2 heads x 64 tokens x 16): placement is what is tested here.
  const int n = 60;
  std::vector<testing::TestCache> caches;
  std::vector<int> per_replica(3);
  for (int i = 0; i < n; ++i) {
    caches.push_back(testing::MakeTestCache(absl::StrCat("mr/cache-", i),
                                            testing::Shape(1, 2, 2, 16, 64, 4), pb::DTYPE_F16,
                                            pb::LAYOUT_HND, i + 1));
    const testing::TestCache& c = caches.back();
    const LayerTensors t{c.k[0].data(), c.v[0].data(), c.q[0].data()};
    auto put = client->PutCache(c.header, {&t, 1});
    ASSERT_TRUE(put.ok()) << put.status();
    const size_t owner = RendezvousOwner(c.header.cache_id(), replicas);
    EXPECT_EQ(client->ReplicaFor(c.header.cache_id()), owner);
    ++per_replica[owner];
    for (size_t r = 0; r < 3; ++r) {
      const absl::Status s = direct[r]->StatCache(c.header.cache_id()).status();
      if (r == owner) {
        EXPECT_TRUE(s.ok()) << c.header.cache_id() << " on its owner: " << s;
      } else {
        EXPECT_EQ(s.code(), absl::StatusCode::kNotFound) << c.header.cache_id() << " on " << r;
      }
    }
  }
  for (int count : per_replica) EXPECT_GT(count, 5);  // 60 ids over 3 replicas: ~20 each

  auto all = client->ListCaches("mr/");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->size(), static_cast<size_t>(n));

  // Stop one replica; its caches become unavailable, the others keep serving.
  const size_t down = 1;
  ASSERT_TRUE(process[down]->Signal(SIGKILL).ok());
  ASSERT_TRUE(process[down]->Wait(absl::Seconds(10)).ok());
  for (const testing::TestCache& c : caches) {
    const std::string& id = c.header.cache_id();
    const absl::Status stat = client->StatCache(id).status();
    GetOptions dense;
    dense.format = CacheFormat::kDense;
    auto got = client->GetCache(id, dense);
    if (client->ReplicaFor(id) == down) {
      EXPECT_EQ(stat.code(), absl::StatusCode::kUnavailable) << id << ": " << stat;
      EXPECT_EQ(got.status().code(), absl::StatusCode::kUnavailable) << id;
    } else {
      EXPECT_TRUE(stat.ok()) << id << ": " << stat;
      ASSERT_TRUE(got.ok()) << id << ": " << got.status();
      EXPECT_TRUE(absl::MakeConstSpan(got->layers[0].k) == absl::MakeConstSpan(c.k[0])) << id;
    }
  }
  // Listing needs every replica.
  const absl::Status list = client->ListCaches("mr/").status();
  EXPECT_EQ(list.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(list.message().find(replicas[down]), absl::string_view::npos) << list;
}

}  // namespace
}  // namespace kvc

// Rendezvous hashing: the documented function, balance, minimal disruption, stable owners; and
// target resolution.
#include "kvc/replicas.h"

#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"

namespace kvc {
namespace {

const std::vector<std::string> kThree = {"10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"};

TEST(Rendezvous, WeightIsTheDocumentedXxh3) {
  for (const std::string id : {"a", "prompt-123", "tenant/x:y.z"}) {
    for (const std::string& r : kThree) {
      EXPECT_EQ(RendezvousWeight(id, r),
                XXH3_64bits_withSeed(id.data(), id.size(), XXH3_64bits(r.data(), r.size())));
    }
  }
  EXPECT_NE(RendezvousWeight("a", kThree[0]), RendezvousWeight("a", kThree[1]));
}

TEST(Rendezvous, OwnerHasHighestWeight) {
  for (int i = 0; i < 200; ++i) {
    const std::string id = absl::StrCat("id-", i);
    const size_t owner = RendezvousOwner(id, kThree);
    for (const std::string& r : kThree) {
      EXPECT_GE(RendezvousWeight(id, kThree[owner]), RendezvousWeight(id, r));
    }
  }
  EXPECT_EQ(RendezvousOwner("x", std::vector<std::string>{"only:1"}), 0u);
}

TEST(Rendezvous, OwnersAreStable) {
  // Computed once from the documented function; a change here moves every stored cache.
  const std::vector<std::pair<std::string, size_t>> pinned = {
      {"cache-0", 2}, {"cache-1", 2}, {"llama/req-42", 0}, {"x", 1}};
  for (const auto& [id, owner] : pinned) EXPECT_EQ(RendezvousOwner(id, kThree), owner) << id;
}

TEST(Rendezvous, BalancedOverTenThousandIds) {
  std::vector<int> count(3);
  const int n = 10000;
  for (int i = 0; i < n; ++i) ++count[RendezvousOwner(absl::StrCat("cache-", i), kThree)];
  for (int c : count) {
    // Expected n/3 = 3333 with standard deviation ~47; 10% tolerance is ~7 sigma.
    EXPECT_GT(c, n / 3 * 0.9);
    EXPECT_LT(c, n / 3 * 1.1);
  }
}

TEST(Rendezvous, RemovingAReplicaMovesOnlyItsIds) {
  const std::vector<std::string> two = {kThree[0], kThree[2]};  // kThree[1] removed
  int moved = 0;
  for (int i = 0; i < 10000; ++i) {
    const std::string id = absl::StrCat("cache-", i);
    const std::string before = kThree[RendezvousOwner(id, kThree)];
    const std::string after = two[RendezvousOwner(id, two)];
    if (before != kThree[1]) {
      EXPECT_EQ(after, before) << id;
    } else {
      ++moved;
    }
  }
  EXPECT_GT(moved, 0);
  // Adding a replica back takes ids only onto the new one.
  for (int i = 0; i < 2000; ++i) {
    const std::string id = absl::StrCat("cache-", i);
    const std::string with = kThree[RendezvousOwner(id, kThree)];
    const std::string without = two[RendezvousOwner(id, two)];
    EXPECT_TRUE(with == without || with == kThree[1]) << id;
  }
}

TEST(ResolveTarget, SingleTargetIsKeptAsIs) {
  auto r = ResolveTarget("myhost:1234");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, std::vector<std::string>{"myhost:1234"});
  r = ResolveTarget("unix:/tmp/sock");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->size(), 1u);
}

TEST(ResolveTarget, ListIsTrimmedSortedAndDeduplicated) {
  auto r = ResolveTarget(" b:2, a:1 ,b:2,c:3");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, (std::vector<std::string>{"a:1", "b:2", "c:3"}));
}

TEST(ResolveTarget, RejectsBadTargets) {
  EXPECT_EQ(ResolveTarget("").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveTarget("a:1,,b:2").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveTarget("dns:///localhost").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveTarget("dns:///:50051").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveTarget("dns://8.8.8.8/host:1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ResolveTarget("dns:///[::1").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ResolveTarget, DnsNameResolvesEveryAddress) {
  // Numeric hosts resolve without a DNS server, so this is hermetic.
  auto r = ResolveTarget("dns:///127.0.0.1:7000");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, std::vector<std::string>{"127.0.0.1:7000"});
  r = ResolveTarget("dns:///[::1]:7000");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*r, std::vector<std::string>{"[::1]:7000"});
  // localhost comes from /etc/hosts; it has at least the IPv4 loopback.
  r = ResolveTarget("dns:///localhost:7000");
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_NE(std::find(r->begin(), r->end(), "127.0.0.1:7000"), r->end());
  EXPECT_TRUE(std::is_sorted(r->begin(), r->end()));
}

}  // namespace
}  // namespace kvc

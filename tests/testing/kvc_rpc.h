// Test helper: builds KV caches with deterministic random contents and talks to kvcd through the
// generated stub with plain protobuf messages (independent of the client library), so service
// tests check the wire contract itself.
#ifndef KVC_TESTS_TESTING_KVC_RPC_H_
#define KVC_TESTS_TESTING_KVC_RPC_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kvc/dtype.h"
#include "kvc/layer.h"
#include "kvcache/v1/kvcache.grpc.pb.h"

namespace kvc::testing {

// A cache as a prefill node would upload it: the header and, per layer, the K, V and Q_obs bytes
// in the header's dtype and layout.
struct TestCache {
  kvcache::v1::PutCacheHeader header;
  std::vector<std::vector<uint8_t>> k, v, q;
  uint64_t kv_bytes() const;     // K + V bytes of all layers
  uint64_t total_bytes() const;  // K + V + Q_obs
  LayerShape layer_shape() const;
  DType dtype() const;
  Layout layout() const;
};

// Values ~ N(0, 1) rounded to the dtype, from `seed`.
TestCache MakeTestCache(const std::string& id, const kvcache::v1::ModelShape& shape,
                        kvcache::v1::DType dtype, kvcache::v1::Layout layout, uint64_t seed);

kvcache::v1::ModelShape Shape(uint32_t layers, uint32_t kv_heads, uint32_t q_heads,
                              uint32_t head_dim, uint32_t seq_len, uint32_t obs_window);

// A compression config exercising eviction (snapkv 0.25), key-channel pruning (ThinK 0.5) and
// 4-bit quantization, with 16 recent tokens kept whole.
kvcache::v1::CompressionConfig FullCompression();

// The header followed by chunks of at most `chunk_bytes` for every tensor of every layer, in
// layer order (K, V, Q_obs per layer), or shuffled with `shuffle_seed` != 0.
std::vector<kvcache::v1::PutCacheRequest> MakeRequests(const TestCache& cache, size_t chunk_bytes,
                                                       uint64_t shuffle_seed = 0);

// A stub on a fresh channel without message size limits. With `bearer_token`, every call carries
// "authorization: Bearer TOKEN" (added by a client interceptor, so all helpers below use it).
std::unique_ptr<kvcache::v1::KvCache::Stub> NewStub(const std::string& address,
                                                    const std::string& bearer_token = "");

// Streams `requests` (then WritesDone) and returns the final status.
grpc::Status Put(kvcache::v1::KvCache::Stub* stub,
                 const std::vector<kvcache::v1::PutCacheRequest>& requests,
                 kvcache::v1::PutCacheResponse* response,
                 absl::Duration timeout = absl::Seconds(30));
// Uploads a whole cache in chunks of `chunk_bytes`, in order.
grpc::Status PutCache(kvcache::v1::KvCache::Stub* stub, const TestCache& cache,
                      kvcache::v1::PutCacheResponse* response = nullptr,
                      size_t chunk_bytes = 16 << 10);

// What GetCache returned: the info message and each (layer, part) reassembled from its chunks.
struct Fetched {
  kvcache::v1::CacheInfo info;
  int messages = 0;
  size_t max_data_bytes = 0;                              // largest `data` of one message
  std::map<std::pair<uint32_t, int>, std::string> parts;  // (layer, LayerPart) -> bytes
  std::map<uint32_t, uint32_t> kept_tokens;               // layer -> kept tokens per head
  const std::string& part(uint32_t layer, kvcache::v1::LayerPart p) const;
};
// Reads the whole stream; checks that chunks of a part are contiguous and sum to total_bytes
// (an INTERNAL status describes any violation).
grpc::Status Get(kvcache::v1::KvCache::Stub* stub, const kvcache::v1::GetCacheRequest& request,
                 Fetched* out, absl::Duration timeout = absl::Seconds(30));

// Store usage as the server reports it.
struct StoreView {
  uint64_t used_bytes = 0;
  uint32_t entries = 0;
  std::vector<std::string> ids;  // from ListCaches, sorted
  bool operator==(const StoreView& o) const {
    return used_bytes == o.used_bytes && entries == o.entries && ids == o.ids;
  }
};
StoreView ViewStore(kvcache::v1::KvCache::Stub* stub);

// HND copy of an NHD tensor [tokens, heads, dim] of `elem` bytes per element.
std::vector<uint8_t> NhdToHnd(const std::vector<uint8_t>& nhd, int heads, int tokens, int dim,
                              size_t elem);

}  // namespace kvc::testing

#endif  // KVC_TESTS_TESTING_KVC_RPC_H_

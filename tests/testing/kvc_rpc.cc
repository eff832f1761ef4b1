#include "testing/kvc_rpc.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "grpcpp/support/client_interceptor.h"

namespace kvc::testing {
namespace {

using kvcache::v1::PutCacheRequest;

void Fill(std::vector<uint8_t>* out, size_t elems, DType dtype, std::mt19937_64& rng) {
  std::normal_distribution<float> dist(0.0f, 1.0f);
  out->resize(elems * DTypeSize(dtype));
  for (size_t i = 0; i < elems; ++i) StoreFromFloat(out->data(), dtype, i, dist(rng));
}

// Adds the authorization header to every call of a channel.
class BearerInterceptor : public grpc::experimental::Interceptor {
 public:
  explicit BearerInterceptor(std::string value) : value_(std::move(value)) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", value_});
    }
    methods->Proceed();
  }

 private:
  std::string value_;
};

class BearerInterceptorFactory : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit BearerInterceptorFactory(std::string token) : value_("Bearer " + token) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new BearerInterceptor(value_);
  }

 private:
  std::string value_;
};

grpc::Status Internal(const std::string& msg) {
  return grpc::Status(grpc::StatusCode::INTERNAL, msg);
}

}  // namespace

uint64_t TestCache::kv_bytes() const {
  uint64_t n = 0;
  for (size_t l = 0; l < k.size(); ++l) n += k[l].size() + v[l].size();
  return n;
}

uint64_t TestCache::total_bytes() const {
  uint64_t n = kv_bytes();
  for (const auto& t : q) n += t.size();
  return n;
}

LayerShape TestCache::layer_shape() const {
  const auto& s = header.shape();
  LayerShape ls;
  ls.num_kv_heads = static_cast<int>(s.num_kv_heads());
  ls.num_q_heads = static_cast<int>(s.num_q_heads());
  ls.head_dim = static_cast<int>(s.head_dim());
  ls.seq_len = static_cast<int>(s.seq_len());
  ls.obs_window = static_cast<int>(s.obs_window());
  return ls;
}

DType TestCache::dtype() const {
  switch (header.dtype()) {
    case kvcache::v1::DTYPE_F32:
      return DType::kF32;
    case kvcache::v1::DTYPE_BF16:
      return DType::kBF16;
    default:
      return DType::kF16;
  }
}

Layout TestCache::layout() const {
  return header.layout() == kvcache::v1::LAYOUT_NHD ? Layout::kNHD : Layout::kHND;
}

kvcache::v1::ModelShape Shape(uint32_t layers, uint32_t kv_heads, uint32_t q_heads,
                              uint32_t head_dim, uint32_t seq_len, uint32_t obs_window) {
  kvcache::v1::ModelShape s;
  s.set_num_layers(layers);
  s.set_num_kv_heads(kv_heads);
  s.set_num_q_heads(q_heads);
  s.set_head_dim(head_dim);
  s.set_seq_len(seq_len);
  s.set_obs_window(obs_window);
  return s;
}

kvcache::v1::CompressionConfig FullCompression() {
  kvcache::v1::CompressionConfig c;
  c.mutable_eviction()->set_policy("snapkv");
  c.mutable_eviction()->set_keep_ratio(0.25);
  c.mutable_channels()->set_key_policy("think");
  c.mutable_channels()->set_key_lambda(0.5);
  c.mutable_quant()->set_bits(4);
  c.set_recent_tokens(16);
  return c;
}

TestCache MakeTestCache(const std::string& id, const kvcache::v1::ModelShape& shape,
                        kvcache::v1::DType dtype, kvcache::v1::Layout layout, uint64_t seed) {
  TestCache c;
  c.header.set_cache_id(id);
  *c.header.mutable_shape() = shape;
  c.header.set_dtype(dtype);
  c.header.set_layout(layout);
  std::mt19937_64 rng(seed);
  const size_t kv = static_cast<size_t>(shape.num_kv_heads()) * shape.seq_len() * shape.head_dim();
  const size_t q = static_cast<size_t>(shape.num_q_heads()) * shape.obs_window() * shape.head_dim();
  c.k.resize(shape.num_layers());
  c.v.resize(shape.num_layers());
  c.q.resize(shape.num_layers());
  for (uint32_t l = 0; l < shape.num_layers(); ++l) {
    Fill(&c.k[l], kv, c.dtype(), rng);
    Fill(&c.v[l], kv, c.dtype(), rng);
    Fill(&c.q[l], q, c.dtype(), rng);
  }
  return c;
}

std::vector<PutCacheRequest> MakeRequests(const TestCache& cache, size_t chunk_bytes,
                                          uint64_t shuffle_seed) {
  std::vector<PutCacheRequest> chunks;
  for (size_t l = 0; l < cache.k.size(); ++l) {
    const std::vector<uint8_t>* tensors[3] = {&cache.k[l], &cache.v[l], &cache.q[l]};
    const kvcache::v1::TensorKind kinds[3] = {kvcache::v1::TENSOR_K, kvcache::v1::TENSOR_V,
                                              kvcache::v1::TENSOR_Q_OBS};
    for (int t = 0; t < 3; ++t) {
      const auto& bytes = *tensors[t];
      for (size_t off = 0; off < bytes.size(); off += chunk_bytes) {
        const size_t n = std::min(chunk_bytes, bytes.size() - off);
        PutCacheRequest r;
        r.mutable_chunk()->set_layer(static_cast<uint32_t>(l));
        r.mutable_chunk()->set_tensor(kinds[t]);
        r.mutable_chunk()->set_offset(off);
        r.set_data(reinterpret_cast<const char*>(bytes.data()) + off, n);
        chunks.push_back(std::move(r));
      }
    }
  }
  if (shuffle_seed != 0) {
    std::mt19937_64 rng(shuffle_seed);
    std::shuffle(chunks.begin(), chunks.end(), rng);
  }
  std::vector<PutCacheRequest> out;
  out.reserve(chunks.size() + 1);
  PutCacheRequest h;
  *h.mutable_header() = cache.header;
  out.push_back(std::move(h));
  for (auto& c : chunks) out.push_back(std::move(c));
  return out;
}

std::unique_ptr<kvcache::v1::KvCache::Stub> NewStub(const std::string& address,
                                                    const std::string& bearer_token) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  args.SetMaxSendMessageSize(-1);
  if (bearer_token.empty()) {
    return kvcache::v1::KvCache::NewStub(
        grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args));
  }
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<BearerInterceptorFactory>(bearer_token));
  return kvcache::v1::KvCache::NewStub(grpc::experimental::CreateCustomChannelWithInterceptors(
      address, grpc::InsecureChannelCredentials(), args, std::move(factories)));
}

grpc::Status Put(kvcache::v1::KvCache::Stub* stub, const std::vector<PutCacheRequest>& requests,
                 kvcache::v1::PutCacheResponse* response, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  kvcache::v1::PutCacheResponse ignored;
  auto writer = stub->PutCache(&ctx, response ? response : &ignored);
  for (const auto& r : requests) {
    if (!writer->Write(r)) break;  // the server ended the stream; Finish has the status
  }
  writer->WritesDone();
  return writer->Finish();
}

grpc::Status PutCache(kvcache::v1::KvCache::Stub* stub, const TestCache& cache,
                      kvcache::v1::PutCacheResponse* response, size_t chunk_bytes) {
  return Put(stub, MakeRequests(cache, chunk_bytes), response);
}

const std::string& Fetched::part(uint32_t layer, kvcache::v1::LayerPart p) const {
  static const std::string* const kEmpty = new std::string();
  auto it = parts.find({layer, static_cast<int>(p)});
  return it == parts.end() ? *kEmpty : it->second;
}

grpc::Status Get(kvcache::v1::KvCache::Stub* stub, const kvcache::v1::GetCacheRequest& request,
                 Fetched* out, absl::Duration timeout) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  auto reader = stub->GetCache(&ctx, request);
  kvcache::v1::GetCacheResponse msg;
  std::map<std::pair<uint32_t, int>, uint64_t> totals;
  bool protocol_ok = true;
  std::string problem;
  while (reader->Read(&msg)) {
    ++out->messages;
    out->max_data_bytes = std::max(out->max_data_bytes, msg.data().size());
    if (msg.has_info()) {
      if (out->messages != 1) {
        protocol_ok = false;
        problem = "info message after the first";
      }
      out->info = msg.info();
      continue;
    }
    if (!msg.has_chunk()) {
      protocol_ok = false;
      problem = "message with neither info nor chunk";
      continue;
    }
    const auto& c = msg.chunk();
    auto key = std::make_pair(c.layer(), static_cast<int>(c.part()));
    std::string& bytes = out->parts[key];
    if (c.offset() != bytes.size()) {
      protocol_ok = false;
      problem = absl::StrCat("chunk offset ", c.offset(), " after ", bytes.size(), " bytes");
    }
    totals[key] = c.total_bytes();
    out->kept_tokens[c.layer()] = c.kept_tokens();
    bytes += msg.data();
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) return s;
  if (!protocol_ok) return Internal(problem);
  for (const auto& [key, total] : totals) {
    if (out->parts[key].size() != total) {
      return Internal(absl::StrCat("layer ", key.first, " part ", key.second, ": ",
                                   out->parts[key].size(), " of ", total, " bytes"));
    }
  }
  return s;
}

StoreView ViewStore(kvcache::v1::KvCache::Stub* stub) {
  StoreView v;
  {
    grpc::ClientContext ctx;
    kvcache::v1::ServerInfo info;
    if (stub->GetServerInfo(&ctx, {}, &info).ok()) {
      v.used_bytes = info.store_used_bytes();
      v.entries = info.store_entries();
    }
  }
  std::string token;
  do {
    grpc::ClientContext ctx;
    kvcache::v1::ListCachesRequest req;
    req.set_page_token(token);
    kvcache::v1::ListCachesResponse resp;
    if (!stub->ListCaches(&ctx, req, &resp).ok()) break;
    for (const auto& c : resp.caches()) v.ids.push_back(c.cache_id());
    token = resp.next_page_token();
  } while (!token.empty());
  return v;
}

std::vector<uint8_t> NhdToHnd(const std::vector<uint8_t>& nhd, int heads, int tokens, int dim,
                              size_t elem) {
  std::vector<uint8_t> out(nhd.size());
  const size_t row = static_cast<size_t>(dim) * elem;
  for (int t = 0; t < tokens; ++t) {
    for (int h = 0; h < heads; ++h) {
      std::memcpy(out.data() + (static_cast<size_t>(h) * tokens + t) * row,
                  nhd.data() + (static_cast<size_t>(t) * heads + h) * row, row);
    }
  }
  return out;
}

}  // namespace kvc::testing

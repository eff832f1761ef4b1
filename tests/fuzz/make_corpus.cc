// Writes the seed corpora in tests/fuzz/corpus/ with the project's own writers, so the seeds are
// real, well-formed inputs the fuzzers then mutate. Not run by CI; rerun by hand after a format
// change and commit the output:
//   build-fuzz/tests/fuzz/kvc_fuzz_make_corpus tests/fuzz/corpus
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "kvc/client_wire.h"
#include "kvc/compact.h"
#include "kvc/safetensors.h"
#include "kvc/selection.h"
#include "kvcache/v1/kvcache.pb.h"
#include "server/wire.h"

namespace {

std::string g_root;

void Write(const std::string& dir, const std::string& name, const void* data, size_t size) {
  const std::string d = g_root + "/" + dir;
  mkdir(d.c_str(), 0755);
  const std::string path = d + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(data, 1, size, f) != size || std::fclose(f) != 0) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
}
void Write(const std::string& dir, const std::string& name, const std::string& bytes) {
  Write(dir, name, bytes.data(), bytes.size());
}

// The wire harnesses read a slicing control byte first.
std::string Flatten(const grpc::ByteBuffer& buffer, uint8_t control) {
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);
  std::string out(1, static_cast<char>(control));
  for (const grpc::Slice& s : slices)
    out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

uint16_t Half(float x) {  // small exact values only: 0, +-0.5, +-1, ... (enough for seeds)
  if (x == 0) return 0;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t sign = (bits >> 16) & 0x8000, exp = ((bits >> 23) & 0xff) - 127 + 15;
  return static_cast<uint16_t>(sign | (exp << 10) | ((bits >> 13) & 0x3ff));
}

void Safetensors() {
  kvc::StFile f;
  f.metadata["format"] = "kvc";
  kvc::StTensor k{"layers.0.k", kvc::StDType::kF16, {1, 2, 8}, std::vector<uint8_t>(32, 0x3c)};
  kvc::StTensor pos{"positions", kvc::StDType::kI32, {2}, {0, 0, 0, 0, 1, 0, 0, 0}};
  kvc::StTensor empty{"empty", kvc::StDType::kF32, {0, 4}, {}};
  kvc::StTensor ids{"ids", kvc::StDType::kI64, {1}, std::vector<uint8_t>(8, 1)};
  kvc::StTensor mask{"mask", kvc::StDType::kU8, {3}, {1, 0, 1}};
  kvc::StTensor bf{"b", kvc::StDType::kBF16, {2}, {0, 0x3f, 0, 0xbf}};
  kvc::StTensor scalar{"s", kvc::StDType::kF32, {}, {0, 0, 0x80, 0x3f}};
  f.tensors = {k, pos, empty, ids, mask, bf, scalar};
  auto bytes = kvc::SerializeSafetensors(f);
  Write("safetensors_fuzz", "all_dtypes.safetensors", bytes.data(), bytes.size());
  kvc::StFile one;
  one.tensors = {k};
  bytes = kvc::SerializeSafetensors(one);
  Write("safetensors_fuzz", "one_tensor.safetensors", bytes.data(), bytes.size());
  bytes = kvc::SerializeSafetensors(kvc::StFile{});
  Write("safetensors_fuzz", "empty.safetensors", bytes.data(), bytes.size());
}

struct CompactCase {
  const char* name;
  int budget, tk, tv, bits, group, recent, value_bits = 0;
};

// 2 KV heads, 6 tokens, head_dim d; one blob per case.
void Compact(int d, std::initializer_list<CompactCase> cases) {
  kvc::LayerShape shape{2, 4, 6, d, 2};
  const size_t n = size_t{2} * 6 * d;
  std::vector<uint16_t> k(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    k[i] = Half(static_cast<float>(static_cast<int>(i % 7) - 3) * 0.5f);
    v[i] = Half(static_cast<float>(static_cast<int>(i % 5) - 2) * 0.5f);
  }
  kvc::LayerInput in;
  in.shape = shape;
  in.dtype = kvc::DType::kF16;
  in.k = k.data();
  in.v = v.data();
  for (const CompactCase& c : cases) {
    kvc::TokenSelection tokens{2, c.budget, {}};
    for (int h = 0; h < 2; ++h) {
      for (int t = 0; t < c.budget; ++t) tokens.positions.push_back(6 - c.budget + t);
    }
    kvc::ChannelSelection channels{c.tk, c.tv, {}, {}};
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < c.tk && c.tk < d; ++i) channels.key_idx.push_back(i * 2);
      for (int i = 0; i < c.tv && c.tv < d; ++i) channels.value_idx.push_back(i);
    }
    kvc::CompressionSpec spec;
    spec.quant.bits = c.bits;
    spec.quant.value_bits = c.value_bits;
    spec.quant.group_size = c.group;
    spec.recent_tokens = c.recent;
    absl::StatusOr<kvc::CompactLayer> blob = kvc::PackLayer(in, tokens, channels, spec);
    if (!blob.ok()) {
      std::fprintf(stderr, "PackLayer %s: %s\n", c.name, blob.status().ToString().c_str());
      std::exit(1);
    }
    Write("compact_fuzz", std::string(c.name) + ".blob", blob->bytes.data(), blob->bytes.size());
  }
}

void Compact() {
  // D = 8: specs that exercise each block kind.
  Compact(8, {{"whole", 6, 8, 8, 0, 32, 0},
              {"evicted", 4, 8, 8, 0, 32, 0},
              {"pruned", 5, 4, 6, 0, 32, 2},
              {"quant4", 6, 8, 8, 4, 4, 2},
              {"quant2_pruned", 4, 4, 4, 2, 2, 1},
              {"quant8", 3, 8, 8, 8, 8, 0},
              {"quant8v4", 6, 8, 6, 8, 4, 1, 4}});
  // D = 32, every channel kept, value groups of 8: the shapes the fused dequantization takes.
  Compact(32, {{"d32_quant4", 6, 32, 32, 4, 8, 1},
               {"d32_quant2", 6, 32, 32, 2, 8, 0},
               {"d32_quant8v4", 5, 32, 32, 8, 8, 1, 4}});
}

kvcache::v1::PutCacheHeader Header() {
  kvcache::v1::PutCacheHeader h;
  h.set_cache_id("seed/cache-1");
  auto* s = h.mutable_shape();
  s->set_num_layers(2);
  s->set_num_kv_heads(2);
  s->set_num_q_heads(4);
  s->set_head_dim(64);
  s->set_seq_len(128);
  s->set_obs_window(8);
  h.set_dtype(kvcache::v1::DTYPE_F16);
  auto* c = h.mutable_compression();
  c->mutable_eviction()->set_policy("snapkv");
  c->mutable_eviction()->set_budget(32);
  c->mutable_eviction()->add_layer_budgets(16);
  c->mutable_channels()->set_key_policy("think");
  c->mutable_channels()->set_key_lambda(0.5);
  c->mutable_quant()->set_bits(4);
  c->mutable_quant()->set_group_size(32);
  c->set_recent_tokens(8);
  return h;
}

void Wire() {
  kvcache::v1::PutCacheRequest put;
  *put.mutable_header() = Header();
  Write("put_request_fuzz", "header", Flatten(kvc::FrameMessage(put), 0));
  kvcache::v1::ChunkHeader chunk;
  chunk.set_layer(1);
  chunk.set_offset(4096);
  const std::string payload = "0123456789abcdef0123456789abcdef";
  Write("put_request_fuzz", "chunk_2_slices",
        Flatten(kvc::FramePutChunk(chunk, payload.data(), payload.size()), 1 | (3 << 2)));
  Write("put_request_fuzz", "chunk_4_slices",
        Flatten(kvc::FramePutChunk(chunk, payload.data(), payload.size()), 3));
  Write("put_request_fuzz", "empty_chunk", Flatten(kvc::FramePutChunk(chunk, nullptr, 0), 0));

  kvcache::v1::LayerChunk lc;
  lc.set_layer(3);
  lc.set_offset(64);
  lc.set_total_bytes(96);
  lc.set_kept_tokens(5);
  auto keep = std::make_shared<std::string>(payload);
  Write("get_response_fuzz", "chunk",
        Flatten(kvc::server::MakeChunkResponse(lc, reinterpret_cast<const uint8_t*>(keep->data()),
                                               keep->size(), keep),
                2 | (5 << 2)));
  kvcache::v1::GetCacheResponse info;
  info.mutable_info()->set_cache_id("seed/cache-1");
  info.mutable_info()->add_kept_tokens(7);
  info.mutable_info()->set_checksum(0x1234567890abcdefu);
  Write("get_response_fuzz", "info", Flatten(kvc::FrameMessage(info), 0));

  Write("shape_fuzz", "header", Header().SerializeAsString());
  kvcache::v1::PutCacheHeader plain = Header();
  plain.clear_compression();
  Write("shape_fuzz", "no_compression", plain.SerializeAsString());
  plain.mutable_compression()->mutable_eviction()->set_policy("keyformer");
  plain.mutable_compression()->mutable_eviction()->set_keep_ratio(0.25);
  plain.mutable_compression()->mutable_eviction()->set_tau(0.5);
  plain.mutable_compression()->mutable_channels()->set_prune_values(true);
  plain.mutable_compression()->mutable_channels()->set_value_lambda(0.25);
  Write("shape_fuzz", "keyformer", plain.SerializeAsString());
}

// llama2.c checkpoints: seven int32 then the fp32 weights (kvc/model/checkpoint.h).
void Checkpoint(const char* name, int dim, int hidden, int layers, int heads, int kv_heads,
                int vocab, int seq_len) {
  std::vector<int32_t> header = {dim, hidden, layers, heads, kv_heads, vocab, seq_len};
  const uint64_t kv = static_cast<uint64_t>(dim) / heads * kv_heads, v = vocab < 0 ? -vocab : vocab;
  const uint64_t floats =
      layers * (2ull * dim + 2ull * dim * dim + 2 * kv * dim + 3ull * hidden * dim) + v * dim +
      dim + 2ull * seq_len * (dim / heads / 2) + (vocab < 0 ? v * dim : 0);
  std::string bytes(reinterpret_cast<const char*>(header.data()), 28);
  for (uint64_t i = 0; i < floats; ++i) {
    const float x = static_cast<float>(static_cast<int>(i % 17) - 8) / 64.0f;
    bytes.append(reinterpret_cast<const char*>(&x), 4);
  }
  Write("checkpoint_fuzz", name, bytes);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_ROOT (tests/fuzz/corpus)\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  mkdir(g_root.c_str(), 0755);
  Safetensors();
  Compact();
  Wire();
  Checkpoint("tiny.bin", 8, 16, 1, 2, 1, 16, 4);
  Checkpoint("unshared_classifier.bin", 4, 8, 2, 1, 1, -8, 2);
  Checkpoint("gqa.bin", 16, 8, 1, 4, 2, 8, 3);
  return 0;
}

#include "kvc/model/checkpoint.h"

#include <bit>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvc/checked_math.h"
#include "kvc/status_macros.h"

namespace kvc::model {
namespace {

constexpr int kHeaderInts = 7;
constexpr uint64_t kHeaderBytes = kHeaderInts * sizeof(int32_t);

int32_t ReadLe32(const unsigned char* p) {
  const uint32_t u = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                     (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
  int32_t v;
  std::memcpy(&v, &u, 4);
  return v;
}

absl::Status Positive(const char* field, int value) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", value, " must be positive"));
}

}  // namespace

absl::Status ValidateConfig(const LlamaConfig& c) {
  RETURN_IF_ERROR(Positive("dim", c.dim));
  RETURN_IF_ERROR(Positive("hidden_dim", c.hidden_dim));
  RETURN_IF_ERROR(Positive("n_layers", c.n_layers));
  RETURN_IF_ERROR(Positive("n_heads", c.n_heads));
  RETURN_IF_ERROR(Positive("n_kv_heads", c.n_kv_heads));
  RETURN_IF_ERROR(Positive("vocab_size", c.vocab_size));
  RETURN_IF_ERROR(Positive("seq_len", c.seq_len));
  if (c.dim % c.n_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dim: ", c.dim, " is not divisible by n_heads ", c.n_heads));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_heads: ", c.n_heads, " is not a multiple of n_kv_heads ", c.n_kv_heads));
  }
  if (c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat("head_dim: dim / n_heads = ", c.head_dim(),
                                                   " is odd; RoPE needs channel pairs"));
  }
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> CheckpointFloatCount(const LlamaConfig& c) {
  RETURN_IF_ERROR(ValidateConfig(c));
  const uint64_t dim = c.dim, hidden = c.hidden_dim, layers = c.n_layers, kv = c.kv_dim(),
                 vocab = c.vocab_size, seq = c.seq_len, half = c.head_dim() / 2;
  uint64_t n = 0;
  uint64_t per_layer = 0;
  bool ok = CheckedMulAdd(2, dim, &per_layer) &&           // two RMSNorm weights
            CheckedMulAdd(2 * dim, dim, &per_layer) &&     // wq, wo
            CheckedMulAdd(2 * kv, dim, &per_layer) &&      // wk, wv
            CheckedMulAdd(3 * hidden, dim, &per_layer) &&  // w1, w2, w3
            CheckedMulAdd(layers, per_layer, &n) && CheckedMulAdd(vocab, dim, &n) &&  // embedding
            CheckedMulAdd(1, dim, &n) &&       // final RMSNorm
            CheckedMulAdd(2 * seq, half, &n);  // legacy RoPE tables
  if (ok && !c.shared_classifier) ok = CheckedMulAdd(vocab, dim, &n);
  if (!ok || n > (UINT64_MAX - kHeaderBytes) / sizeof(float)) {
    return absl::InvalidArgumentError("header: the weight count it implies overflows 64 bits");
  }
  return n;
}

absl::StatusOr<Checkpoint> Checkpoint::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open checkpoint '", path, "'"));
  in.seekg(0, std::ios::end);
  const std::streamoff end = in.tellg();
  if (end < 0) return absl::InternalError(absl::StrCat("cannot size checkpoint '", path, "'"));
  const uint64_t file_bytes = static_cast<uint64_t>(end);
  if (file_bytes < kHeaderBytes) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint '", path, "': file has ", file_bytes,
                                                   " bytes, shorter than the ", kHeaderBytes,
                                                   "-byte header"));
  }
  in.seekg(0);
  unsigned char header[kHeaderBytes];
  if (!in.read(reinterpret_cast<char*>(header), kHeaderBytes)) {
    return absl::InternalError(absl::StrCat("cannot read the header of '", path, "'"));
  }
  Checkpoint ck;
  LlamaConfig& c = ck.config_;
  c.dim = ReadLe32(header + 0);
  c.hidden_dim = ReadLe32(header + 4);
  c.n_layers = ReadLe32(header + 8);
  c.n_heads = ReadLe32(header + 12);
  c.n_kv_heads = ReadLe32(header + 16);
  const int32_t raw_vocab = ReadLe32(header + 20);
  c.seq_len = ReadLe32(header + 24);
  // A negative vocab_size is llama2.c's flag for an unshared classifier (INT32_MIN has no
  // positive counterpart and is rejected as non-positive).
  c.shared_classifier = raw_vocab > 0;
  c.vocab_size = raw_vocab < 0 && raw_vocab != INT32_MIN ? -raw_vocab : raw_vocab;
  absl::StatusOr<uint64_t> floats = CheckpointFloatCount(c);
  if (!floats.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint '", path, "': ", floats.status().message()));
  }
  const uint64_t expected = kHeaderBytes + *floats * sizeof(float);
  if (file_bytes != expected) {
    return absl::InvalidArgumentError(absl::StrCat(
        "checkpoint '", path, "': file has ", file_bytes, " bytes but the header (dim ", c.dim,
        ", hidden_dim ", c.hidden_dim, ", n_layers ", c.n_layers, ", n_heads ", c.n_heads,
        ", n_kv_heads ", c.n_kv_heads, ", vocab_size ", raw_vocab, ", seq_len ", c.seq_len,
        ") implies ", expected, file_bytes < expected ? " (truncated)" : " (trailing bytes)"));
  }
  ck.data_.resize(*floats);
  if (!in.read(reinterpret_cast<char*>(ck.data_.data()),
               static_cast<std::streamsize>(*floats * sizeof(float)))) {
    return absl::InternalError(absl::StrCat("cannot read the weights of '", path, "'"));
  }
  static_assert(std::endian::native == std::endian::little, "checkpoints are little-endian");

  const size_t dim = c.dim, layers = c.n_layers, kv = c.kv_dim(), hidden = c.hidden_dim,
               vocab = c.vocab_size;
  size_t off = 0;
  auto take = [&off](size_t n) {
    const size_t at = off;
    off += n;
    return at;
  };
  ck.embedding_ = take(vocab * dim);
  ck.attn_norm_ = take(layers * dim);
  ck.wq_ = take(layers * dim * dim);
  ck.wk_ = take(layers * kv * dim);
  ck.wv_ = take(layers * kv * dim);
  ck.wo_ = take(layers * dim * dim);
  ck.ffn_norm_ = take(layers * dim);
  ck.w1_ = take(layers * hidden * dim);
  ck.w2_ = take(layers * dim * hidden);
  ck.w3_ = take(layers * hidden * dim);
  ck.final_norm_ = take(dim);
  take(static_cast<size_t>(c.seq_len) * c.head_dim());  // legacy RoPE tables, both halves
  ck.classifier_ = c.shared_classifier ? ck.embedding_ : take(vocab * dim);
  return ck;
}

}  // namespace kvc::model

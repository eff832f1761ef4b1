#include "kvc/model/checkpoint.h"

#include <sys/stat.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <numbers>
#include <string>

#include "absl/strings/str_cat.h"
#include "kvc/checked_math.h"
#include "kvc/status_macros.h"

namespace kvc::model {
namespace {

constexpr int kHeaderInts = 7;
constexpr int32_t kBosTokenLlama2c = 1;
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

absl::Status ValidateRopeConfig(const RopeConfig& r) {
  if (!(r.theta > 0) || !std::isfinite(r.theta)) {
    return absl::InvalidArgumentError(absl::StrCat("rope_theta: ", r.theta, " must be positive"));
  }
  if (r.scaling == RopeScaling::kNone) return absl::OkStatus();
  if (!(r.factor >= 1) || !std::isfinite(r.factor)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rope_scaling.factor: ", r.factor, " must be a finite number >= 1"));
  }
  if (r.scaling == RopeScaling::kLlama3) {
    if (!(r.low_freq_factor > 0) || !std::isfinite(r.low_freq_factor) ||
        !(r.high_freq_factor > r.low_freq_factor) || !std::isfinite(r.high_freq_factor)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rope_scaling: low_freq_factor ", r.low_freq_factor, " and high_freq_factor ",
          r.high_freq_factor, " must satisfy 0 < low < high"));
    }
    if (r.original_max_positions < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("rope_scaling.original_max_position_embeddings: ", r.original_max_positions,
                       " must be positive"));
    }
  }
  return absl::OkStatus();
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
  if (c.explicit_head_dim < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim: ", c.explicit_head_dim, " must be positive"));
  }
  if (c.explicit_head_dim == 0 && c.dim % c.n_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("dim: ", c.dim, " is not divisible by n_heads ", c.n_heads));
  }
  // q_dim and the projections' sizes are ints: keep them in range.
  if (static_cast<int64_t>(c.head_dim()) * c.n_heads > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("head_dim: ", c.head_dim(), " x n_heads ", c.n_heads, " is too large"));
  }
  if (c.n_heads % c.n_kv_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("n_heads: ", c.n_heads, " is not a multiple of n_kv_heads ", c.n_kv_heads));
  }
  if (c.head_dim() % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        c.explicit_head_dim > 0 ? "head_dim: " : "head_dim: dim / n_heads = ", c.head_dim(),
        " is odd; RoPE needs channel pairs"));
  }
  if (!(c.rms_norm_eps > 0) || !std::isfinite(c.rms_norm_eps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("rms_norm_eps: ", c.rms_norm_eps, " must be positive and finite"));
  }
  if (c.bos_token < -1 || c.bos_token >= c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("bos_token: ", c.bos_token, " is outside [0, ",
                                                   c.vocab_size, ") (or -1: none)"));
  }
  return ValidateRopeConfig(c.rope);
}

std::vector<double> RopeInverseFrequencies(const RopeConfig& r, int head_dim) {
  const int half = head_dim / 2;
  std::vector<double> inv(half);
  for (int i = 0; i < half; ++i) {
    inv[i] = std::pow(r.theta, -2.0 * i / head_dim);
    if (r.scaling == RopeScaling::kLinear) {
      inv[i] /= r.factor;
    } else if (r.scaling == RopeScaling::kLlama3) {
      // Wavelengths shorter than original / high_freq_factor stay; longer than original /
      // low_freq_factor are divided by factor; in between, a linear blend in original/wavelength.
      const double wavelen = 2 * std::numbers::pi / inv[i];
      const double old_len = r.original_max_positions;
      if (wavelen > old_len / r.low_freq_factor) {
        inv[i] /= r.factor;
      } else if (wavelen >= old_len / r.high_freq_factor) {
        const double smooth =
            (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
        inv[i] = (1 - smooth) * inv[i] / r.factor + smooth * inv[i];
      }
    }
  }
  return inv;
}

absl::StatusOr<RopeParams> EngineRope(const LlamaConfig& c) {
  RopeParams p;
  p.theta = c.rope.theta;
  p.rotary_dims = 0;
  p.half_split = c.rope.pairs == RopePairs::kHalfSplit;
  switch (c.rope.scaling) {
    case RopeScaling::kNone:
      break;
    case RopeScaling::kLinear:
      p.linear_factor = c.rope.factor;
      break;
    case RopeScaling::kLlama3:
      return absl::InvalidArgumentError(
          "rope_scaling: llama3 cannot be expressed as the engine's RoPE (kvc/rope.h: theta, "
          "pairs, linear factor)");
  }
  RETURN_IF_ERROR(ValidateRope(p, c.head_dim()));
  return p;
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
  struct stat st;
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) return LoadHuggingFace(path);
  return LoadLlama2c(path);
}

size_t Checkpoint::LayOut() {
  const LlamaConfig& c = config_;
  const size_t dim = c.dim, layers = c.n_layers, q = c.q_dim(), kv = c.kv_dim(),
               hidden = c.hidden_dim, vocab = c.vocab_size;
  size_t off = 0;
  auto take = [&off](size_t n) {
    const size_t at = off;
    off += n;
    return at;
  };
  embedding_ = take(vocab * dim);
  attn_norm_ = take(layers * dim);
  wq_ = take(layers * q * dim);
  wk_ = take(layers * kv * dim);
  wv_ = take(layers * kv * dim);
  wo_ = take(layers * dim * q);
  ffn_norm_ = take(layers * dim);
  w1_ = take(layers * hidden * dim);
  w2_ = take(layers * dim * hidden);
  w3_ = take(layers * hidden * dim);
  final_norm_ = take(dim);
  return off;
}

absl::StatusOr<Checkpoint> Checkpoint::LoadLlama2c(const std::string& path) {
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
  c.bos_token = c.vocab_size > kBosTokenLlama2c ? kBosTokenLlama2c : -1;
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

  // Legacy RoPE tables (both halves, seq_len x head_dim floats) sit between the final norm and
  // the unshared classifier.
  const size_t rope_tables = static_cast<size_t>(c.seq_len) * c.head_dim();
  const size_t weights_end = ck.LayOut();
  ck.classifier_ = c.shared_classifier ? ck.embedding_ : weights_end + rope_tables;
  return ck;
}

}  // namespace kvc::model

// Hugging Face Llama checkpoints: config.json + safetensors (one file or shards), converted to the
// llama2.c tensor order in fp32 so that the transformer reads both formats the same way.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <fstream>
#include <map>
#include <new>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvc/checked_math.h"
#include "kvc/convert.h"
#include "kvc/model/checkpoint.h"
#include "kvc/model/hf_config.h"
#include "kvc/safetensors.h"
#include "kvc/status_macros.h"

namespace kvc::model {
namespace {

constexpr char kConfigFile[] = "config.json";
constexpr char kSingleFile[] = "model.safetensors";
constexpr char kIndexFile[] = "model.safetensors.index.json";
constexpr uint64_t kMaxJsonBytes = uint64_t{64} << 20;

bool IsRegularFile(const std::string& path, uint64_t* size = nullptr) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return false;
  if (size != nullptr) *size = static_cast<uint64_t>(st.st_size);
  return true;
}

absl::StatusOr<std::string> ReadSmallFile(const std::string& path) {
  uint64_t size = 0;
  if (!IsRegularFile(path, &size)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such file"));
  }
  if (size > kMaxJsonBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", size, " bytes, more than the ", kMaxJsonBytes, " accepted"));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in && !in.eof()) return absl::InternalError(absl::StrCat(path, ": read error"));
  return text.str();
}

// A read-only mapping of a whole file, so that parsing a shard does not first copy it.
class MappedFile {
 public:
  static absl::StatusOr<std::unique_ptr<MappedFile>> Open(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
    struct stat st;
    if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(fd);
      return absl::InvalidArgumentError(absl::StrCat(path, ": not a regular file"));
    }
    std::unique_ptr<MappedFile> f(new MappedFile);
    f->size_ = static_cast<size_t>(st.st_size);
    if (f->size_ > 0) {
      void* p = ::mmap(nullptr, f->size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        ::close(fd);
        return absl::ResourceExhaustedError(
            absl::StrCat(path, ": cannot map ", f->size_, " bytes"));
      }
      f->data_ = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
    return f;
  }
  ~MappedFile() {
    if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  absl::Span<const uint8_t> bytes() const { return {data_, size_}; }

 private:
  MappedFile() = default;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Where one expected tensor goes in the fp32 weights.
struct Slot {
  std::vector<int64_t> shape;
  size_t offset = 0;
  bool loaded = false;
};

// Shard file names from the index: plain names inside the directory, in first-mention order, and
// which shard each tensor is said to be in.
struct ShardPlan {
  std::vector<std::string> files;
  std::map<std::string, std::string> tensor_file;  // empty for a single file
};

absl::StatusOr<ShardPlan> PlanShards(const std::string& dir) {
  ShardPlan plan;
  const std::string index_path = absl::StrCat(dir, "/", kIndexFile);
  if (!IsRegularFile(index_path)) {
    if (!IsRegularFile(absl::StrCat(dir, "/", kSingleFile))) {
      return absl::NotFoundError(absl::StrCat(dir, ": neither ", kSingleFile, " nor ", kIndexFile,
                                              " (a Hugging Face checkpoint needs one)"));
    }
    plan.files.push_back(kSingleFile);
    return plan;
  }
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path));
  ASSIGN_OR_RETURN(plan.tensor_file, ParseSafetensorsIndex(text, index_path));
  std::set<std::string> seen;
  for (const auto& [tensor, file] : plan.tensor_file) {
    if (seen.insert(file).second) plan.files.push_back(file);
  }
  for (const std::string& file : plan.files) {
    if (!IsRegularFile(absl::StrCat(dir, "/", file))) {
      return absl::NotFoundError(
          absl::StrCat(index_path, ": shard '", file, "' is not a file in ", dir));
    }
  }
  return plan;
}

absl::Status TensorError(const std::string& where, const std::string& name,
                         absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": tensor ", name, ": ", problem));
}

}  // namespace

absl::StatusOr<Checkpoint> Checkpoint::LoadHuggingFace(const std::string& dir) {
  const std::string config_path = absl::StrCat(dir, "/", kConfigFile);
  ASSIGN_OR_RETURN(std::string config_text, ReadSmallFile(config_path));
  absl::StatusOr<LlamaConfig> parsed = ParseHuggingFaceConfig(config_text);
  if (!parsed.ok()) {
    return absl::Status(parsed.status().code(),
                        absl::StrCat(config_path, ": ", parsed.status().message()));
  }
  ASSIGN_OR_RETURN(const ShardPlan plan, PlanShards(dir));

  Checkpoint ck;
  ck.config_ = *parsed;
  const LlamaConfig& c = ck.config_;
  // Weight count, checked: the config is untrusted and sizes multiply.
  uint64_t floats = 0;
  const uint64_t dim = c.dim, q = c.q_dim(), kv = c.kv_dim(), hidden = c.hidden_dim;
  uint64_t per_layer = 0;
  bool ok = CheckedMulAdd(2, dim, &per_layer) && CheckedMulAdd(2 * q, dim, &per_layer) &&
            CheckedMulAdd(2 * kv, dim, &per_layer) && CheckedMulAdd(3 * hidden, dim, &per_layer) &&
            CheckedMulAdd(c.n_layers, per_layer, &floats) &&
            CheckedMulAdd(c.vocab_size, dim, &floats) && CheckedMulAdd(1, dim, &floats) &&
            (c.shared_classifier || CheckedMulAdd(c.vocab_size, dim, &floats));
  if (!ok || floats > UINT64_MAX / sizeof(float) || floats > SIZE_MAX / sizeof(float)) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, ": the weight count it implies overflows 64 bits"));
  }
  // The cheapest weights are 2 bytes: refuse before allocating when the files cannot hold them.
  uint64_t file_bytes = 0;
  for (const std::string& file : plan.files) {
    uint64_t size = 0;
    IsRegularFile(absl::StrCat(dir, "/", file), &size);
    file_bytes += size;
  }
  if (floats > file_bytes / 2) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_path, ": implies ", floats, " weights (", c.n_layers,
                     " layers, hidden_size ", c.dim, ", vocab_size ", c.vocab_size,
                     "), more than the ", file_bytes, " bytes of safetensors can hold"));
  }
  try {
    ck.data_.resize(floats);
  } catch (const std::bad_alloc&) {
    return absl::ResourceExhaustedError(
        absl::StrCat(dir, ": cannot allocate ", floats, " fp32 weights"));
  }

  const size_t end = ck.LayOut();
  ck.classifier_ = c.shared_classifier ? ck.embedding_ : end;
  const int64_t h = c.dim, qd = q, kvd = kv, ffn = c.hidden_dim, vocab = c.vocab_size;
  std::map<std::string, Slot> slots;
  slots["model.embed_tokens.weight"] = {{vocab, h}, ck.embedding_};
  slots["model.norm.weight"] = {{h}, ck.final_norm_};
  if (!c.shared_classifier) slots["lm_head.weight"] = {{vocab, h}, ck.classifier_};
  for (int l = 0; l < c.n_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const size_t L = l;
    slots[p + "input_layernorm.weight"] = {{h}, ck.attn_norm_ + L * h};
    slots[p + "self_attn.q_proj.weight"] = {{qd, h}, ck.wq_ + L * ck.QSize()};
    slots[p + "self_attn.k_proj.weight"] = {{kvd, h}, ck.wk_ + L * ck.KvSize()};
    slots[p + "self_attn.v_proj.weight"] = {{kvd, h}, ck.wv_ + L * ck.KvSize()};
    slots[p + "self_attn.o_proj.weight"] = {{h, qd}, ck.wo_ + L * ck.QSize()};
    slots[p + "post_attention_layernorm.weight"] = {{h}, ck.ffn_norm_ + L * h};
    slots[p + "mlp.gate_proj.weight"] = {{ffn, h}, ck.w1_ + L * ck.FfnSize()};
    slots[p + "mlp.down_proj.weight"] = {{h, ffn}, ck.w2_ + L * ck.FfnSize()};
    slots[p + "mlp.up_proj.weight"] = {{ffn, h}, ck.w3_ + L * ck.FfnSize()};
  }

  for (const std::string& file : plan.files) {
    const std::string path = absl::StrCat(dir, "/", file);
    ASSIGN_OR_RETURN(std::unique_ptr<MappedFile> mapped, MappedFile::Open(path));
    absl::StatusOr<StFile> st = ParseSafetensors(mapped->bytes());
    if (!st.ok()) {
      return absl::Status(st.status().code(), absl::StrCat(path, ": ", st.status().message()));
    }
    mapped.reset();
    for (StTensor& t : st->tensors) {
      if (!plan.tensor_file.empty()) {
        auto it = plan.tensor_file.find(t.name);
        if (it != plan.tensor_file.end() && it->second != file) {
          return TensorError(path, t.name,
                             absl::StrCat(kIndexFile, " places it in '", it->second, "'"));
        }
      }
      auto slot = slots.find(t.name);
      if (slot == slots.end()) {
        if (absl::EndsWith(t.name, ".rotary_emb.inv_freq")) continue;  // old checkpoints' cache
        if (t.name == "lm_head.weight" && c.shared_classifier) {
          // tie_word_embeddings: transformers uses the embedding and ignores a stored lm_head.
          if (t.shape != std::vector<int64_t>{vocab, h}) {
            return TensorError(path, t.name,
                               absl::StrCat("shape ", ShapeString(t.shape), ", expected [", vocab,
                                            ", ", h, "] (vocab_size, hidden_size)"));
          }
          continue;
        }
        return TensorError(
            path, t.name,
            absl::EndsWith(t.name, ".bias")
                ? "biases are not supported (a Llama without attention_bias/mlp_bias has none)"
                : absl::StrCat("not part of a ", c.n_layers,
                               "-layer LlamaForCausalLM (unknown name)"));
      }
      if (slot->second.loaded) return TensorError(path, t.name, "appears twice");
      if (t.shape != slot->second.shape) {
        return TensorError(path, t.name,
                           absl::StrCat("shape ", ShapeString(t.shape), ", expected ",
                                        ShapeString(slot->second.shape), " from ", kConfigFile));
      }
      DType dtype;
      switch (t.dtype) {
        case StDType::kF32:
          dtype = DType::kF32;
          break;
        case StDType::kF16:
          dtype = DType::kF16;
          break;
        case StDType::kBF16:
          dtype = DType::kBF16;
          break;
        default:
          return TensorError(path, t.name,
                             absl::StrCat("dtype ", std::string(StDTypeName(t.dtype)),
                                          " is not a float type (F32, BF16 or F16)"));
      }
      const size_t n = t.data.size() / DTypeSize(dtype);
      ToFloat(t.data.data(), dtype, n, ck.data_.data() + slot->second.offset);
      slot->second.loaded = true;
      std::vector<uint8_t>().swap(t.data);  // keep the peak at one copy of the shard
    }
  }
  for (const auto& [name, slot] : slots) {
    if (!slot.loaded) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, ": missing tensor ", name, " (shape ", ShapeString(slot.shape), ")",
                       name == "lm_head.weight" ? "; tie_word_embeddings is false" : ""));
    }
  }
  for (const auto& [name, file] : plan.tensor_file) {
    if (slots.count(name) == 0 && !absl::EndsWith(name, ".rotary_emb.inv_freq") &&
        name != "lm_head.weight") {
      return TensorError(absl::StrCat(dir, "/", kIndexFile), name, "listed but not expected");
    }
  }
  return ck;
}

}  // namespace kvc::model

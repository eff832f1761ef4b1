// put, get, stat, ls, rm, info.
#include <cstdio>
#include <cstring>
#include <ctime>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvc/safetensors.h"
#include "kvcctl.h"

namespace kvc::ctl {
namespace {

namespace pb = kvcache::v1;

// Parses flags; on --help prints usage and sets *exit to 0, on a bad flag to 2.
bool ParseArgs(FlagSet& flags, const std::vector<std::string>& args, const std::string& usage,
               std::vector<std::string>* positional, int* exit_code) {
  absl::StatusOr<std::vector<std::string>> p = flags.Parse(args);
  if (!p.ok()) {
    *exit_code = Usage(std::string(p.status().message()), usage, flags);
    return false;
  }
  if (flags.GetBool("help")) {
    std::printf("usage: %s\nflags:\n%s", usage.c_str(), flags.Help().c_str());
    *exit_code = kExitOk;
    return false;
  }
  *positional = *std::move(p);
  return true;
}

double MiB(uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

const char* DTypeName(pb::DType t) {
  switch (t) {
    case pb::DTYPE_F32:
      return "f32";
    case pb::DTYPE_F16:
      return "f16";
    case pb::DTYPE_BF16:
      return "bf16";
    default:
      return "?";
  }
}

std::string FormatTime(int64_t unix_ms) {
  if (unix_ms == 0) return "never";
  const time_t t = static_cast<time_t>(unix_ms / 1000);
  struct tm tm;
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// --rope_pairs, --rope_theta, --rope_dims, --rope_linear as a RopeSpec.
absl::Status RopeFromFlags(const FlagSet& flags, pb::RopeSpec* rope) {
  const std::string pairs = flags.GetString("rope_pairs");
  if (pairs == "interleaved") {
    rope->set_style(pb::ROPE_INTERLEAVED);
  } else if (pairs == "half_split") {
    rope->set_style(pb::ROPE_HALF_SPLIT);
  } else {
    return absl::InvalidArgumentError("--rope_pairs: must be interleaved or half_split");
  }
  const int64_t dims = flags.GetInt("rope_dims");
  if (dims < 0 || dims > UINT32_MAX) return absl::InvalidArgumentError("--rope_dims: out of range");
  rope->set_theta(flags.GetDouble("rope_theta"));
  rope->set_rotary_dims(static_cast<uint32_t>(dims));
  if (const double linear = flags.GetDouble("rope_linear"); linear != 0) {
    rope->set_scaling(pb::ROPE_SCALING_LINEAR);
    rope->set_scaling_factor(linear);
  }
  return absl::OkStatus();
}

// Maps the safetensors file onto a PutCache header and per-layer views of its tensors.
// `row_log_mass`: the policy is kvzip, whose q_stats are [Hq, W].
absl::Status BuildUpload(const StFile& file, pb::PutCacheHeader* header,
                         std::vector<LayerTensors>* layers, bool row_log_mass) {
  const StTensor* k0 = file.Find("layer.0.k");
  if (k0 == nullptr) return absl::InvalidArgumentError("file: no tensor named layer.0.k");
  std::set<std::string> used;
  const StTensor* q0 = file.Find("layer.0.q_obs");
  for (int l = 0;; ++l) {
    const std::string p = absl::StrCat("layer.", l, ".");
    const StTensor* k = file.Find(p + "k");
    if (k == nullptr) break;
    const StTensor* v = file.Find(p + "v");
    const StTensor* q = file.Find(p + "q_obs");
    if (v == nullptr) return absl::InvalidArgumentError(absl::StrCat("file: ", p, "v missing"));
    if (k->shape.size() != 3 || k->shape != k0->shape || v->shape != k0->shape) {
      return absl::InvalidArgumentError(
          absl::StrCat("file: ", p, "k and ", p, "v must be [Hkv, S, D] like layer.0.k"));
    }
    if (k->dtype != k0->dtype || v->dtype != k0->dtype) {
      return absl::InvalidArgumentError(
          absl::StrCat("file: ", p, "k/v dtype differs from layer 0"));
    }
    if ((q == nullptr) != (q0 == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("file: ", p, "q_obs must be present in every layer or in none"));
    }
    if (q != nullptr && (q->shape.size() != 3 || q->shape != q0->shape || q->dtype != k0->dtype ||
                         q->shape[2] != k0->shape[2])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "file: ", p, "q_obs must be [Hq, W, D] with layer.0.k's D and dtype, same every layer"));
    }
    // Optional query statistics for --policy=expected: F32 [Hq, D + D*D] (TENSOR_Q_STATS); for
    // --policy=kvzip the rows' log-masses, F32 [Hq, W].
    const StTensor* st = file.Find(p + "q_stats");
    const StTensor* st0 = file.Find("layer.0.q_stats");
    if ((st == nullptr) != (st0 == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat("file: ", p, "q_stats must be present in every layer or in none"));
    }
    if (st != nullptr) {
      const int64_t d = k0->shape[2];
      const bool masses = row_log_mass;
      const int64_t cols = masses ? (q0 != nullptr ? q0->shape[1] : -1) : d + d * d;
      if (st->dtype != StDType::kF32 || st->shape.size() != 2 || st->shape != st0->shape ||
          st->shape[1] != cols || (q0 != nullptr && st->shape[0] != q0->shape[0])) {
        return absl::InvalidArgumentError(absl::StrCat(
            "file: ", p, "q_stats must be F32 ",
            masses ? "[Hq, W] (each query row's log-mass)" : "[Hq, D + D*D] (mean, covariance)",
            ", same every layer"));
      }
    }
    layers->push_back({k->data.data(), v->data.data(), q ? q->data.data() : nullptr,
                       st ? reinterpret_cast<const float*>(st->data.data()) : nullptr});
    used.insert({p + "k", p + "v", p + "q_obs", p + "q_stats"});
  }
  for (const StTensor& t : file.tensors) {
    if (used.count(t.name) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("file: unexpected tensor '", t.name,
                       "' (expected layer.{l}.k/.v/.q_obs/.q_stats, l = 0..)"));
    }
  }
  absl::StatusOr<DType> dtype = ToDType(k0->dtype);
  if (!dtype.ok()) {
    return absl::InvalidArgumentError("file: layer.0.k dtype must be F32, F16 or BF16");
  }
  header->set_dtype(*dtype == DType::kF32   ? pb::DTYPE_F32
                    : *dtype == DType::kF16 ? pb::DTYPE_F16
                                            : pb::DTYPE_BF16);
  header->set_layout(pb::LAYOUT_HND);
  pb::ModelShape* s = header->mutable_shape();
  for (int64_t d : k0->shape) {
    if (d < 1 || d > UINT32_MAX) return absl::InvalidArgumentError("file: bad layer.0.k shape");
  }
  s->set_num_layers(static_cast<uint32_t>(layers->size()));
  s->set_num_kv_heads(static_cast<uint32_t>(k0->shape[0]));
  s->set_seq_len(static_cast<uint32_t>(k0->shape[1]));
  s->set_head_dim(static_cast<uint32_t>(k0->shape[2]));
  const StTensor* st0 = file.Find("layer.0.q_stats");
  s->set_num_q_heads(static_cast<uint32_t>(q0 ? q0->shape[0] : st0 ? st0->shape[0] : k0->shape[0]));
  header->mutable_compression()->mutable_eviction()->set_query_stats(st0 != nullptr);
  s->set_obs_window(static_cast<uint32_t>(q0 ? q0->shape[1] : 0));
  return absl::OkStatus();
}

}  // namespace

int RunPut(const std::vector<std::string>& args) {
  const std::string usage = "kvcctl put <file.safetensors> [--id=ID] [flags]";
  FlagSet flags;
  AddGlobalFlags(&flags);
  AddCompressionFlags(&flags);
  flags.Use("id");
  flags.Use("ttl");
  flags.Use("overwrite");
  flags.Use("rope_theta");
  flags.Use("rope_pairs");
  flags.Use("rope_dims");
  flags.Use("rope_linear");
  std::vector<std::string> pos;
  int code;
  if (!ParseArgs(flags, args, usage, &pos, &code)) return code;
  if (pos.size() != 1) return Usage("put takes exactly one file", usage, flags);
  absl::StatusOr<pb::CompressionConfig> compression = CompressionFromFlags(flags);
  if (!compression.ok()) return Usage(std::string(compression.status().message()), usage, flags);
  const int64_t ttl = flags.GetInt("ttl");
  if (ttl < 0 || ttl > UINT32_MAX) return Usage("--ttl: out of range", usage, flags);
  std::string id = flags.GetString("id");
  if (id.empty()) {
    id = pos[0].substr(pos[0].find_last_of('/') + 1);
    if (const size_t dot = id.rfind('.'); dot != std::string::npos && dot > 0) id.resize(dot);
  }
  absl::StatusOr<StFile> file = ReadSafetensors(pos[0]);
  if (!file.ok()) return Fail("put", file.status());
  pb::PutCacheHeader header;
  std::vector<LayerTensors> layers;
  if (absl::Status s = BuildUpload(*file, &header, &layers,
                                   compression.ok() && compression->eviction().policy() == "kvzip");
      !s.ok()) {
    return Fail("put", s);
  }
  header.set_cache_id(id);
  const bool query_stats = header.compression().eviction().query_stats();
  *header.mutable_compression() = *compression;
  header.mutable_compression()->mutable_eviction()->set_query_stats(query_stats);
  if (!flags.GetString("rope_pairs").empty()) {
    if (absl::Status s = RopeFromFlags(flags, header.mutable_rope()); !s.ok()) {
      return Usage(std::string(s.message()), usage, flags);
    }
  }
  header.set_ttl_seconds(static_cast<uint32_t>(ttl));
  header.set_overwrite(flags.GetBool("overwrite"));
  absl::StatusOr<std::unique_ptr<Client>> client = MakeClient(flags);
  if (!client.ok()) return Fail("put", client.status());
  absl::StatusOr<PutResult> r = (*client)->PutCache(header, layers);
  if (!r.ok()) return Fail("put", r.status());
  std::printf("put %s: %.2f MiB in, %.2f MiB stored (ratio %.2fx), %.3f s, backend %s\n",
              r->cache_id().c_str(), MiB(r->input_bytes()), MiB(r->stored_bytes()),
              r->compression_ratio(), r->elapsed_seconds(), r->backend().c_str());
  return kExitOk;
}

int RunGet(const std::vector<std::string>& args) {
  const std::string usage =
      "kvcctl get <id> <out.safetensors> [--format=packed|dense|contiguous --rope_pairs=...]";
  FlagSet flags;
  AddGlobalFlags(&flags);
  flags.Use("format");
  flags.Use("rope_theta");
  flags.Use("rope_pairs");
  flags.Use("rope_dims");
  flags.Use("rope_linear");
  flags.Use("layer_begin");
  flags.Use("layer_end");
  std::vector<std::string> pos;
  int code;
  if (!ParseArgs(flags, args, usage, &pos, &code)) return code;
  if (pos.size() != 2) return Usage("get takes an id and an output file", usage, flags);
  GetOptions opt;
  const std::string format = flags.GetString("format");
  if (format == "dense" || format == "contiguous") {
    opt.format = CacheFormat::kDense;
  } else if (format != "packed") {
    return Usage("--format: must be packed, dense or contiguous", usage, flags);
  }
  if (format == "contiguous") {
    if (absl::Status s = RopeFromFlags(flags, &opt.contiguous_rope.emplace()); !s.ok()) {
      return Usage(std::string(s.message()), usage, flags);
    }
  }
  const int64_t begin = flags.GetInt("layer_begin"), end = flags.GetInt("layer_end");
  if (begin < 0 || begin > UINT32_MAX) return Usage("--layer_begin: out of range", usage, flags);
  if (end != -1 && (end <= begin || end > UINT32_MAX)) {
    return Usage("--layer_end: must be -1 or exceed --layer_begin", usage, flags);
  }
  opt.layer_begin = static_cast<uint32_t>(begin);
  if (end != -1) opt.layer_end = static_cast<uint32_t>(end);
  absl::StatusOr<std::unique_ptr<Client>> client = MakeClient(flags);
  if (!client.ok()) return Fail("get", client.status());
  absl::StatusOr<CacheData> data = (*client)->GetCache(pos[0], opt);
  if (!data.ok()) return Fail("get", data.status());

  StFile out;
  const pb::CacheInfo& info = data->info;
  out.metadata["format"] = opt.contiguous_rope.has_value()     ? "kvc-contiguous-v1"
                           : opt.format == CacheFormat::kDense ? "kvc-dense-v1"
                                                               : "kvc-compact-v1";
  out.metadata["cache_id"] = info.cache_id();
  out.metadata["dtype"] = DTypeName(info.dtype());
  out.metadata["num_layers"] = absl::StrCat(info.shape().num_layers());
  out.metadata["num_kv_heads"] = absl::StrCat(info.shape().num_kv_heads());
  out.metadata["head_dim"] = absl::StrCat(info.shape().head_dim());
  out.metadata["seq_len"] = absl::StrCat(info.shape().seq_len());
  uint64_t bytes = 0;
  const StDType elem = info.dtype() == pb::DTYPE_F32    ? StDType::kF32
                       : info.dtype() == pb::DTYPE_BF16 ? StDType::kBF16
                                                        : StDType::kF16;
  const int64_t heads = info.shape().num_kv_heads(), dim = info.shape().head_dim();
  for (LayerData& l : data->layers) {
    const std::string p = absl::StrCat("layer.", l.layer, ".");
    if (opt.format == CacheFormat::kPacked) {
      bytes += l.packed.size();
      const int64_t n = static_cast<int64_t>(l.packed.size());
      out.tensors.push_back({p + "packed", StDType::kU8, {n}, {l.packed.begin(), l.packed.end()}});
      continue;
    }
    const int64_t kept = l.kept_tokens;
    bytes += l.k.size() + l.v.size() + l.positions.size() * 4;
    std::vector<uint8_t> pos_bytes(l.positions.size() * 4);
    std::memcpy(pos_bytes.data(), l.positions.data(), pos_bytes.size());
    out.tensors.push_back({p + "k", elem, {heads, kept, dim}, {l.k.begin(), l.k.end()}});
    out.tensors.push_back({p + "v", elem, {heads, kept, dim}, {l.v.begin(), l.v.end()}});
    out.tensors.push_back({p + "positions", StDType::kI32, {heads, kept}, std::move(pos_bytes)});
  }
  if (absl::Status s = WriteSafetensors(pos[1], out); !s.ok()) return Fail("get", s);
  std::printf("get %s: %zu layers, %.2f MiB (%s) -> %s\n", info.cache_id().c_str(),
              data->layers.size(), MiB(bytes), format.c_str(), pos[1].c_str());
  return kExitOk;
}

int RunStat(const std::vector<std::string>& args) {
  const std::string usage = "kvcctl stat <id>";
  FlagSet flags;
  AddGlobalFlags(&flags);
  std::vector<std::string> pos;
  int code;
  if (!ParseArgs(flags, args, usage, &pos, &code)) return code;
  if (pos.size() != 1) return Usage("stat takes exactly one id", usage, flags);
  absl::StatusOr<std::unique_ptr<Client>> client = MakeClient(flags);
  if (!client.ok()) return Fail("stat", client.status());
  absl::StatusOr<CacheInfo> i = (*client)->StatCache(pos[0]);
  if (!i.ok()) return Fail("stat", i.status());
  const pb::ModelShape& s = i->shape();
  std::printf("cache_id:     %s\n", i->cache_id().c_str());
  std::printf("replica:      %s\n", (*client)->replicas()[(*client)->ReplicaFor(pos[0])].c_str());
  std::printf("shape:        layers=%u kv_heads=%u q_heads=%u head_dim=%u seq_len=%u window=%u\n",
              s.num_layers(), s.num_kv_heads(), s.num_q_heads(), s.head_dim(), s.seq_len(),
              s.obs_window());
  std::printf("dtype:        %s\n", DTypeName(i->dtype()));
  std::printf("compression:  %s\n", i->compression().ShortDebugString().c_str());
  std::printf("input_bytes:  %llu\n", static_cast<unsigned long long>(i->input_bytes()));
  std::printf("stored_bytes: %llu\n", static_cast<unsigned long long>(i->stored_bytes()));
  std::printf("ratio:        %.3f\n", i->compression_ratio());
  std::printf("kept_tokens:  %s\n", absl::StrJoin(i->kept_tokens(), ",").c_str());
  std::printf("created:      %s\n", FormatTime(i->created_unix_ms()).c_str());
  std::printf("expires:      %s\n", FormatTime(i->expires_unix_ms()).c_str());
  std::printf("checksum:     %016llx\n", static_cast<unsigned long long>(i->checksum()));
  return kExitOk;
}

int RunLs(const std::vector<std::string>& args) {
  const std::string usage = "kvcctl ls [--prefix=P]";
  FlagSet flags;
  AddGlobalFlags(&flags);
  flags.Use("prefix");
  std::vector<std::string> pos;
  int code;
  if (!ParseArgs(flags, args, usage, &pos, &code)) return code;
  if (!pos.empty()) return Usage("ls takes no arguments", usage, flags);
  absl::StatusOr<std::unique_ptr<Client>> client = MakeClient(flags);
  if (!client.ok()) return Fail("ls", client.status());
  absl::StatusOr<std::vector<CacheInfo>> list = (*client)->ListCaches(flags.GetString("prefix"));
  if (!list.ok()) return Fail("ls", list.status());
  std::printf("%-40s %6s %8s %5s %12s %12s %7s  %s\n", "ID", "LAYERS", "TOKENS", "DTYPE",
              "INPUT_MIB", "STORED_MIB", "RATIO", "EXPIRES");
  for (const CacheInfo& i : *list) {
    std::printf("%-40s %6u %8u %5s %12.2f %12.2f %7.2f  %s\n", i.cache_id().c_str(),
                i.shape().num_layers(), i.shape().seq_len(), DTypeName(i.dtype()),
                MiB(i.input_bytes()), MiB(i.stored_bytes()), i.compression_ratio(),
                FormatTime(i.expires_unix_ms()).c_str());
  }
  return kExitOk;
}

int RunRm(const std::vector<std::string>& args) {
  const std::string usage = "kvcctl rm <id>...";
  FlagSet flags;
  AddGlobalFlags(&flags);
  std::vector<std::string> pos;
  int code;
  if (!ParseArgs(flags, args, usage, &pos, &code)) return code;
  if (pos.empty()) return Usage("rm takes at least one id", usage, flags);
  absl::StatusOr<std::unique_ptr<Client>> client = MakeClient(flags);
  if (!client.ok()) return Fail("rm", client.status());
  int exit_code = kExitOk;
  for (const std::string& id : pos) {
    absl::StatusOr<uint64_t> freed = (*client)->DeleteCache(id);
    if (!freed.ok()) {
      exit_code = Fail("rm " + id, freed.status());
      continue;
    }
    std::printf("rm %s: freed %llu bytes\n", id.c_str(), static_cast<unsigned long long>(*freed));
  }
  return exit_code;
}

int RunInfo(const std::vector<std::string>& args) {
  const std::string usage = "kvcctl info";
  FlagSet flags;
  AddGlobalFlags(&flags);
  std::vector<std::string> pos;
  int code;
  if (!ParseArgs(flags, args, usage, &pos, &code)) return code;
  if (!pos.empty()) return Usage("info takes no arguments", usage, flags);
  absl::StatusOr<std::unique_ptr<Client>> client = MakeClient(flags);
  if (!client.ok()) return Fail("info", client.status());
  int exit_code = kExitOk;
  for (size_t r = 0; r < (*client)->replicas().size(); ++r) {
    const std::string& addr = (*client)->replicas()[r];
    absl::StatusOr<ServerInfo> i = (*client)->GetServerInfo(r);
    if (!i.ok()) {
      exit_code = Fail("info " + addr, i.status());
      continue;
    }
    const pb::Limits& l = i->limits();
    std::printf("replica %s\n", addr.c_str());
    std::printf("  version:   %s\n  backend:   %s (%s)\n  serving:   %s\n", i->version().c_str(),
                i->backend().c_str(), i->backend_description().c_str(),
                i->serving() ? "yes" : "no (draining)");
    std::printf("  policies:  %s | channels: %s\n",
                absl::StrJoin(i->eviction_policies(), ",").c_str(),
                absl::StrJoin(i->channel_policies(), ",").c_str());
    std::printf("  store:     %u entries, %.2f / %.2f MiB\n", i->store_entries(),
                MiB(i->store_used_bytes()), MiB(l.store_capacity_bytes()));
    std::printf(
        "  limits:    message %.2f MiB, chunk %.2f MiB, cache %.2f MiB, streams %u, "
        "default ttl %u s\n",
        MiB(l.max_message_bytes()), MiB(l.max_chunk_bytes()), MiB(l.max_cache_bytes()),
        l.max_concurrent_streams(), l.default_ttl_seconds());
    std::printf("  nccl:      %s\n", i->nccl_available() ? "available" : "not available");
  }
  return exit_code;
}

}  // namespace kvc::ctl

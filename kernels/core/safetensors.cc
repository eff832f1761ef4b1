#include "kvc/safetensors.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <set>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/json.h"

namespace kvc {
namespace {

struct NamedType {
  const char* name;
  StDType type;
};
constexpr NamedType kTypes[] = {{"F32", StDType::kF32},   {"F16", StDType::kF16},
                                {"BF16", StDType::kBF16}, {"I32", StDType::kI32},
                                {"I64", StDType::kI64},   {"U8", StDType::kU8}};

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("safetensors: ", what));
}

// One header entry before the data is attached.
struct Entry {
  StTensor tensor;
  uint64_t begin = 0, end = 0;
  size_t order = 0;  // position in the header, to keep zero-size ties stable
};

// A JSON integer in [0, 2^63): the library stores non-negative integers as number_unsigned.
bool AsNonNegative(const json::Value& v, int64_t* out) {
  if (!v.is_number_unsigned()) return v.is_number_integer() && (*out = v.get<int64_t>()) >= 0;
  const uint64_t u = v.get<uint64_t>();
  if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return false;
  *out = static_cast<int64_t>(u);
  return true;
}

absl::Status ParseTensorInfo(const std::string& name, const json::Value& v, Entry* e) {
  const std::string where = absl::StrCat("tensor ", json::Quote(name), ": ");
  if (!v.is_object()) return Bad(where + "info is not an object");
  const auto dtype = v.find("dtype");
  const auto shape = v.find("shape");
  const auto offsets = v.find("data_offsets");
  if (dtype == v.end() || !dtype->is_string()) {
    return Bad(where + "\"dtype\" is missing or not a string");
  }
  const std::string& dtype_name = dtype->get_ref<const json::Value::string_t&>();
  bool known = false;
  for (const NamedType& t : kTypes) {
    if (dtype_name == t.name) {
      e->tensor.dtype = t.type;
      known = true;
    }
  }
  if (!known) {
    return Bad(absl::StrCat(where, "dtype ", json::Quote(dtype_name),
                            " is not supported (expected F32, F16, BF16, I32, I64 or U8)"));
  }
  if (shape == v.end() || !shape->is_array()) {
    return Bad(where + "\"shape\" is missing or not an array");
  }
  // Element count, checked against overflow: any real tensor fits in the file, so a product
  // beyond 2^62 is an error rather than a wrap-around.
  uint64_t numel = 1;
  constexpr uint64_t kLimit = uint64_t{1} << 62;
  for (const json::Value& d : *shape) {
    int64_t dim = 0;
    if (!AsNonNegative(d, &dim)) {
      return Bad(where + "shape entries must be non-negative integers");
    }
    const auto udim = static_cast<uint64_t>(dim);
    if (udim != 0 && numel > kLimit / udim) return Bad(where + "shape is too large");
    numel *= udim;
    e->tensor.shape.push_back(dim);
  }
  int64_t b = 0, en = 0;
  if (offsets == v.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_integer() || !(*offsets)[1].is_number_integer()) {
    return Bad(where + "\"data_offsets\" must be an array of two integers");
  }
  if (!AsNonNegative((*offsets)[0], &b) || !AsNonNegative((*offsets)[1], &en) || en < b) {
    return Bad(
        absl::StrCat(where, "data_offsets ", (*offsets).dump(), " are not 0 <= begin <= end"));
  }
  e->begin = static_cast<uint64_t>(b);
  e->end = static_cast<uint64_t>(en);
  if (numel > kLimit / 8) return Bad(where + "shape is too large");
  const uint64_t bytes = numel * StDTypeSize(e->tensor.dtype);
  if (e->end - e->begin != bytes) {
    return Bad(absl::StrCat(where, "data_offsets span ", e->end - e->begin,
                            " bytes but shape and dtype need ", bytes));
  }
  e->tensor.name = name;
  return absl::OkStatus();
}

}  // namespace

size_t StDTypeSize(StDType t) {
  switch (t) {
    case StDType::kF32:
    case StDType::kI32:
      return 4;
    case StDType::kF16:
    case StDType::kBF16:
      return 2;
    case StDType::kI64:
      return 8;
    case StDType::kU8:
      return 1;
  }
  return 0;
}

std::string_view StDTypeName(StDType t) {
  for (const NamedType& n : kTypes) {
    if (n.type == t) return n.name;
  }
  return "unknown";
}

StDType ToStDType(DType t) {
  switch (t) {
    case DType::kF32:
      return StDType::kF32;
    case DType::kF16:
      return StDType::kF16;
    case DType::kBF16:
      return StDType::kBF16;
  }
  return StDType::kF32;
}

absl::StatusOr<DType> ToDType(StDType t) {
  switch (t) {
    case StDType::kF32:
      return DType::kF32;
    case StDType::kF16:
      return DType::kF16;
    case StDType::kBF16:
      return DType::kBF16;
    default:
      return absl::InvalidArgumentError(absl::StrCat("dtype: ", std::string(StDTypeName(t)),
                                                     " is not a floating-point KV dtype"));
  }
}

const StTensor* StFile::Find(std::string_view name) const {
  for (const StTensor& t : tensors) {
    if (t.name == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<StFile> ParseSafetensors(absl::Span<const uint8_t> bytes) {
  if (bytes.size() < 8) {
    return Bad(absl::StrCat("file of ", bytes.size(),
                            " bytes is too short for the 8-byte header length (truncated)"));
  }
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | bytes[i];
  if (n > kMaxSafetensorsHeaderBytes) {
    return Bad(absl::StrCat("header length ", n, " exceeds the limit of ",
                            kMaxSafetensorsHeaderBytes, " bytes"));
  }
  if (n > bytes.size() - 8) {
    return Bad(absl::StrCat("header length ", n, " runs past the end of the ", bytes.size(),
                            "-byte file (truncated)"));
  }
  const absl::string_view text(reinterpret_cast<const char*>(bytes.data() + 8), n);
  absl::StatusOr<json::Value> doc = json::Parse(text);
  if (!doc.ok()) return Bad(absl::StrCat("bad header: ", doc.status().message()));
  if (!doc->is_object()) return Bad("bad header: not a JSON object");

  StFile file;
  std::vector<Entry> entries;
  // json::Parse already rejects duplicate keys; members come in document order.
  for (const auto& [name, value] : doc->items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) return Bad("__metadata__ is not an object");
      for (const auto& [k, v] : value.items()) {
        if (!v.is_string()) {
          return Bad(absl::StrCat("__metadata__ ", json::Quote(k), " is not a string"));
        }
        file.metadata[k] = v.get_ref<const json::Value::string_t&>();
      }
      continue;
    }
    Entry e;
    e.order = entries.size();
    absl::Status st = ParseTensorInfo(name, value, &e);
    if (!st.ok()) return st;
    entries.push_back(std::move(e));
  }
  // Offsets must tile the data section exactly: sorted by begin, each starts where the previous
  // ends, the last ends at the end of the file.
  const uint64_t data_size = bytes.size() - 8 - n;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.order < b.order;
  });
  uint64_t expect = 0;
  for (const Entry& e : entries) {
    if (e.end > data_size) {
      return Bad(absl::StrCat("tensor \"", e.tensor.name, "\": data_offsets [", e.begin, ", ",
                              e.end, "] are out of range of the ", data_size,
                              "-byte data section (truncated?)"));
    }
    if (e.begin < expect) {
      return Bad(absl::StrCat("tensor \"", e.tensor.name, "\": data_offsets [", e.begin, ", ",
                              e.end, "] overlap the previous tensor (ends at ", expect, ")"));
    }
    if (e.begin > expect) {
      return Bad(absl::StrCat("tensor \"", e.tensor.name, "\": data_offsets begin at ", e.begin,
                              " leaving a gap after ", expect, " (offsets must cover the data)"));
    }
    expect = e.end;
  }
  if (expect != data_size) {
    return Bad(absl::StrCat("data section is ", data_size, " bytes but the tensors cover ", expect,
                            " (offsets must cover the data)"));
  }
  const uint8_t* data = bytes.data() + 8 + n;
  file.tensors.reserve(entries.size());
  for (Entry& e : entries) {
    e.tensor.data.assign(data + e.begin, data + e.end);
    file.tensors.push_back(std::move(e.tensor));
  }
  return file;
}

absl::Status ValidateStFile(const StFile& file) {
  // The header is JSON, whose strings are UTF-8: other bytes could be written but not read back.
  for (const auto& [k, v] : file.metadata) {
    if (!json::IsValidUtf8(k) || !json::IsValidUtf8(v)) {
      return Bad(absl::StrCat("__metadata__ ", json::Quote(k), ": key or value is not UTF-8"));
    }
  }
  std::set<std::string> names;
  for (size_t i = 0; i < file.tensors.size(); ++i) {
    const StTensor& t = file.tensors[i];
    const std::string where = absl::StrCat("tensors[", i, "] \"", t.name, "\": ");
    if (t.name == "__metadata__") return Bad(where + "the name __metadata__ is reserved");
    if (!names.insert(t.name).second) return Bad(where + "duplicate tensor name");
    if (!json::IsValidUtf8(t.name)) return Bad(where + "the name is not UTF-8");
    uint64_t numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) return Bad(absl::StrCat(where, "shape dimension ", d, " is negative"));
      if (d != 0 && numel > (uint64_t{1} << 62) / static_cast<uint64_t>(d)) {
        return Bad(where + "shape is too large");
      }
      numel *= static_cast<uint64_t>(d);
    }
    if (numel > (uint64_t{1} << 62) / 8 || numel * StDTypeSize(t.dtype) != t.data.size()) {
      return Bad(absl::StrCat(where, "data has ", t.data.size(), " bytes but shape and dtype ",
                              std::string(StDTypeName(t.dtype)), " need ",
                              numel * StDTypeSize(t.dtype)));
    }
  }
  return absl::OkStatus();
}

std::vector<uint8_t> SerializeSafetensors(const StFile& file) {
  std::string header = "{";
  bool first = true;
  if (!file.metadata.empty()) {
    header += "\"__metadata__\":{";
    for (const auto& [k, v] : file.metadata) {
      if (!first) header += ",";
      first = false;
      header += json::Quote(k) + ":" + json::Quote(v);
    }
    header += "}";
    first = false;
  }
  uint64_t offset = 0;
  for (const StTensor& t : file.tensors) {
    if (!first) header += ",";
    first = false;
    header += json::Quote(t.name) + ":{\"dtype\":\"" + std::string(StDTypeName(t.dtype)) +
              "\",\"shape\":[";
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i > 0) header += ",";
      header += absl::StrCat(t.shape[i]);
    }
    header += absl::StrCat("],\"data_offsets\":[", offset, ",", offset + t.data.size(), "]}");
    offset += t.data.size();
  }
  header += "}";
  header.append((8 - header.size() % 8) % 8, ' ');
  std::vector<uint8_t> out;
  out.reserve(8 + header.size() + offset);
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));
  out.insert(out.end(), header.begin(), header.end());
  for (const StTensor& t : file.tensors) out.insert(out.end(), t.data.begin(), t.data.end());
  return out;
}

absl::StatusOr<StFile> ReadSafetensors(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    const int err = errno;
    const std::string msg = absl::StrCat(path, ": cannot open: ", std::strerror(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::InternalError(msg);
  }
  std::vector<uint8_t> bytes;
  uint8_t buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) bytes.insert(bytes.end(), buf, buf + got);
  const bool failed = std::ferror(f) != 0;
  const int err = errno;
  std::fclose(f);
  if (failed) {
    return absl::InternalError(absl::StrCat(path, ": read error: ", std::strerror(err)));
  }
  absl::StatusOr<StFile> file = ParseSafetensors(bytes);
  if (!file.ok()) {
    return absl::Status(file.status().code(), absl::StrCat(path, ": ", file.status().message()));
  }
  return file;
}

absl::Status WriteSafetensors(const std::string& path, const StFile& file) {
  absl::Status st = ValidateStFile(file);
  if (!st.ok()) return absl::Status(st.code(), absl::StrCat(path, ": ", st.message()));
  const std::vector<uint8_t> bytes = SerializeSafetensors(file);
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) {
    return absl::InternalError(
        absl::StrCat(path, ": cannot create ", tmp, ": ", std::strerror(errno)));
  }
  const bool wrote = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  const int werr = errno;
  const bool closed = std::fclose(f) == 0;
  if (!wrote || !closed) {
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": write failed: ", std::strerror(werr)));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int rerr = errno;
    std::remove(tmp.c_str());
    return absl::InternalError(absl::StrCat(path, ": rename failed: ", std::strerror(rerr)));
  }
  return absl::OkStatus();
}

}  // namespace kvc

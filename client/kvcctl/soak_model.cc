#include "soak_model.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "kvc/compact.h"
#include "kvc/dtype.h"
#include "kvc/protocol/convert.h"
#include "kvc/status_macros.h"
#include "kvc/xxh3.h"

namespace kvc::soak {
namespace {

namespace pb = kvcache::v1;

const char* const kPolicies[] = {"none",      "streaming", "h2o",   "snapkv",
                                 "keyformer", "knorm",     "random"};

bool NeedsWindow(const std::string& policy) {
  const absl::StatusOr<EvictionPolicy> p = ParseEvictionPolicy(policy);
  return p.ok() && Policy(*p).inputs == PolicyInputs::kObservation;
}

template <class T>
T Pick(std::mt19937_64& rng, std::initializer_list<T> options) {
  std::uniform_int_distribution<size_t> d(0, options.size() - 1);
  return *(options.begin() + d(rng));
}

int Uniform(std::mt19937_64& rng, int lo, int hi) {
  return std::uniform_int_distribution<int>(lo, std::max(lo, hi))(rng);
}

// K/V row `t` of head `h` of a tensor in `layout`, as HND rows [Hkv, S, D].
std::vector<uint8_t> ToHnd(const std::vector<uint8_t>& in, Layout layout, const LayerShape& s,
                           size_t es) {
  if (layout == Layout::kHND) return in;
  std::vector<uint8_t> out(in.size());
  const size_t row = static_cast<size_t>(s.head_dim) * es;
  for (int t = 0; t < s.seq_len; ++t) {
    for (int h = 0; h < s.num_kv_heads; ++h) {
      std::memcpy(&out[(static_cast<size_t>(h) * s.seq_len + t) * row],
                  &in[(static_cast<size_t>(t) * s.num_kv_heads + h) * row], row);
    }
  }
  return out;
}

// DATA_LOSS naming the first differing byte of `got` against `want`, or OK.
absl::Status CompareBytes(const std::string& what, const uint8_t* got, size_t got_size,
                          const uint8_t* want, size_t want_size) {
  const size_t n = std::min(got_size, want_size);
  const auto diff = std::mismatch(got, got + n, want);
  if (diff.first == got + n && got_size == want_size) return absl::OkStatus();
  if (diff.first == got + n) {
    return absl::DataLossError(
        absl::StrCat(what, ": ", got_size, " bytes received, ", want_size, " expected"));
  }
  const size_t at = static_cast<size_t>(diff.first - got);
  return absl::DataLossError(absl::StrCat(what, ": byte ", at, " of ", want_size, " is 0x",
                                          absl::Hex(*diff.first), ", expected 0x",
                                          absl::Hex(*diff.second)));
}

// The served blob against the input itself (lossless versions only): every head keeps every
// token in order, unquantized, all channels, so its rows are the input's HND rows.
absl::Status CheckLosslessBlob(const Version& ver, uint32_t l, const ByteVector& blob) {
  auto view = CompactLayerView::Parse(blob);
  if (!view.ok()) return absl::DataLossError(absl::StrCat("packed: ", view.status().message()));
  const LayerShape& s = ver.shape;
  const size_t es = DTypeSize(ver.dtype);
  const size_t head_bytes = static_cast<size_t>(s.seq_len) * s.head_dim * es;
  const std::vector<uint8_t> k = ToHnd(ver.input->k[l], ver.layout, s, es);
  const std::vector<uint8_t> v = ToHnd(ver.input->v[l], ver.layout, s, es);
  for (int h = 0; h < view->num_kv_heads(); ++h) {
    const CompactHead head = view->head(h);
    if (head.n_kept != s.seq_len || head.n_recent != 0 || head.key_old == nullptr ||
        head.value_old == nullptr) {
      return absl::DataLossError(absl::StrCat("packed head ", h, ": keeps ", head.n_kept, " of ",
                                              s.seq_len, " tokens, not the whole input"));
    }
    RETURN_IF_ERROR(CompareBytes(absl::StrCat("input K head ", h),
                                 static_cast<const uint8_t*>(head.key_old), head_bytes,
                                 &k[h * head_bytes], head_bytes));
    RETURN_IF_ERROR(CompareBytes(absl::StrCat("input V head ", h),
                                 static_cast<const uint8_t*>(head.value_old), head_bytes,
                                 &v[h * head_bytes], head_bytes));
  }
  return absl::OkStatus();
}

absl::Status VerifyInfo(const Version& ver, const CacheInfo& info) {
  const pb::ModelShape& s = info.shape();
  if (s.num_layers() != static_cast<uint32_t>(ver.num_layers) ||
      s.num_kv_heads() != static_cast<uint32_t>(ver.shape.num_kv_heads) ||
      s.head_dim() != static_cast<uint32_t>(ver.shape.head_dim) ||
      s.seq_len() != static_cast<uint32_t>(ver.shape.seq_len) ||
      info.dtype() != ver.header.dtype() ||
      info.compression().eviction().policy() != ver.header.compression().eviction().policy()) {
    return absl::DataLossError(absl::StrCat("info: shape/dtype/policy differ (served ",
                                            s.ShortDebugString(), " ",
                                            info.compression().ShortDebugString(), ")"));
  }
  if (info.checksum() != ver.checksum) {
    return absl::DataLossError(absl::StrCat("info.checksum 0x", absl::Hex(info.checksum()),
                                            ", expected 0x", absl::Hex(ver.checksum)));
  }
  if (info.kept_tokens_size() != ver.num_layers) {
    return absl::DataLossError(absl::StrCat("info.kept_tokens: ", info.kept_tokens_size(),
                                            " entries for ", ver.num_layers, " layers"));
  }
  return absl::OkStatus();
}

absl::Status VerifyLayer(const Version& ver, const LayerData& got, CacheFormat format) {
  const uint32_t l = got.layer;
  if (l >= static_cast<uint32_t>(ver.num_layers)) {
    return absl::DataLossError(absl::StrCat("layer ", l, " beyond ", ver.num_layers, " layers"));
  }
  const ByteVector& blob = ver.packed[l];
  auto view = CompactLayerView::Parse(blob);
  if (!view.ok()) return view.status();  // the engine's own blob: a soak bug, not kvcd's
  const std::string where = absl::StrCat("layer ", l, " ");
  if (got.kept_tokens != static_cast<uint32_t>(view->max_kept())) {
    return absl::DataLossError(
        absl::StrCat(where, "kept_tokens ", got.kept_tokens, ", expected ", view->max_kept()));
  }
  if (format == CacheFormat::kPacked) {
    RETURN_IF_ERROR(CompareBytes(where + "packed", got.packed.data(), got.packed.size(),
                                 blob.data(), blob.size()));
    if (ver.lossless) {
      if (absl::Status s = CheckLosslessBlob(ver, l, got.packed); !s.ok()) {
        return absl::DataLossError(absl::StrCat(where, s.message()));
      }
    }
    return absl::OkStatus();
  }
  auto dense = ExportDense(*view);
  if (!dense.ok()) return dense.status();
  RETURN_IF_ERROR(CompareBytes(where + "dense K", got.k.data(), got.k.size(), dense->k.data(),
                               dense->k.size()));
  RETURN_IF_ERROR(CompareBytes(where + "dense V", got.v.data(), got.v.size(), dense->v.data(),
                               dense->v.size()));
  RETURN_IF_ERROR(CompareBytes(
      where + "dense positions", reinterpret_cast<const uint8_t*>(got.positions.data()),
      got.positions.size() * 4, reinterpret_cast<const uint8_t*>(dense->positions.data()),
      dense->positions.size() * 4));
  if (ver.lossless) {
    const size_t es = DTypeSize(ver.dtype);
    const std::vector<uint8_t> k = ToHnd(ver.input->k[l], ver.layout, ver.shape, es);
    const std::vector<uint8_t> v = ToHnd(ver.input->v[l], ver.layout, ver.shape, es);
    RETURN_IF_ERROR(
        CompareBytes(where + "dense K vs input", got.k.data(), got.k.size(), k.data(), k.size()));
    RETURN_IF_ERROR(
        CompareBytes(where + "dense V vs input", got.v.data(), got.v.size(), v.data(), v.size()));
  }
  return absl::OkStatus();
}

// Layers expected for `opt` on `ver`, or an error if the fetched list is not exactly them.
absl::Status VerifyRange(const Version& ver, const CacheData& got, const GetOptions& opt,
                         bool complete) {
  const uint32_t end = std::min<uint32_t>(opt.layer_end.value_or(ver.num_layers), ver.num_layers);
  const uint32_t expected = end > opt.layer_begin ? end - opt.layer_begin : 0;
  if (got.layers.size() > expected || (complete && got.layers.size() != expected)) {
    return absl::DataLossError(
        absl::StrCat(got.layers.size(), " layers received, ", expected, " expected"));
  }
  for (size_t i = 0; i < got.layers.size(); ++i) {
    if (got.layers[i].layer != opt.layer_begin + i) {
      return absl::DataLossError(absl::StrCat("layer ", got.layers[i].layer, " received at index ",
                                              i, ", expected layer ", opt.layer_begin + i));
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<LayerTensors> Version::Input::Tensors() const {
  std::vector<LayerTensors> t(k.size());
  for (size_t l = 0; l < k.size(); ++l) {
    t[l] = LayerTensors{k[l].data(), v[l].data(), q[l].empty() ? nullptr : q[l].data()};
  }
  return t;
}

std::string Version::Describe() const {
  const pb::CompressionConfig& c = header.compression();
  return absl::StrCat(c.eviction().policy(), " keep=", c.eviction().keep_ratio(), " ",
                      c.channels().key_policy(), "=", c.channels().key_lambda(),
                      " bits=", c.quant().bits(), " recent=", c.recent_tokens(), " ",
                      std::string(DTypeName(dtype)), " ", std::string(LayoutName(layout)), " L",
                      num_layers, " Hkv", shape.num_kv_heads, " Hq", shape.num_q_heads, " S",
                      shape.seq_len, " D", shape.head_dim, " W", shape.obs_window, " seed=", seed);
}

uint64_t CacheChecksum(const std::vector<ByteVector>& blobs) {
  constexpr size_t kBlock = size_t{64} << 10;
  uint64_t sum = 0;
  for (size_t l = 0; l < blobs.size(); ++l) {
    for (size_t i = 0, off = 0; off < blobs[l].size(); ++i, off += kBlock) {
      const size_t n = std::min(kBlock, blobs[l].size() - off);
      sum += Xxh3(blobs[l].data() + off, n, (static_cast<uint64_t>(l) << 32) + i);
    }
  }
  return sum;
}

absl::StatusOr<Upload> MakeVersion(const std::string& id, uint64_t seed, const ShapeLimits& limits,
                                   Backend& backend) {
  std::mt19937_64 rng(seed);
  auto ver = std::make_shared<Version>();
  ver->id = id;
  ver->seed = seed;
  ver->dtype = Pick(rng, {DType::kF16, DType::kBF16, DType::kF32});
  ver->layout = Pick(rng, {Layout::kHND, Layout::kNHD});
  ver->num_layers = Uniform(rng, 1, limits.max_layers);
  LayerShape& s = ver->shape;
  s.num_kv_heads = std::min(limits.max_kv_heads, Pick(rng, {1, 2, 4}));
  s.num_q_heads = s.num_kv_heads * Pick(rng, {1, 2, 4});
  s.head_dim = std::min(limits.max_head_dim, Pick(rng, {32, 64, 128}));
  s.seq_len = Uniform(rng, 16, limits.max_tokens);

  // A third of the versions store the input as is (the byte-exact path).
  const bool lossless = std::uniform_int_distribution<int>(0, 2)(rng) == 0 || limits.lossless_only;
  const std::string policy = lossless ? "none" : kPolicies[Uniform(rng, 0, 6)];
  std::string key_policy = "none";
  double lambda = 0;
  int bits = 0;
  if (!lossless) {
    key_policy = Pick<const char*>(rng, {"none", "none", "think", "l1", "l2"});
    if (key_policy != "none") lambda = Pick(rng, {0.25, 0.5});
    bits = Pick(rng, {0, 2, 4, 8});
  }
  const bool needs_window = NeedsWindow(policy) || key_policy == "think";
  s.obs_window =
      needs_window || Uniform(rng, 0, 1) == 1 ? Uniform(rng, 1, std::min(32, s.seq_len)) : 0;
  ver->lossless = lossless;

  pb::PutCacheHeader& h = ver->header;
  h.set_cache_id(id);
  h.set_dtype(ToProto(ver->dtype));
  h.set_layout(ToProto(ver->layout));
  h.set_overwrite(true);
  *h.mutable_shape() = ShapeToProto(s, ver->num_layers);
  // The request's config; the engine's spec for the local reference is what kvcd maps it to.
  pb::CompressionConfig* c = h.mutable_compression();
  c->mutable_eviction()->set_policy(policy);
  if (policy != "none") {
    c->mutable_eviction()->set_keep_ratio(Pick(rng, {0.1, 0.25, 0.5, 0.9}));
    c->mutable_eviction()->set_seed(rng());
  }
  c->mutable_channels()->set_key_policy(key_policy);
  c->mutable_channels()->set_key_lambda(lambda);
  c->mutable_quant()->set_bits(bits);
  c->set_recent_tokens(Pick(rng, {0, 8, 32}));
  ASSIGN_OR_RETURN(ver->spec, SpecFromProto(*c, s, ver->num_layers));
  const CompressionSpec& spec = ver->spec;

  const size_t es = DTypeSize(ver->dtype);
  const size_t kv = static_cast<size_t>(s.num_kv_heads) * s.seq_len * s.head_dim;
  const size_t qn = static_cast<size_t>(s.num_q_heads) * s.obs_window * s.head_dim;
  std::uniform_real_distribution<float> value(-2.f, 2.f);
  auto fill = [&](std::vector<uint8_t>& t, size_t n) {
    t.resize(n * es);
    for (size_t i = 0; i < n; ++i) StoreFromFloat(t.data(), ver->dtype, i, value(rng));
  };
  auto input = std::make_shared<Version::Input>();
  input->k.resize(ver->num_layers);
  input->v.resize(ver->num_layers);
  input->q.resize(ver->num_layers);
  for (int l = 0; l < ver->num_layers; ++l) {
    fill(input->k[l], kv);
    fill(input->v[l], kv);
    fill(input->q[l], qn);
    ver->kv_bytes += 2 * kv * es;
    LayerInput in;
    in.shape = s;
    in.dtype = ver->dtype;
    in.layout = ver->layout;
    in.layer_index = l;
    in.k = input->k[l].data();
    in.v = input->v[l].data();
    in.q_obs = qn > 0 ? input->q[l].data() : nullptr;
    auto layer = backend.Compress(in, spec, nullptr);
    if (!layer.ok()) {
      return absl::Status(
          layer.status().code(),
          absl::StrCat("engine compress of ", ver->Describe(), ": ", layer.status().message()));
    }
    ver->packed.push_back(std::move(layer->bytes));
  }
  ver->checksum = CacheChecksum(ver->packed);
  if (ver->lossless) ver->input = input;
  return Upload{std::shared_ptr<const Version>(std::move(ver)), std::move(input)};
}

absl::Status Verify(const Version& ver, const CacheData& got, const GetOptions& opt,
                    bool complete) {
  RETURN_IF_ERROR(VerifyInfo(ver, got.info));
  RETURN_IF_ERROR(VerifyRange(ver, got, opt, complete));
  // Bytes first: their message names the layer and offset of a difference.
  for (const LayerData& l : got.layers) RETURN_IF_ERROR(VerifyLayer(ver, l, opt.format));
  const bool whole =
      complete && opt.layer_begin == 0 &&
      opt.layer_end.value_or(ver.num_layers) >= static_cast<uint32_t>(ver.num_layers);
  if (whole && opt.format == CacheFormat::kPacked) {
    std::vector<ByteVector> blobs;
    for (const LayerData& l : got.layers) blobs.push_back(l.packed);
    const uint64_t sum = CacheChecksum(blobs);
    if (sum != got.info.checksum()) {
      return absl::DataLossError(absl::StrCat("checksum of the received blobs 0x", absl::Hex(sum),
                                              " differs from info.checksum 0x",
                                              absl::Hex(got.info.checksum())));
    }
  }
  return absl::OkStatus();
}

uint64_t VerifiedBytes(const CacheData& got) {
  uint64_t n = 0;
  for (const LayerData& l : got.layers) {
    n += l.packed.size() + l.k.size() + l.v.size() + l.positions.size() * 4;
  }
  return n;
}

absl::StatusOr<std::shared_ptr<const Version>> Match(
    const std::vector<std::shared_ptr<const Version>>& candidates, const CacheData& got,
    const GetOptions& opt, bool complete) {
  std::vector<std::string> why;
  for (const auto& c : candidates) {
    absl::Status s = Verify(*c, got, opt, complete);
    if (s.ok()) return c;
    why.push_back(absl::StrCat("[", c->Describe(), "] ", s.message()));
  }
  // A mix: every layer matches some candidate, but no candidate matches them all.
  bool each_layer_matches = !got.layers.empty() && !candidates.empty();
  for (const LayerData& l : got.layers) {
    bool any = false;
    for (const auto& c : candidates) any = any || VerifyLayer(*c, l, opt.format).ok();
    each_layer_matches = each_layer_matches && any;
  }
  return absl::DataLossError(absl::StrCat(
      "cache '", got.info.cache_id(), "': ", each_layer_matches ? "MIXED versions: " : "",
      "matches none of ", candidates.size(), " legal versions: ", absl::StrJoin(why, "; ")));
}

// ---- Ledger ----

uint64_t Ledger::BeginPut(std::shared_ptr<const Version> version, uint64_t start) {
  absl::MutexLock lock(&mu_);
  Record r;
  r.handle = next_handle_++;
  r.start = start;
  const std::string id = version->id;
  r.version = std::move(version);
  ids_[id].push_back(std::move(r));
  return ids_[id].back().handle;
}

void Ledger::EndPut(const std::string& id, uint64_t handle, bool ok, bool maybe_stored,
                    uint64_t end) {
  absl::MutexLock lock(&mu_);
  std::vector<Record>& history = ids_[id];
  for (Record& r : history) {
    if (r.handle != handle) continue;
    r.end = end;
    r.ok = ok;
    r.maybe_stored = ok || maybe_stored;
  }
  PruneLocked(history, end);
}

void Ledger::Deleted(const std::string& id, uint64_t start, uint64_t end) {
  absl::MutexLock lock(&mu_);
  std::vector<Record>& history = ids_[id];
  Record r;
  r.handle = next_handle_++;
  r.start = start;
  r.end = end;
  r.ok = true;
  history.push_back(std::move(r));
  PruneLocked(history, end);
}

void Ledger::Wiped(uint64_t at) {
  absl::MutexLock lock(&mu_);
  wipes_.push_back(at);
}

bool Ledger::Superseded(const Record& p, const std::vector<Record>& history,
                        const std::vector<uint64_t>& wipes, uint64_t before) {
  if (p.end == kOpen) return false;
  if (!p.maybe_stored) return true;
  for (uint64_t w : wipes) {
    if (p.end < w && w < before) return true;
  }
  for (const Record& q : history) {
    if (&q == &p || !q.ok || q.end == kOpen) continue;
    if (q.version != nullptr && q.version == p.version) continue;
    if (p.end < q.start && q.end < before) return true;
  }
  return false;
}

void Ledger::PruneLocked(std::vector<Record>& history, uint64_t now) {
  // An upload superseded before the oldest running GetCache started can be returned by no
  // GetCache, running or later.
  const uint64_t horizon = active_gets_.empty() ? now : std::min(now, *active_gets_.begin());
  std::vector<Record> kept;
  for (const Record& r : history) {
    if (r.version != nullptr && Superseded(r, history, wipes_, horizon)) continue;
    kept.push_back(r);
  }
  // A delete supersedes only uploads that ended before it started; later uploads end later still.
  uint64_t oldest_end = kOpen;
  for (const Record& r : kept) {
    if (r.version != nullptr) oldest_end = std::min(oldest_end, r.end);
  }
  history.clear();
  for (Record& r : kept) {
    if (r.version == nullptr && oldest_end >= r.start) continue;
    history.push_back(std::move(r));
  }
}

uint64_t Ledger::BeginGet() {
  absl::MutexLock lock(&mu_);
  const uint64_t start = Tick();
  active_gets_.insert(start);
  return start;
}

void Ledger::EndGet(uint64_t start) {
  absl::MutexLock lock(&mu_);
  auto it = active_gets_.find(start);
  if (it != active_gets_.end()) active_gets_.erase(it);
}

std::vector<std::shared_ptr<const Version>> Ledger::Candidates(const std::string& id,
                                                               uint64_t get_start,
                                                               uint64_t get_end) const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<const Version>> out;
  auto it = ids_.find(id);
  if (it == ids_.end()) return out;
  for (const Record& r : it->second) {
    if (r.version == nullptr || r.start >= get_end) continue;
    if (Superseded(r, it->second, wipes_, get_start)) continue;
    out.push_back(r.version);
  }
  return out;
}

size_t Ledger::RecordsForTesting() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [id, h] : ids_) n += h.size();
  return n;
}

}  // namespace kvc::soak

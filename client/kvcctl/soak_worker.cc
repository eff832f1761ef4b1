#include "soak_worker.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "kvc/client_wire.h"
#include "kvc/status_macros.h"

namespace kvc::soak {
namespace {

namespace pb = kvcache::v1;
using Code = absl::StatusCode;

bool ReachedServer(Code c) {
  return c == Code::kOk || c == Code::kNotFound || c == Code::kResourceExhausted ||
         c == Code::kAlreadyExists;
}

// What a broken connection looks like to a call that was in flight when kvcd died.
bool ConnectionLoss(Code c) {
  return c == Code::kUnavailable || c == Code::kCancelled || c == Code::kInternal ||
         c == Code::kUnknown;
}

}  // namespace

void SoakState::Count(const std::string& op, absl::StatusCode code) {
  ++ops;
  absl::MutexLock lock(&mu_);
  ++counts_[op][StatusCodeName(code)];
}

void SoakState::Fault(const std::string& kind) {
  absl::MutexLock lock(&mu_);
  ++faults_[kind];
}

void SoakState::Failure(const std::string& what) {
  std::fprintf(stderr, "\nsoak FAILURE: %s\n", what.c_str());
  absl::MutexLock lock(&mu_);
  if (failures_.size() < 20) failures_.push_back(what);
  ++failure_count_;
}

std::map<std::string, std::map<std::string, uint64_t>> SoakState::OpCounts() const {
  absl::MutexLock lock(&mu_);
  return counts_;
}
std::map<std::string, uint64_t> SoakState::FaultCounts() const {
  absl::MutexLock lock(&mu_);
  return faults_;
}
std::vector<std::string> SoakState::Failures() const {
  absl::MutexLock lock(&mu_);
  return failures_;
}
uint64_t SoakState::failure_count() const {
  absl::MutexLock lock(&mu_);
  return failure_count_;
}

SoakWorker::SoakWorker(SoakState* state, int index)
    : state_(state), index_(index), rng_(state->config.seed * 0x9e3779b97f4a7c15ull + index) {}

absl::StatusOr<std::unique_ptr<SoakWorker>> SoakWorker::Create(SoakState* state, int index) {
  std::unique_ptr<SoakWorker> w(new SoakWorker(state, index));
  const SoakConfig& c = state->config;
  BackendOptions bo;
  bo.num_threads = 1;
  ASSIGN_OR_RETURN(w->backend_, CreateCpuBackend(bo));
  ClientOptions o;
  o.target = c.target;
  o.unary_timeout = c.timeout;
  o.stream_timeout = c.timeout;
  o.max_chunk_bytes = kMinChunkBytes;
  o.buffer_pool_bytes = 0;
  ASSIGN_OR_RETURN(w->client_, Client::Create(o));
  // Clients 0, 1, 2, 3, 4, ... get 0.2 ms, 1 ms, 5 ms, --tiny_deadline_ms, 0.2 ms, ...: some
  // expire before the call leaves, some while kvcd works on it, some never.
  const absl::Duration tiny[] = {absl::Microseconds(200), absl::Milliseconds(1),
                                 absl::Milliseconds(5), absl::Milliseconds(c.tiny_deadline_ms)};
  o.unary_timeout = tiny[index % 4];
  o.stream_timeout = tiny[index % 4];
  o.max_attempts = 1;
  ASSIGN_OR_RETURN(w->tiny_client_, Client::Create(o));
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(16 << 20);
  args.SetMaxSendMessageSize(16 << 20);
  w->raw_ = pb::KvCache::NewStub(
      grpc::CreateCustomChannel(c.target, grpc::InsecureChannelCredentials(), args));
  return w;
}

std::string SoakWorker::PickId() {
  const SoakConfig& c = state_->config;
  if (c.race_ids > 0 && rng_() % 2 == 0) {
    return absl::StrCat(c.id_prefix, "race/", rng_() % c.race_ids);
  }
  return absl::StrCat(c.id_prefix, "c", index_, "/", rng_() % std::max(1, c.own_ids));
}

absl::StatusOr<Upload> SoakWorker::NewVersion(const std::string& id) {
  absl::StatusOr<Upload> v = MakeVersion(id, rng_(), state_->config.limits, *backend_);
  if (!v.ok()) state_->Failure(absl::StrCat("client ", index_, ": ", v.status().message()));
  return v;
}

void SoakWorker::Judge(const std::string& op, const Client& via, const absl::Status& s,
                       uint64_t epoch0, const std::vector<absl::StatusCode>& extra_ok) {
  const Code c = s.code();
  uint64_t& reached_epoch = reached_epoch_[&via == client_.get() ? 0 : 1];
  state_->Count(op, c);
  const uint64_t epoch = state_->epoch.load();
  if (ReachedServer(c)) {
    reached_epoch = epoch0;
    if (c != Code::kAlreadyExists) return;
  }
  for (Code ok : extra_ok) {
    if (c == ok) return;
  }
  if (ConnectionLoss(c)) {
    // A kill during the call, or this client's channel has not reconnected since the last kill
    // (kvcd is still down, or came back less than --recover_seconds ago).
    if (epoch != epoch0) return;
    if (reached_epoch < epoch && c == Code::kUnavailable) {
      const int64_t ready = state_->ready_unix_ms.load();
      if (state_->down.load() ||
          absl::Now() - absl::FromUnixMillis(ready) < state_->config.recover) {
        return;
      }
      state_->Failure(absl::StrCat("client ", index_, " ", op, ": still UNAVAILABLE ",
                                   absl::FormatDuration(absl::Now() - absl::FromUnixMillis(ready)),
                                   " after kvcd restarted: ", s.message()));
      return;
    }
  }
  state_->Failure(absl::StrCat("client ", index_, " ", op, ": unexpected ", StatusCodeName(c), ": ",
                               s.message()));
}

void SoakWorker::Put(Client& client, const std::string& op) {
  const std::string id = PickId();
  absl::StatusOr<Upload> upload = NewVersion(id);
  if (!upload.ok()) return;
  const std::shared_ptr<const Version>& v = upload->version;
  const std::vector<LayerTensors> tensors = upload->input->Tensors();
  // One upload in 8 asks not to overwrite: ALREADY_EXISTS is then legal, but only when some
  // version could have been stored while it ran.
  PutHeader header = v->header;
  const bool create_only = rng_() % 8 == 0;
  header.set_overwrite(!create_only);
  const std::string name = create_only && op == "put" ? "put_new" : op;
  const uint64_t epoch0 = state_->epoch.load();
  const uint64_t start = state_->ledger.BeginGet();  // keeps what it may collide with in view
  const uint64_t handle = state_->ledger.BeginPut(v, start);
  absl::StatusOr<PutResult> r = client.PutCache(header, tensors);
  const Code c = r.status().code();
  const bool maybe_stored = !(c == Code::kInvalidArgument || c == Code::kResourceExhausted ||
                              c == Code::kAlreadyExists || c == Code::kUnimplemented ||
                              c == Code::kAborted);
  const uint64_t end = state_->ledger.Tick();
  state_->ledger.EndPut(id, handle, r.ok(), maybe_stored, end);
  const bool collided = c == Code::kAlreadyExists;
  const size_t others = collided ? state_->ledger.Candidates(id, start, end).size() : 0;
  state_->ledger.EndGet(start);
  std::vector<Code> legal;
  if (op != "put") legal.push_back(Code::kDeadlineExceeded);
  if (create_only) legal.push_back(Code::kAlreadyExists);
  // A DeleteCache of the id while it uploads stops the upload (ABORTED): only other clients can
  // delete a shared id meanwhile; this client's own ids see no concurrent delete.
  if (absl::StartsWith(id, absl::StrCat(state_->config.id_prefix, "race/"))) {
    legal.push_back(Code::kAborted);
  }
  Judge(name, client, r.status(), epoch0, legal);
  if (collided && create_only && others == 0) {
    state_->Failure(absl::StrCat("client ", index_, " ", name, " '", id,
                                 "': ALREADY_EXISTS, but no upload of it could be stored then"));
  }
  if (!r.ok()) return;
  uint64_t stored = 0;
  for (const ByteVector& b : v->packed) stored += b.size();
  const uint64_t kv = v->kv_bytes;
  if (r->stored_bytes() != stored || r->input_bytes() != kv) {
    state_->Failure(absl::StrCat("client ", index_, " put '", id, "' [", v->Describe(),
                                 "]: stored_bytes ", r->stored_bytes(), " (engine: ", stored,
                                 "), input_bytes ", r->input_bytes(), " (sent K+V: ", kv, ")"));
  }
}

void SoakWorker::Get(bool cancel_midway) {
  const std::string id = PickId();
  GetOptions opt;
  opt.format = rng_() % 2 ? CacheFormat::kDense : CacheFormat::kPacked;
  if (rng_() % 4 == 0) {  // a layer range (may reach past the end: kvcd clamps or rejects)
    opt.layer_begin = rng_() % 2;
    opt.layer_end = opt.layer_begin + 1 + rng_() % 2;
  }
  const size_t cancel_after = cancel_midway ? rng_() % 3 : ~size_t{0};
  const std::string op = cancel_midway ? "get_cancel" : "get";
  const uint64_t epoch0 = state_->epoch.load();
  const uint64_t start = state_->ledger.BeginGet();
  CacheData got;
  absl::Status s = client_->GetCacheStreaming(
      id, opt,
      [&](const CacheInfo& info) {
        got.info = info;
        return cancel_after == 0 ? absl::CancelledError("soak: cancel after the info")
                                 : absl::OkStatus();
      },
      [&](LayerData&& layer) {
        got.layers.push_back(std::move(layer));
        return got.layers.size() >= cancel_after ? absl::CancelledError("soak: cancel midway")
                                                 : absl::OkStatus();
      });
  const uint64_t end = state_->ledger.Tick();
  const std::vector<std::shared_ptr<const Version>> candidates =
      state_->ledger.Candidates(id, start, end);
  state_->ledger.EndGet(start);
  const bool cancelled_by_us = cancel_midway && s.code() == Code::kCancelled &&
                               absl::StrContains(s.message(), "soak: cancel");
  if (cancelled_by_us) {
    state_->Count(op, Code::kCancelled);
    state_->Fault("cancel_download");
    reached_epoch_[0] = epoch0;
  } else {
    // A layer range beyond this version's layers is INVALID_ARGUMENT: legal for ranges only.
    Judge(op, *client_, s, epoch0,
          opt.layer_end.has_value() ? std::vector<Code>{Code::kInvalidArgument}
                                    : std::vector<Code>{});
    if (!s.ok()) return;
  }
  if (got.info.cache_id().empty()) return;  // cancelled before anything arrived
  if (got.info.cache_id() != id) {
    state_->Failure(absl::StrCat("client ", index_, " get '", id, "': served cache '",
                                 got.info.cache_id(), "'"));
    return;
  }
  if (state_->config.self_check && fetched_++ % 10 == 0 && !got.layers.empty()) {
    LayerData& l = got.layers.back();
    ByteVector& b = l.packed.empty() ? l.k : l.packed;
    if (!b.empty()) b[rng_() % b.size()] ^= 0x10;
  }
  absl::StatusOr<std::shared_ptr<const Version>> match =
      Match(candidates, got, opt, /*complete=*/!cancelled_by_us);
  if (!match.ok()) {
    state_->Failure(absl::StrCat("client ", index_, " CORRUPTION ", op, " ",
                                 opt.format == CacheFormat::kDense ? "DENSE" : "PACKED",
                                 " layers [", opt.layer_begin, ", ",
                                 opt.layer_end.has_value() ? absl::StrCat(*opt.layer_end) : "end",
                                 "): ", match.status().message()));
    return;
  }
  ++state_->verified_gets;
  const uint64_t n = VerifiedBytes(got);
  state_->verified_bytes += n;
  if ((*match)->lossless) state_->lossless_bytes += n;
}

void SoakWorker::Delete(Client& client, const std::string& op) {
  const std::string id = PickId();
  const uint64_t epoch0 = state_->epoch.load();
  const uint64_t start = state_->ledger.Tick();
  absl::StatusOr<uint64_t> r = client.DeleteCache(id);
  const uint64_t end = state_->ledger.Tick();
  if (r.ok() || r.status().code() == Code::kNotFound) state_->ledger.Deleted(id, start, end);
  Judge(op, client, r.status(), epoch0,
        op != "delete" ? std::vector<Code>{Code::kDeadlineExceeded} : std::vector<Code>{});
}

void SoakWorker::Stat() {
  const std::string id = PickId();
  const uint64_t epoch0 = state_->epoch.load();
  absl::StatusOr<CacheInfo> r = client_->StatCache(id);
  Judge("stat", *client_, r.status(), epoch0);
  if (r.ok() && r->cache_id() != id) {
    state_->Failure(
        absl::StrCat("client ", index_, " stat '", id, "': answered '", r->cache_id(), "'"));
  }
}

// An upload that never completes: the header and a random part of the tensors, then (stall) a wait
// of --stall_seconds, then a cancel. Nothing of it may ever be served: it is not in the ledger,
// so a GetCache returning it would match no legal version.
void SoakWorker::AbandonUpload(bool stall) {
  const std::string id = PickId();
  absl::StatusOr<Upload> upload = NewVersion(id);
  if (!upload.ok()) return;
  const Version& ver = *upload->version;
  const Version::Input& in = *upload->input;
  const std::string op = stall ? "put_stall" : "put_cancel";
  state_->Fault(stall ? "stalled_upload" : "cancel_upload");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + state_->config.timeout + state_->config.stall));
  pb::PutCacheResponse resp;
  std::unique_ptr<grpc::ClientWriter<pb::PutCacheRequest>> writer = raw_->PutCache(&ctx, &resp);
  pb::PutCacheRequest req;
  *req.mutable_header() = ver.header;
  bool open = writer->Write(req);
  // The tensors in upload order (layer by layer: Q_obs, K, V, as the client sends them), in 64 KiB
  // pieces, up to a random byte short of the end: kvcd may be scoring or compressing early layers
  // when the cancel comes.
  struct Tensor {
    uint32_t layer;
    pb::TensorKind kind;
    const std::vector<uint8_t>* bytes;
  };
  std::vector<Tensor> order;
  uint64_t total = 0;
  for (int l = 0; l < ver.num_layers; ++l) {
    for (auto [kind, t] : {std::pair{pb::TENSOR_Q_OBS, &in.q[l]}, std::pair{pb::TENSOR_K, &in.k[l]},
                           std::pair{pb::TENSOR_V, &in.v[l]}}) {
      if (t->empty()) continue;
      order.push_back({static_cast<uint32_t>(l), kind, t});
      total += t->size();
    }
  }
  uint64_t left = 1 + rng_() % (total - 1);  // total >= 2: K alone has many bytes
  constexpr size_t kPiece = 64 << 10;
  for (const Tensor& t : order) {
    for (size_t off = 0; open && left > 0 && off < t.bytes->size(); off += kPiece) {
      const size_t n = std::min<uint64_t>({kPiece, t.bytes->size() - off, left});
      req.Clear();
      req.mutable_chunk()->set_layer(t.layer);
      req.mutable_chunk()->set_tensor(t.kind);
      req.mutable_chunk()->set_offset(off);
      req.set_data(t.bytes->data() + off, n);
      open = writer->Write(req);
      left -= n;
    }
  }
  if (stall) {
    const absl::Time until = absl::Now() + state_->config.stall;
    while (!state_->stop.load() && absl::Now() < until) absl::SleepFor(absl::Milliseconds(50));
  }
  ctx.TryCancel();
  const grpc::Status s = writer->Finish();
  // Whatever ended it (our cancel, kvcd's idle timeout, a kill), the upload must not be stored.
  state_->Count(op, static_cast<Code>(s.error_code()));
  if (s.ok()) {
    state_->Failure(
        absl::StrCat("client ", index_, " ", op, " '", id, "': an incomplete upload answered OK"));
  }
}

void SoakWorker::Run() {
  const double fault_rate = state_->config.fault_rate;
  std::uniform_real_distribution<double> unit(0, 1);
  while (!state_->stop.load()) {
    ++n_;
    if (unit(rng_) < fault_rate) {
      switch (rng_() % 6) {
        case 0:
          AbandonUpload(/*stall=*/false);
          break;
        case 1:
          if (state_->config.stall > absl::ZeroDuration()) {
            AbandonUpload(/*stall=*/true);
            break;
          }
          [[fallthrough]];
        case 2:
          Get(/*cancel_midway=*/true);
          break;
        case 3:
          state_->Fault("tiny_deadline");
          Put(*tiny_client_, "put_tiny");
          break;
        case 4:
          state_->Fault("tiny_deadline");
          Delete(*tiny_client_, "delete_tiny");
          break;
        default:
          Get(/*cancel_midway=*/true);
          break;
      }
      continue;
    }
    const uint64_t r = rng_() % 20;
    if (r < 8) {
      Put(*client_, "put");
    } else if (r < 16) {
      Get(/*cancel_midway=*/false);
    } else if (r < 18) {
      Delete(*client_, "delete");
    } else {
      Stat();
    }
  }
}

}  // namespace kvc::soak

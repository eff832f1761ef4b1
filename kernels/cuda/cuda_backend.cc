// The CUDA backend: each call takes a stream slot, stages host inputs through the slot's pinned
// buffer (device-resident inputs are read where they are), runs scoring -> selection -> channel
// selection -> gather -> quantization on the device, and copies the blob back. The blob layout is
// planned on the host before any kernel runs (it depends only on shapes and the spec), so the only
// synchronization is the final one.
#include "cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "cuda/adaptive_select.h"
#include "cuda/compress_plan.h"
#include "cuda/decode_plan.h"
#include "cuda/device_input.h"
#include "cuda/kernels.h"
#include "cuda/resources.h"
#include "cuda/score_extra_kernels.h"
#include "cuda/scorers.h"
#include "kvc/status_macros.h"

namespace kvc::cuda {
namespace {

constexpr int kNumStreams = 4;
// Cap on the logits buffer of one scoring pass (64 MiB of floats): a Llama-3-8B layer at 32K
// tokens scores its 32 observation rows in two passes; keyformer's W = S stays bounded.
constexpr size_t kMaxLogitFloats = size_t{16} << 20;

Strides StridesOf(Layout layout, int heads, int tokens, int head_dim) {
  if (layout == Layout::kHND) return {static_cast<int64_t>(tokens) * head_dim, head_dim};
  return {head_dim, static_cast<int64_t>(heads) * head_dim};
}

size_t Align256(size_t x) { return (x + 255) & ~size_t{255}; }

class CudaBackend final : public Backend {
 public:
  CudaBackend(std::unique_ptr<SlotPool> pool, std::string description, const HostFallback* host)
      : pool_(std::move(pool)), description_(std::move(description)), host_(host) {}

  std::string_view name() const override { return "cuda"; }
  std::string description() const override { return description_; }

  absl::StatusOr<CompactLayer> Compress(const LayerInput& in, const CompressionSpec& spec,
                                        CompressTimings* timings) override;
  absl::Status Attend(const CompactLayerView& cache, const DecodeQuery& query, float* out) override;

 private:
  // Runs `fn(slot, arena)` on an acquired slot with the backend's device current, then frees the
  // call's arena in stream order and waits for the stream, so that the slot goes back idle. An
  // error of that wait (a fault in the call's kernels, or a context another call broke) fails the
  // call even when its result looked complete; a sticky one fails every later call too, with
  // the first fault named (SlotPool::broken).
  template <typename Fn>
  auto WithSlot(Fn fn) -> decltype(fn(static_cast<StreamSlot*>(nullptr), nullptr)) {
    if (absl::Status b = pool_->broken(); !b.ok()) return b;
    StreamSlot* slot = pool_->Acquire();
    absl::Cleanup release = [&] { pool_->Release(slot); };
    const cudaError_t err = cudaSetDevice(pool_->device());
    if (err != cudaSuccess) return pool_->Note(err, "cudaSetDevice");
    Arena arena;
    auto result = fn(slot, &arena);
    arena.Free(slot->stream);
    const cudaError_t sync = cudaStreamSynchronize(slot->stream);
    if (sync != cudaSuccess) {
      const absl::Status s = pool_->Note(sync, "finishing the call's work on its stream");
      if (result.ok()) return s;
    }
    return result;
  }

  absl::StatusOr<CompactLayer> CompressOnSlot(const LayerInput& in, const CompressionSpec& spec,
                                              StreamSlot* slot, Arena* arena,
                                              CompressTimings* timings);
  absl::Status AttendOnSlot(const CompactLayerView& cache, const DecodeQuery& query, float* out,
                            StreamSlot* slot, Arena* arena);

  std::unique_ptr<SlotPool> pool_;
  const std::string description_;
  const HostFallback* const host_;  // not owned
};

absl::StatusOr<CompactLayer> CudaBackend::Compress(const LayerInput& in,
                                                   const CompressionSpec& spec,
                                                   CompressTimings* timings) {
  RETURN_IF_ERROR(ValidateInput(in, /*allow_device=*/true));
  RETURN_IF_ERROR(ValidateSpec(spec, in.shape, in.layer_index));
  RETURN_IF_ERROR(ValidateSpecInput(spec, in));
  if (in.memory == MemorySpace::kDevice) RETURN_IF_ERROR(CheckDeviceInput(in, pool_->device()));
  if (Cancelled(in.cancel)) return in.cancel->status();
  if (Policy(spec.eviction.policy).scores && CudaScorerFor(spec.eviction.policy).score == nullptr) {
    // A scoring policy without a device scorer yet (cuda/scorers.h): the host engine compresses
    // the layer exactly as the CPU backend would (from a host copy of device-resident inputs).
    if (in.memory == MemorySpace::kDevice) {
      ASSIGN_OR_RETURN(const HostInput host_in, CopyInputToHost(in, /*with_kv=*/true));
      return host_->Compress(host_in.view, spec, timings);
    }
    return host_->Compress(in, spec, timings);
  }
  return WithSlot([&](StreamSlot* slot, Arena* arena) {
    return CompressOnSlot(in, spec, slot, arena, timings);
  });
}

absl::StatusOr<CompactLayer> CudaBackend::CompressOnSlot(const LayerInput& in,
                                                         const CompressionSpec& spec,
                                                         StreamSlot* slot, Arena* arena_ptr,
                                                         CompressTimings* timings) {
  const LayerShape& sh = in.shape;
  const int hkv = sh.num_kv_heads, hq = sh.num_q_heads, s = sh.seq_len, d = sh.head_dim;
  const int w = sh.obs_window;
  const ElemType et = static_cast<ElemType>(in.dtype);
  const size_t es = DTypeSize(in.dtype);
  const CompressPlan plan = MakeCompressPlan(in, spec);
  const CudaScorer& scorer = CudaScorerFor(spec.eviction.policy);
  const int b = plan.budget, m = b - plan.n_recent;
  const bool per_layer = spec.eviction.granularity == Granularity::kPerLayer;
  const bool need_q = w > 0;
  cudaStream_t st = slot->stream;

  // Host staging: K, V, Q in (unless they are on the device already); the blob comes back
  // through the same buffer.
  const bool on_device = in.memory == MemorySpace::kDevice;
  const size_t kv_bytes = on_device ? 0 : static_cast<size_t>(hkv) * s * d * es;
  const size_t q_bytes = need_q && !on_device ? static_cast<size_t>(hq) * w * d * es : 0;
  // Expected attention's statistics are computed on the host and travel with the inputs (from a
  // host copy of Q_obs when it is on the device).
  const bool expected = scorer.host_statistics;
  ExpectedStats stats;
  if (expected) {
    if (on_device && !spec.eviction.query_stats) {
      ASSIGN_OR_RETURN(const HostInput host_q, CopyInputToHost(in, /*with_kv=*/false));
      stats = host_->ExpectedStatistics(host_q.view, spec.eviction);
    } else {
      stats = host_->ExpectedStatistics(in, spec.eviction);
    }
  }
  // The statistics are the host's long step; the device stages run to the end once launched.
  if (Cancelled(in.cancel)) return in.cancel->status();
  const size_t mean_bytes = sizeof(float) * stats.mean.size();
  const size_t stat_bytes = Align256(mean_bytes) + sizeof(float) * stats.cov.size();
  // kvzip's rows travel with the inputs too: their key ranges with passes ([W][3] int32) and
  // their log-masses ([Hq, W] float, in.q_stats with spec.query_stats).
  const bool recon = Policy(spec.eviction.policy).rows_after_context;
  const std::vector<int32_t> row_keys =
      recon ? ReconRowKeys(spec.eviction, s, w) : std::vector<int32_t>{};
  const size_t keys_bytes = sizeof(int32_t) * row_keys.size();
  const bool log_mass = recon && spec.eviction.query_stats && in.q_stats != nullptr;
  const size_t mass_bytes = log_mass ? sizeof(float) * static_cast<size_t>(hq) * w : 0;
  const size_t recon_bytes = Align256(keys_bytes) + mass_bytes;
  const size_t in_bytes =
      Align256(kv_bytes) * 2 + Align256(q_bytes) + Align256(stat_bytes) + Align256(recon_bytes);
  RETURN_IF_ERROR(slot->ReservePinned(std::max(in_bytes, plan.blob_bytes)));
  uint8_t* pinned = static_cast<uint8_t*>(slot->pinned);
  if (!on_device) {
    std::memcpy(pinned, in.k, kv_bytes);
    std::memcpy(pinned + Align256(kv_bytes), in.v, kv_bytes);
    if (need_q) std::memcpy(pinned + 2 * Align256(kv_bytes), in.q_obs, q_bytes);
  }
  const size_t stat_at = 2 * Align256(kv_bytes) + Align256(q_bytes);
  if (expected) {
    std::memcpy(pinned + stat_at, stats.mean.data(), mean_bytes);
    std::memcpy(pinned + stat_at + Align256(mean_bytes), stats.cov.data(),
                sizeof(float) * stats.cov.size());
  }
  const size_t recon_at = stat_at + Align256(stat_bytes);
  if (keys_bytes > 0) std::memcpy(pinned + recon_at, row_keys.data(), keys_bytes);
  if (log_mass) std::memcpy(pinned + recon_at + Align256(keys_bytes), in.q_stats, mass_bytes);

  Arena& arena = *arena_ptr;
  const size_t o_in = arena.Add(in_bytes);
  // fp16/bf16 score on tensor cores without a logits buffer (LaunchTensorCoreColumnScores); its
  // per-row scratch is about S / 32 floats instead of S.
  const bool tensor_cores = in.dtype != DType::kF32 && !scorer.full_logits;
  const size_t row_floats =
      tensor_cores ? ColumnScoreScratchFloats(hq, 1, s) : static_cast<size_t>(hq) * s;
  // Observation rows per scoring pass: all of W unless the scratch would exceed the cap.
  const int block_rows = static_cast<int>(
      std::clamp<size_t>(kMaxLogitFloats / row_floats, 1, static_cast<size_t>(std::max(w, 1))));
  const size_t logit_floats = tensor_cores ? ColumnScoreScratchFloats(hq, block_rows, s)
                                           : static_cast<size_t>(hq) * block_rows * s;
  const size_t o_logits = arena.Add(scorer.attention_logits ? sizeof(float) * logit_floats : 0);
  const size_t o_scores = arena.Add(sizeof(float) * static_cast<size_t>(hkv) * s);
  // Value norms [Hkv, S], or the scorer's own scratch (expected logits [Hq, S], KeyDiff's mean
  // keys [Hkv, D]).
  const ValueWeight value_weight = EffectiveValueWeight(spec.eviction);
  const bool weighted = value_weight == ValueWeight::kMul || value_weight == ValueWeight::kAdd;
  size_t extra_floats = weighted ? static_cast<size_t>(hkv) * s : 0;
  if (scorer.extra_floats != nullptr) {
    extra_floats = std::max(extra_floats, scorer.extra_floats(sh, spec.eviction));
  }
  const size_t o_extra = arena.Add(sizeof(float) * extra_floats);
  const size_t o_pooled = arena.Add(sizeof(float) * static_cast<size_t>(hkv) * s);
  const size_t o_pos = arena.Add(sizeof(int32_t) * static_cast<size_t>(hkv) * b);
  const size_t o_topk = arena.Add(TopKScratchBytes(per_layer ? 1 : hkv, s));
  const size_t o_kidx = arena.Add(sizeof(int32_t) * static_cast<size_t>(hkv) * plan.key_channels);
  const size_t o_vidx = arena.Add(sizeof(int32_t) * static_cast<size_t>(hkv) * plan.value_channels);
  const bool channel_work = plan.key_channels < d || plan.value_channels < d;
  const size_t o_cscratch =
      arena.Add(channel_work ? sizeof(float) * ChannelScratchFloats(hkv, hq, w, b, d) : 0);
  const size_t o_pscratch =
      arena.Add(spec.quant.bits > 0 ? sizeof(float) * PackScratchFloats(hkv, m, plan.key_channels,
                                                                        plan.value_channels)
                                    : 0);
  const size_t o_offsets = arena.Add(sizeof(HeadOffsets) * hkv);
  const size_t o_blob = arena.Add(plan.blob_bytes);
  RETURN_IF_ERROR(arena.Allocate(pool_->mem_pool(), st));  // WithSlot frees it

  uint8_t* dev_in = arena.At<uint8_t>(o_in);
  const void* dk = on_device ? in.k : dev_in;
  const void* dv = on_device ? in.v : dev_in + Align256(kv_bytes);
  const void* dq = on_device ? in.q_obs : dev_in + 2 * Align256(kv_bytes);
  const Strides kvs = StridesOf(in.layout, hkv, s, d);
  const Strides qs = StridesOf(in.layout, hq, w, d);
  float* scores = arena.At<float>(o_scores);
  float* pooled = arena.At<float>(o_pooled);
  int32_t* pos = arena.At<int32_t>(o_pos);
  uint8_t* blob = arena.At<uint8_t>(o_blob);
  cudaEvent_t* ev = slot->events;

  if (in_bytes > 0) {
    KVC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dev_in, pinned, in_bytes, cudaMemcpyHostToDevice, st),
                             "copy inputs to device");
  }
  KVC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(arena.At<HeadOffsets>(o_offsets), plan.offsets.data(),
                                           sizeof(HeadOffsets) * hkv, cudaMemcpyHostToDevice, st),
                           "copy layout to device");
  KVC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(blob, 0, plan.blob_bytes, st), "clear blob");
  KVC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[0], st), "cudaEventRecord");

  // Stage 1: token scores, by the policy's row (cuda/scorers.h).
  const EvictionSpec& e = spec.eviction;
  float* final_scores = scores;
  if (scorer.score == nullptr) {  // a policy without scores (Compress sent the others to the host)
    KVC_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(scores, 0, sizeof(float) * hkv * s, st),
                             "clear scores");
  } else {
    ScoreArgs sa;
    sa.in = &in;
    sa.spec = &e;
    sa.dtype = et;
    sa.k = dk;
    sa.v = dv;
    sa.q = dq;
    sa.kvs = kvs;
    sa.qs = qs;
    sa.hq = hq;
    sa.hkv = hkv;
    sa.s = s;
    sa.d = d;
    sa.w = w;
    sa.tensor_cores = tensor_cores;
    sa.block_rows = block_rows;
    sa.logits = arena.At<float>(o_logits);
    sa.extra = arena.At<float>(o_extra);
    if (expected) {
      sa.stats_mean = reinterpret_cast<const float*>(dev_in + stat_at);
      sa.stats_cov = reinterpret_cast<const float*>(dev_in + stat_at + Align256(mean_bytes));
    }
    if (keys_bytes > 0) sa.recon.keys = reinterpret_cast<const int32_t*>(dev_in + recon_at);
    if (log_mass) {
      sa.recon.log_mass = reinterpret_cast<const float*>(dev_in + recon_at + Align256(keys_bytes));
    }
    sa.scores = scores;
    sa.pooled = pooled;
    sa.stream = st;
    ASSIGN_OR_RETURN(final_scores, scorer.score(sa));
  }
  if (weighted) {
    KVC_CUDA_RETURN_IF_ERROR(
        LaunchValueWeight(et, dv, kvs, hkv, s, d, static_cast<int>(value_weight),
                          static_cast<float>(e.value_eps), arena.At<float>(o_extra), final_scores,
                          st),
        "value weighting");
  }
  KVC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[1], st), "cudaEventRecord");
  if (e.adaptive) {
    // The ragged pack runs on the host: it needs the layer there.
    if (on_device) {
      ASSIGN_OR_RETURN(const HostInput host_in, CopyInputToHost(in, /*with_kv=*/true));
      return AdaptiveFromDeviceScores(host_in.view, spec, *host_, final_scores, st, timings);
    }
    return AdaptiveFromDeviceScores(in, spec, *host_, final_scores, st, timings);
  }

  // Stage 2: token and channel selection.
  if (per_layer) {
    float* summed = final_scores == pooled ? scores : pooled;
    KVC_CUDA_RETURN_IF_ERROR(LaunchSumHeads(final_scores, hkv, s, summed, st), "sum heads");
    KVC_CUDA_RETURN_IF_ERROR(LaunchTopKPositions(summed, 1, s, b, plan.sink_end, plan.recent_begin,
                                                 arena.At<void>(o_topk), pos, st),
                             "top-k");
    for (int h = 1; h < hkv; ++h) {
      KVC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pos + static_cast<size_t>(h) * b, pos,
                                               sizeof(int32_t) * b, cudaMemcpyDeviceToDevice, st),
                               "broadcast per-layer selection");
    }
  } else {
    KVC_CUDA_RETURN_IF_ERROR(
        LaunchTopKPositions(final_scores, hkv, s, b, plan.sink_end, plan.recent_begin,
                            arena.At<void>(o_topk), pos, st),
        "top-k");
  }
  ChannelArgs ca;
  ca.dtype = et;
  ca.k = dk;
  ca.v = dv;
  ca.q = dq;
  ca.ks = kvs;
  ca.vs = kvs;
  ca.qs = qs;
  ca.num_kv_heads = hkv;
  ca.num_q_heads = hq;
  ca.seq_len = s;
  ca.head_dim = d;
  ca.obs_window = w;
  ca.positions = pos;
  ca.n_kept = b;
  ca.m = m;
  ca.key_policy = static_cast<int>(spec.channels.key_policy);
  ca.key_channels = plan.key_channels;
  ca.prune_values = spec.channels.prune_values;
  ca.value_channels = plan.value_channels;
  ca.scratch = arena.At<float>(o_cscratch);
  ca.key_idx = arena.At<int32_t>(o_kidx);
  ca.value_idx = arena.At<int32_t>(o_vidx);
  KVC_CUDA_RETURN_IF_ERROR(LaunchSelectChannels(ca, st), "channel selection");
  KVC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[2], st), "cudaEventRecord");

  // Stage 3: gather into the blob, then quantize the old blocks.
  PackArgs pa;
  pa.dtype = et;
  pa.k = dk;
  pa.v = dv;
  pa.ks = kvs;
  pa.vs = kvs;
  pa.num_kv_heads = hkv;
  pa.head_dim = d;
  pa.n_kept = b;
  pa.n_recent = plan.n_recent;
  pa.key_channels = plan.key_channels;
  pa.value_channels = plan.value_channels;
  pa.bits = KeyBits(spec.quant);
  pa.value_bits = ValueBits(spec.quant);
  pa.group = spec.quant.group_size;
  pa.positions = pos;
  pa.key_idx = ca.key_idx;
  pa.value_idx = ca.value_idx;
  pa.offsets = arena.At<HeadOffsets>(o_offsets);
  pa.scratch = arena.At<float>(o_pscratch);
  pa.blob = blob;
  KVC_CUDA_RETURN_IF_ERROR(LaunchPack(pa, st), "gather");
  KVC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[3], st), "cudaEventRecord");
  KVC_CUDA_RETURN_IF_ERROR(LaunchQuantize(pa, st), "quantize");
  KVC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[4], st), "cudaEventRecord");

  KVC_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(pinned, blob, plan.blob_bytes, cudaMemcpyDeviceToHost, st),
      "copy blob to host");
  KVC_CUDA_RETURN_IF_ERROR(cudaEventRecord(ev[5], st), "cudaEventRecord");
  KVC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st), "compress");

  CompactLayer out;
  // Sized without a zero-fill (ByteVector), then every byte is copied from the pinned blob.
  out.bytes.resize(plan.blob_bytes);
  std::memcpy(out.bytes.data(), pinned, plan.blob_bytes);
  const LayerHeader hdr = MakeLayerHeader(in, spec);
  std::memcpy(out.bytes.data(), &hdr, sizeof(hdr));
  std::memcpy(out.bytes.data() + sizeof(hdr), plan.descs.data(), sizeof(HeadDesc) * hkv);
  if (timings != nullptr) {
    float ms[5] = {};
    for (int i = 0; i < 5; ++i) cudaEventElapsedTime(&ms[i], ev[i], ev[i + 1]);
    timings->score = ms[0] * 1e-3;
    timings->select = ms[1] * 1e-3;
    timings->pack = ms[2] * 1e-3;
    timings->quantize = ms[3] * 1e-3;
    float total = 0;
    cudaEventElapsedTime(&total, ev[0], ev[5]);
    timings->total = total * 1e-3;
  }
  return out;
}

absl::Status ValidateQuery(const CompactLayerView& cache, const DecodeQuery& q) {
  const int hkv = cache.num_kv_heads();
  if (q.num_q_heads < 1 || q.num_q_heads % hkv != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query.num_q_heads: ", q.num_q_heads, " is not a positive multiple of num_kv_heads ", hkv));
  }
  if (q.n_q < 0) return absl::InvalidArgumentError(absl::StrCat("query.n_q: ", q.n_q, " < 0"));
  if (q.n_new < q.n_q) {
    return absl::InvalidArgumentError(
        absl::StrCat("query.n_new: ", q.n_new, " is less than n_q ", q.n_q));
  }
  if (q.n_q > 0 && q.q == nullptr) return absl::InvalidArgumentError("query.q: null pointer");
  if (q.n_new > 0 && (q.k_new == nullptr || q.v_new == nullptr)) {
    return absl::InvalidArgumentError("query.k_new/v_new: null pointer with n_new > 0");
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Attend(const CompactLayerView& cache, const DecodeQuery& query,
                                 float* out) {
  RETURN_IF_ERROR(ValidateQuery(cache, query));
  if (out == nullptr) return absl::InvalidArgumentError("out: null pointer");
  if (query.n_q == 0) return absl::OkStatus();
  return WithSlot(
      [&](StreamSlot* slot, Arena* arena) { return AttendOnSlot(cache, query, out, slot, arena); });
}

absl::Status CudaBackend::AttendOnSlot(const CompactLayerView& cache, const DecodeQuery& query,
                                       float* out, StreamSlot* slot, Arena* arena_ptr) {
  const int hkv = cache.num_kv_heads(), d = cache.head_dim(), hq = query.num_q_heads;
  const uint8_t* base = cache.blob().data();
  std::vector<AttnHead> heads(hkv);
  int max_kept = 0;
  auto rel = [base](const void* p) -> uint64_t {
    return p == nullptr ? 0 : static_cast<uint64_t>(static_cast<const uint8_t*>(p) - base);
  };
  for (int h = 0; h < hkv; ++h) {
    const CompactHead ch = cache.head(h);
    heads[h] =
        AttnHead{ch.n_kept,           ch.n_recent,         ch.key_channels,    ch.value_channels,
                 rel(ch.positions),   rel(ch.key_idx),     rel(ch.value_idx),  rel(ch.key_old),
                 rel(ch.key_scale),   rel(ch.key_zero),    rel(ch.key_codes),  rel(ch.key_recent),
                 rel(ch.value_old),   rel(ch.value_scale), rel(ch.value_zero), rel(ch.value_codes),
                 rel(ch.value_recent)};
    max_kept = std::max(max_kept, ch.n_kept);
  }
  const size_t blob_bytes = cache.blob().size();
  const size_t q_bytes = sizeof(float) * static_cast<size_t>(hq) * query.n_q * d;
  const size_t new_bytes = sizeof(float) * static_cast<size_t>(hkv) * query.n_new * d;
  Arena& arena = *arena_ptr;
  const size_t o_blob = arena.Add(blob_bytes);
  const size_t o_q = arena.Add(q_bytes);
  const size_t o_kn = arena.Add(new_bytes);
  const size_t o_vn = arena.Add(new_bytes);
  const size_t o_heads = arena.Add(sizeof(AttnHead) * hkv);
  // The split kernel where the shape allows it (cuda/decode_plan.h), else the generic one.
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, pool_->device());
  const DecodePlan plan = PlanDecode(
      DecodeShape{static_cast<ElemType>(cache.dtype()), hkv, hq, d, cache.key_bits(),
                  cache.header().quant_group, query.n_q, query.n_new, 1, cache.value_bits()},
      heads, sms);
  const size_t o_seq = arena.Add(plan.split ? sizeof(DecodeSeq) : 0);
  const size_t o_scratch = arena.Add(
      sizeof(float) *
      (plan.split ? plan.partial_floats : AttnScratchFloats(hq, query.n_q, max_kept, query.n_new)));
  const size_t o_out = arena.Add(q_bytes);
  // Inputs are staged contiguously in the pinned buffer with the arena's offsets.
  const size_t staged = o_scratch;
  RETURN_IF_ERROR(slot->ReservePinned(std::max(staged, q_bytes)));
  uint8_t* pinned = static_cast<uint8_t*>(slot->pinned);
  std::memcpy(pinned + o_blob, base, blob_bytes);
  std::memcpy(pinned + o_q, query.q, q_bytes);
  if (new_bytes > 0) {
    std::memcpy(pinned + o_kn, query.k_new, new_bytes);
    std::memcpy(pinned + o_vn, query.v_new, new_bytes);
  }
  std::memcpy(pinned + o_heads, heads.data(), sizeof(AttnHead) * hkv);
  cudaStream_t st = slot->stream;
  RETURN_IF_ERROR(arena.Allocate(pool_->mem_pool(), st));  // WithSlot frees it
  if (plan.split) {
    DecodeSeq seq;
    seq.blob = arena.At<uint8_t>(o_blob);
    seq.heads = arena.At<AttnHead>(o_heads);
    seq.q = arena.At<float>(o_q);
    seq.k_new = arena.At<float>(o_kn);
    seq.v_new = arena.At<float>(o_vn);
    seq.out = arena.At<float>(o_out);
    std::memcpy(pinned + o_seq, &seq, sizeof(seq));
  }
  KVC_CUDA_RETURN_IF_ERROR(
      cudaMemcpyAsync(arena.At<uint8_t>(0), pinned, staged, cudaMemcpyHostToDevice, st),
      "copy attention inputs to device");
  AttnArgs a;
  a.dtype = static_cast<ElemType>(cache.dtype());
  a.blob = arena.At<uint8_t>(o_blob);
  a.heads = arena.At<AttnHead>(o_heads);
  a.num_kv_heads = hkv;
  a.num_q_heads = hq;
  a.head_dim = d;
  a.bits = cache.key_bits();
  a.value_bits = cache.value_bits();
  a.group = cache.header().quant_group;
  a.max_kept = max_kept;
  a.n_q = query.n_q;
  a.n_new = query.n_new;
  a.q = arena.At<float>(o_q);
  a.k_new = arena.At<float>(o_kn);
  a.v_new = arena.At<float>(o_vn);
  a.scratch = arena.At<float>(o_scratch);
  a.out = arena.At<float>(o_out);
  if (plan.split) {
    DecodeArgs da;
    da.dtype = a.dtype;
    da.num_kv_heads = hkv;
    da.num_q_heads = hq;
    da.head_dim = d;
    da.bits = a.bits;
    da.group = a.group;
    da.n_q = query.n_q;
    da.n_new = query.n_new;
    da.batch = 1;
    da.seqs = arena.At<DecodeSeq>(o_seq);
    da.row_tile = plan.row_tile;
    da.chunk = plan.chunk;
    da.max_chunks = plan.max_chunks;
    da.partial = a.scratch;
    KVC_CUDA_RETURN_IF_ERROR(LaunchDecodeAttention(da, st), "packed attention (split)");
  } else {
    KVC_CUDA_RETURN_IF_ERROR(LaunchPackedAttention(a, st), "packed attention");
  }
  KVC_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(pinned, a.out, q_bytes, cudaMemcpyDeviceToHost, st),
                           "copy attention output to host");
  KVC_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(st), "attention");
  std::memcpy(out, pinned, q_bytes);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Backend>> CreateCudaBackendImpl(const BackendOptions& options,
                                                               const HostFallback* host) {
  std::string why;
  if (!DeviceAvailable(&why)) {
    return absl::UnavailableError(absl::StrCat("cuda backend unavailable: ", why));
  }
  int count = 0;
  KVC_CUDA_RETURN_IF_ERROR(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (options.device < 0 || options.device >= count) {
    return absl::UnavailableError(absl::StrCat("cuda backend unavailable: device ", options.device,
                                               " is not in [0, ", count, ")"));
  }
  cudaDeviceProp prop = {};
  KVC_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, options.device),
                           "cudaGetDeviceProperties");
  if (prop.major < 8) {
    return absl::UnavailableError(absl::StrCat("cuda backend unavailable: ", prop.name, " is sm_",
                                               prop.major, prop.minor,
                                               "; kvc is built for sm_80 and newer"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<SlotPool> pool, SlotPool::Create(options.device, kNumStreams));
  return std::unique_ptr<Backend>(new CudaBackend(
      std::move(pool), absl::StrCat("cuda: ", prop.name, " (sm_", prop.major, prop.minor, ")"),
      host));
}

}  // namespace kvc::cuda

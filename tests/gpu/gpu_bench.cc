// GPU benchmark: device-to-device memcpy bandwidth measured in the same run, next to the CUDA
// backend's per-stage throughput and per-layer latency on a Llama-3-8B-shaped layer (8 KV heads,
// 32 query heads, head_dim 128, 32K tokens, fp16, W = 32). Stage times come from CUDA events
// (CompressTimings); "wall" also includes host staging and the host<->device copies.
//
// Decode rows (4K and 32K tokens, batch 1 and 8, one new token per sequence): packed attention
// over the compact layer (the split kernel, cuda/decode_plan.h) for several specs, against the
// same run's baselines: a D2D memcpy of the dense K+V, the dense kernel (the split kernel over the
// full fp16 rows), and a cuBLAS formulation (GEMM, softmax, GEMM; loaded with dlopen, left out
// with the reason when libcublas.so.13 is not found). L2 is flushed before every timed run. Each
// packed row is checked against the CPU backend's Attend over the same blob.
// Compress rows run twice: with the layer in host memory and with it already in device memory
// (LayerInput::memory = kDevice, "[dev]").
// Usage: kvc_gpu_bench [--seq_len=N] [--iters=N] [--decode=0]. Exits 77 without a CUDA device.
#include <cublas_v2.h>  // declares the API (cublas_api.h alone needs CUBLASAPI defined)
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "bench_kernels.h"
#include "cuda/decode_plan.h"
#include "cuda/kernels.h"
#include "gpu_util.h"
#include "kvc/backend.h"
#include "kvc/compact.h"
#include "kvc/gpu_memory.h"

namespace kvc {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

// Bytes copied per second by cudaMemcpyAsync device-to-device (each byte is read and written).
double MemcpyGBps(size_t bytes, int iters) {
  void *a = nullptr, *b = nullptr;
  if (cudaMalloc(&a, bytes) != cudaSuccess || cudaMalloc(&b, bytes) != cudaSuccess) return 0;
  cudaMemset(a, 1, bytes);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e0);
  for (int i = 0; i < iters; ++i) cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice);
  cudaEventRecord(e1);
  cudaEventSynchronize(e1);
  float ms = 0;
  cudaEventElapsedTime(&ms, e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(a);
  cudaFree(b);
  return static_cast<double>(bytes) * iters / (ms * 1e-3) / 1e9;
}

struct Config {
  const char* name;
  CompressionSpec spec;
};
// ---- decode attention rows ----

// A device allocation freed on scope exit.
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) {
    if (cudaMalloc(&p, std::max<size_t>(bytes, 256)) != cudaSuccess) p = nullptr;
  }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

// Median device time of `op` over `iters` runs (one warm-up); L2 is flushed before each run by
// writing `flush` (larger than any L2), so every figure is an HBM figure.
template <typename Op>
double TimeDevice(Op op, int iters, const DeviceBuffer& flush, size_t flush_bytes) {
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  std::vector<double> t;
  bool ok = true;
  for (int i = 0; i <= iters && ok; ++i) {
    cudaMemsetAsync(flush.p, i & 0xff, flush_bytes);
    cudaEventRecord(e0);
    ok = op();
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    if (i > 0) t.push_back(ms * 1e-3);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return ok ? Median(t) : -1.0;
}

// cuBLAS, loaded at run time: the toolkit's libcublas is not part of gpu-libs (about 600 MiB with
// libcublasLt). When it cannot be loaded the cuBLAS baseline says why and is left out.
struct Cublas {
  void* lib = nullptr;
  cublasHandle_t handle = nullptr;
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  // The C entry point (the header also declares a C++ overload taking cudaDataType compute).
  using GemmFn = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int,
                                    int, const void*, const void*, cudaDataType, int, long long,
                                    const void*, cudaDataType, int, long long, const void*, void*,
                                    cudaDataType, int, long long, int, cublasComputeType_t,
                                    cublasGemmAlgo_t);
  GemmFn gemm = nullptr;
  std::string why;

  Cublas() {
    for (const char* name : {"libcublas.so.13", "libcublas.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib != nullptr) break;
    }
    if (lib == nullptr) {
      const char* e = dlerror();
      why = std::string("cannot load libcublas.so.13: ") + (e != nullptr ? e : "?");
      return;
    }
    create = reinterpret_cast<decltype(create)>(dlsym(lib, "cublasCreate_v2"));
    destroy = reinterpret_cast<decltype(destroy)>(dlsym(lib, "cublasDestroy_v2"));
    gemm = reinterpret_cast<decltype(gemm)>(dlsym(lib, "cublasGemmStridedBatchedEx"));
    if (create == nullptr || destroy == nullptr || gemm == nullptr) {
      why = "libcublas lacks cublasCreate_v2/cublasGemmStridedBatchedEx";
      return;
    }
    if (create(&handle) != CUBLAS_STATUS_SUCCESS) {
      handle = nullptr;
      why = "cublasCreate failed";
    }
  }
  ~Cublas() {
    if (handle != nullptr) destroy(handle);
  }
  bool ok() const { return handle != nullptr; }
};

// The CUDA backend's description of a parsed blob: byte offsets of each head's blocks.
std::vector<cuda::AttnHead> HeadsOf(const CompactLayerView& v) {
  const uint8_t* base = v.blob().data();
  auto rel = [base](const void* p) -> uint64_t {
    return p == nullptr ? 0 : static_cast<uint64_t>(static_cast<const uint8_t*>(p) - base);
  };
  std::vector<cuda::AttnHead> heads;
  for (int h = 0; h < v.num_kv_heads(); ++h) {
    const CompactHead c = v.head(h);
    heads.push_back({c.n_kept, c.n_recent, c.key_channels, c.value_channels, rel(c.positions),
                     rel(c.key_idx), rel(c.value_idx), rel(c.key_old), rel(c.key_scale),
                     rel(c.key_zero), rel(c.key_codes), rel(c.key_recent), rel(c.value_old),
                     rel(c.value_scale), rel(c.value_zero), rel(c.value_codes),
                     rel(c.value_recent)});
  }
  return heads;
}

// One batch of sequences for the split kernel: per-sequence blobs and heads on the device.
struct DeviceBatch {
  std::vector<std::unique_ptr<DeviceBuffer>> blobs;
  std::unique_ptr<DeviceBuffer> heads, seqs, partial;
  cuda::DecodeArgs args;
  cuda::DecodePlan plan;
  uint64_t read_bytes = 0;  // per decode step, whole batch
};

struct DecodeIo {  // queries, new tokens and outputs of the batch, fp32 (the DecodeQuery form)
  int batch = 0, hq = 0, hkv = 0, d = 0;
  std::vector<float> q, k_new, v_new;  // host copies: [batch][H][1][D]
  std::unique_ptr<DeviceBuffer> dq, dk, dv, dout;
  size_t q_floats() const { return static_cast<size_t>(hq) * d; }
  size_t kv_floats() const { return static_cast<size_t>(hkv) * d; }
};

DecodeIo MakeIo(int batch, int hq, int hkv, int d, uint64_t seed) {
  DecodeIo io;
  io.batch = batch;
  io.hq = hq;
  io.hkv = hkv;
  io.d = d;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  io.q.resize(batch * io.q_floats());
  io.k_new.resize(batch * io.kv_floats());
  io.v_new.resize(io.k_new.size());
  for (float& x : io.q) x = u(rng);
  for (float& x : io.k_new) x = u(rng);
  for (float& x : io.v_new) x = u(rng);
  io.dq = std::make_unique<DeviceBuffer>(io.q.size() * 4);
  io.dk = std::make_unique<DeviceBuffer>(io.k_new.size() * 4);
  io.dv = std::make_unique<DeviceBuffer>(io.v_new.size() * 4);
  io.dout = std::make_unique<DeviceBuffer>(io.q.size() * 4);
  cudaMemcpy(io.dq->p, io.q.data(), io.q.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(io.dk->p, io.k_new.data(), io.k_new.size() * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(io.dv->p, io.v_new.data(), io.v_new.size() * 4, cudaMemcpyHostToDevice);
  return io;
}

// Uploads `blob_bytes` (one blob shared by every sequence, or one per sequence) with `heads`
// (per sequence, [Hkv]) and plans the split launch. heads_of(b) gives sequence b's heads.
bool MakeBatch(const DecodeIo& io, const std::vector<const uint8_t*>& host_blobs, size_t blob_bytes,
               const std::vector<std::vector<cuda::AttnHead>>& heads, int bits, int group, int sms,
               DeviceBatch* out, std::string* why) {
  const int batch = io.batch, hkv = io.hkv;
  std::vector<cuda::AttnHead> all;
  for (int b = 0; b < batch; ++b) all.insert(all.end(), heads[b].begin(), heads[b].end());
  out->plan = cuda::PlanDecode(
      {cuda::ElemType::kF16, hkv, io.hq, io.d, bits, group, /*n_q=*/1, /*n_new=*/1, batch}, all,
      sms);
  if (!out->plan.split) {
    *why = "the split kernel does not take this shape: " + out->plan.why_not;
    return false;
  }
  std::vector<cuda::DecodeSeq> seqs(batch);
  for (int b = 0; b < batch; ++b) {
    out->blobs.push_back(std::make_unique<DeviceBuffer>(blob_bytes));
    if (out->blobs.back()->p == nullptr) {
      *why = "out of device memory";
      return false;
    }
    cudaMemcpy(out->blobs.back()->p, host_blobs[b], blob_bytes, cudaMemcpyHostToDevice);
  }
  out->heads = std::make_unique<DeviceBuffer>(sizeof(cuda::AttnHead) * all.size());
  cudaMemcpy(out->heads->p, all.data(), sizeof(cuda::AttnHead) * all.size(),
             cudaMemcpyHostToDevice);
  for (int b = 0; b < batch; ++b) {
    seqs[b].blob = out->blobs[b]->as<uint8_t>();
    seqs[b].heads = out->heads->as<cuda::AttnHead>() + static_cast<size_t>(b) * hkv;
    seqs[b].q = io.dq->as<float>() + b * io.q_floats();
    seqs[b].k_new = io.dk->as<float>() + b * io.kv_floats();
    seqs[b].v_new = io.dv->as<float>() + b * io.kv_floats();
    seqs[b].out = io.dout->as<float>() + b * io.q_floats();
  }
  out->seqs = std::make_unique<DeviceBuffer>(sizeof(cuda::DecodeSeq) * batch);
  cudaMemcpy(out->seqs->p, seqs.data(), sizeof(cuda::DecodeSeq) * batch, cudaMemcpyHostToDevice);
  out->partial = std::make_unique<DeviceBuffer>(sizeof(float) * out->plan.partial_floats);
  cuda::DecodeArgs& a = out->args;
  a.dtype = cuda::ElemType::kF16;
  a.num_kv_heads = hkv;
  a.num_q_heads = io.hq;
  a.head_dim = io.d;
  a.bits = bits;
  a.group = group;
  a.n_q = 1;
  a.n_new = 1;
  a.batch = batch;
  a.seqs = out->seqs->as<cuda::DecodeSeq>();
  a.row_tile = out->plan.row_tile;
  a.chunk = out->plan.chunk;
  a.max_chunks = out->plan.max_chunks;
  a.partial = out->partial->as<float>();
  for (const cuda::AttnHead& h : all) {
    out->read_bytes += cuda::PackedHeadReadBytes(h, io.d, 2, bits, group);
  }
  return true;
}

// Largest |a - b| relative to 1 + |a| over the batch's outputs, against the CPU backend's Attend
// over the same blob for sequence 0 (all sequences hold the same layer and differ in queries).
double CheckAgainstCpu(Backend& cpu, const CompactLayerView& view, const DecodeIo& io,
                       std::string* why) {
  std::vector<float> got(io.q.size());
  cudaMemcpy(got.data(), io.dout->p, got.size() * 4, cudaMemcpyDeviceToHost);
  double worst = 0;
  for (int b = 0; b < std::min(io.batch, 2); ++b) {
    DecodeQuery q;
    q.num_q_heads = io.hq;
    q.n_q = 1;
    q.n_new = 1;
    q.q = io.q.data() + b * io.q_floats();
    q.k_new = io.k_new.data() + b * io.kv_floats();
    q.v_new = io.v_new.data() + b * io.kv_floats();
    std::vector<float> want(io.q_floats());
    const absl::Status st = cpu.Attend(view, q, want.data());
    if (!st.ok()) {
      *why = std::string(st.message());
      return -1;
    }
    for (size_t i = 0; i < want.size(); ++i) {
      const double e = std::fabs(want[i] - got[b * io.q_floats() + i]) / (1.0 + std::fabs(want[i]));
      if (!(e <= worst)) worst = e;  // NaN propagates as the worst
    }
  }
  return worst;
}

struct DecodeSpec {
  const char* label;
  CompressionSpec spec;
};

std::vector<DecodeSpec> DecodeSpecs() {
  std::vector<DecodeSpec> v;
  auto add = [&](const char* label, double keep, bool think, int bits) {
    DecodeSpec s{label, {}};
    s.spec.eviction.policy = keep < 1.0 ? EvictionPolicy::kSnapKV : EvictionPolicy::kNone;
    s.spec.eviction.keep_ratio = keep;
    s.spec.channels.key_policy = think ? ChannelPolicy::kThink : ChannelPolicy::kNone;
    s.spec.channels.key_lambda = think ? 0.5 : 0.0;
    s.spec.quant.bits = bits;
    v.push_back(s);
  };
  add("full (keep 1.0)", 1.0, false, 0);
  add("snapkv:0.5", 0.5, false, 0);
  add("snapkv:0.25", 0.25, false, 0);
  add("snapkv:0.25+think:0.5", 0.25, true, 0);
  add("snapkv:0.25+think:0.5+q4", 0.25, true, 4);
  add("snapkv:0.25+think:0.5+q2", 0.25, true, 2);
  return v;
}

// Decode rows for one (seq_len, batch): every figure is printed next to its same-run baseline.
// Returns false when a check fails (a kernel error, or an output that disagrees with the CPU).
bool DecodeRows(Backend& gpu, Backend& cpu, const gpu_testing::Layer& layer, int batch, int iters,
                int sms, double memcpy_rw_gbs, Cublas& cublas) {
  const LayerShape& sh = layer.shape;
  const int hkv = sh.num_kv_heads, hq = sh.num_q_heads, s = sh.seq_len, d = sh.head_dim;
  const int g = hq / hkv;
  const size_t flush_bytes = size_t{512} << 20;
  DeviceBuffer flush(flush_bytes);
  const DecodeIo io = MakeIo(batch, hq, hkv, d, 7 + batch);
  const size_t head_elems = static_cast<size_t>(s) * d;
  const size_t kv_bytes = static_cast<size_t>(batch) * hkv * head_elems * 2;  // K (or V), fp16
  std::printf(
      "\n-- decode: S %d, batch %d: one new token per sequence, Hq %d, Hkv %d, D %d, "
      "fp16; dense K+V %.1f MiB per step --\n",
      s, batch, hq, hkv, d, 2.0 * kv_bytes / 1048576.0);

  // Dense K and V of every sequence, [batch][Hkv][S][D], behind a 256-byte header holding the
  // identity channel list: the dense kernel is the split kernel over these rows as one
  // "keep everything" blob.
  const size_t hdr = 256;
  DeviceBuffer dense(hdr + 2 * kv_bytes);
  DeviceBuffer copy_dst(2 * kv_bytes);
  if (dense.p == nullptr || copy_dst.p == nullptr || flush.p == nullptr) {
    std::printf("skipped: not enough device memory\n");
    return true;
  }
  std::vector<int32_t> ident(d);
  for (int c = 0; c < d; ++c) ident[c] = c;
  cudaMemcpy(dense.p, ident.data(), 4 * d, cudaMemcpyHostToDevice);
  for (int b = 0; b < batch; ++b) {
    const size_t one = static_cast<size_t>(hkv) * head_elems * 2;
    cudaMemcpy(dense.as<uint8_t>() + hdr + b * one, layer.k.data(), one, cudaMemcpyHostToDevice);
    cudaMemcpy(dense.as<uint8_t>() + hdr + kv_bytes + b * one, layer.v.data(), one,
               cudaMemcpyHostToDevice);
  }
  // Memcpy baseline: the dense K+V bytes copied device to device.
  const double t_copy = TimeDevice(
      [&] {
        return cudaMemcpyAsync(copy_dst.p, dense.as<uint8_t>() + hdr, 2 * kv_bytes,
                               cudaMemcpyDeviceToDevice) == cudaSuccess;
      },
      iters, flush, flush_bytes);
  const double copy_rw_gbs = 2.0 * 2 * kv_bytes / t_copy / 1e9;

  // Dense baseline 1: the split kernel over the dense rows.
  std::vector<std::vector<cuda::AttnHead>> dense_heads(batch, std::vector<cuda::AttnHead>(hkv));
  std::vector<const uint8_t*> dummy(batch, nullptr);
  for (int b = 0; b < batch; ++b) {
    for (int h = 0; h < hkv; ++h) {
      cuda::AttnHead& x = dense_heads[b][h];
      x = {};
      x.n_kept = s;
      x.key_channels = x.value_channels = d;
      const uint64_t rows = hdr + (static_cast<uint64_t>(b) * hkv + h) * head_elems * 2;
      x.key_old = rows;
      x.value_old = rows + kv_bytes;
    }
  }
  DeviceBatch dense_batch;
  {
    std::vector<cuda::AttnHead> all;
    for (auto& v : dense_heads) all.insert(all.end(), v.begin(), v.end());
    dense_batch.plan =
        cuda::PlanDecode({cuda::ElemType::kF16, hkv, hq, d, 0, 0, 1, 1, batch}, all, sms);
    if (!dense_batch.plan.split) {
      std::printf("dense kernel unavailable: %s\n", dense_batch.plan.why_not.c_str());
      return false;
    }
    std::vector<cuda::DecodeSeq> seqs(batch);
    dense_batch.heads = std::make_unique<DeviceBuffer>(sizeof(cuda::AttnHead) * all.size());
    cudaMemcpy(dense_batch.heads->p, all.data(), sizeof(cuda::AttnHead) * all.size(),
               cudaMemcpyHostToDevice);
    for (int b = 0; b < batch; ++b) {
      seqs[b] = {dense.as<uint8_t>(),
                 dense_batch.heads->as<cuda::AttnHead>() + b * hkv,
                 io.dq->as<float>() + b * io.q_floats(),
                 io.dk->as<float>() + b * io.kv_floats(),
                 io.dv->as<float>() + b * io.kv_floats(),
                 io.dout->as<float>() + b * io.q_floats()};
    }
    dense_batch.seqs = std::make_unique<DeviceBuffer>(sizeof(cuda::DecodeSeq) * batch);
    cudaMemcpy(dense_batch.seqs->p, seqs.data(), sizeof(cuda::DecodeSeq) * batch,
               cudaMemcpyHostToDevice);
    dense_batch.partial =
        std::make_unique<DeviceBuffer>(sizeof(float) * dense_batch.plan.partial_floats);
    cuda::DecodeArgs& a = dense_batch.args;
    a.dtype = cuda::ElemType::kF16;
    a.num_kv_heads = hkv;
    a.num_q_heads = hq;
    a.head_dim = d;
    a.n_q = a.n_new = 1;
    a.batch = batch;
    a.seqs = dense_batch.seqs->as<cuda::DecodeSeq>();
    a.row_tile = dense_batch.plan.row_tile;
    a.chunk = dense_batch.plan.chunk;
    a.max_chunks = dense_batch.plan.max_chunks;
    a.partial = dense_batch.partial->as<float>();
  }
  const double dense_bytes = 2.0 * kv_bytes;
  const double t_dense = TimeDevice(
      [&] { return cuda::LaunchDecodeAttention(dense_batch.args, nullptr) == cudaSuccess; }, iters,
      flush, flush_bytes);
  if (t_dense < 0) {
    std::printf("dense kernel failed: %s\n", cudaGetErrorString(cudaGetLastError()));
    return false;
  }
  std::vector<float> dense_out(io.q.size());
  cudaMemcpy(dense_out.data(), io.dout->p, dense_out.size() * 4, cudaMemcpyDeviceToHost);

  // Dense baseline 2: cuBLAS. Per (sequence, KV head): scores = K Q^T (S x g, fp32 out), softmax
  // to fp16, out = V^T P (D x g). The cache only; the new token is left out (1 of S keys).
  double t_blas = -1;
  std::string blas_note = cublas.why;
  if (cublas.ok()) {
    const int items = batch * hkv;
    DeviceBuffer qh(sizeof(uint16_t) * io.q.size());
    DeviceBuffer sc(sizeof(float) * static_cast<size_t>(items) * g * s);
    DeviceBuffer ph(sizeof(uint16_t) * static_cast<size_t>(items) * g * s);
    DeviceBuffer out(sizeof(float) * io.q.size());
    std::vector<uint8_t> qhost(2 * io.q.size());
    for (size_t i = 0; i < io.q.size(); ++i) StoreFromFloat(qhost.data(), DType::kF16, i, io.q[i]);
    cudaMemcpy(qh.p, qhost.data(), qhost.size(), cudaMemcpyHostToDevice);
    const float alpha = 1.0f / std::sqrt(static_cast<float>(d)), one = 1.0f, zero = 0.0f;
    const uint8_t* kbase = dense.as<uint8_t>() + hdr;
    auto step = [&] {
      if (cublas.gemm(cublas.handle, CUBLAS_OP_T, CUBLAS_OP_N, s, g, d, &alpha, kbase, CUDA_R_16F,
                      d, static_cast<long long>(head_elems), qh.p, CUDA_R_16F, d,
                      static_cast<long long>(g) * d, &zero, sc.p, CUDA_R_32F, s,
                      static_cast<long long>(g) * s, items, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
        return false;
      }
      if (gpu_testing::LaunchSoftmaxToHalf(sc.as<float>(), items * g, s, ph.p, nullptr) !=
          cudaSuccess) {
        return false;
      }
      return cublas.gemm(cublas.handle, CUBLAS_OP_N, CUBLAS_OP_N, d, g, s, &one, kbase + kv_bytes,
                         CUDA_R_16F, d, static_cast<long long>(head_elems), ph.p, CUDA_R_16F, s,
                         static_cast<long long>(g) * s, &zero, out.p, CUDA_R_32F, d,
                         static_cast<long long>(g) * d, items, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS;
    };
    t_blas = TimeDevice(step, iters, flush, flush_bytes);
    if (t_blas < 0) blas_note = "a cuBLAS call failed";
  }

  std::printf(
      "baselines (same run): memcpy D2D of the dense K+V %.3f ms = %.1f GB/s read+write "
      "(%.0f%% of the 1 GiB memcpy's); dense kernel %.3f ms",
      t_copy * 1e3, copy_rw_gbs, 100.0 * copy_rw_gbs / memcpy_rw_gbs, t_dense * 1e3);
  if (t_blas > 0) {
    std::printf("; cuBLAS %.3f ms (dense kernel = %.2fx cuBLAS speed)\n", t_blas * 1e3,
                t_blas / t_dense);
  } else {
    std::printf("; cuBLAS baseline not run: %s\n", blas_note.c_str());
  }
  std::printf("%-26s %9s %9s %9s %8s %7s %8s %8s %8s %9s\n", "config", "step_us", "MB/token",
              "GB/s", "%memcpy", "bytes/", "x_dense", "x_cublas", "x/bytes", "max_err");
  std::printf("%-26s %9.1f %9.3f %9.1f %7.0f%% %7.2f %8.2f %8s %8s %9s\n", "dense kernel",
              t_dense * 1e6, dense_bytes / batch / 1e6, dense_bytes / t_dense / 1e9,
              100.0 * (dense_bytes / t_dense / 1e9) / copy_rw_gbs, 1.0, 1.0,
              t_blas > 0 ? absl::StrFormat("%.2f", t_blas / t_dense).c_str() : "-", "1.00", "-");

  bool ok = true;
  for (const DecodeSpec& ds : DecodeSpecs()) {
    const absl::StatusOr<CompactLayer> c = gpu.Compress(layer.input(), ds.spec, nullptr);
    if (!c.ok()) {
      std::printf("%-26s compress failed: %s\n", ds.label,
                  std::string(c.status().message()).c_str());
      ok = false;
      continue;
    }
    const absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(c->bytes);
    if (!view.ok()) {
      std::printf("%-26s bad blob: %s\n", ds.label, std::string(view.status().message()).c_str());
      ok = false;
      continue;
    }
    const std::vector<cuda::AttnHead> heads = HeadsOf(*view);
    DeviceBatch db;
    std::string why;
    if (!MakeBatch(io, std::vector<const uint8_t*>(batch, c->bytes.data()), c->bytes.size(),
                   std::vector<std::vector<cuda::AttnHead>>(batch, heads),
                   view->header().quant_bits, view->header().quant_group, sms, &db, &why)) {
      std::printf("%-26s not run: %s\n", ds.label, why.c_str());
      continue;
    }
    cudaMemset(io.dout->p, 0xff, io.q.size() * 4);  // NaN until written
    const double t =
        TimeDevice([&] { return cuda::LaunchDecodeAttention(db.args, nullptr) == cudaSuccess; },
                   iters, flush, flush_bytes);
    if (t < 0) {
      std::printf("%-26s kernel failed: %s\n", ds.label, cudaGetErrorString(cudaGetLastError()));
      ok = false;
      continue;
    }
    const double err = CheckAgainstCpu(cpu, *view, io, &why);
    if (ds.spec.eviction.policy == EvictionPolicy::kNone) {
      // Same tokens as the dense kernel's: the outputs agree up to summation order.
      std::vector<float> got(io.q.size());
      cudaMemcpy(got.data(), io.dout->p, got.size() * 4, cudaMemcpyDeviceToHost);
      double diff = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        diff = std::max(diff, static_cast<double>(std::fabs(got[i] - dense_out[i])));
      }
      std::printf("(dense kernel vs the keep-1.0 blob: max |difference| %.1e%s)\n", diff,
                  diff > 1e-4 ? "  CHECK FAILED" : "");
      if (!(diff <= 1e-4)) ok = false;
    }
    const double bytes = static_cast<double>(db.read_bytes);
    const double gbs = bytes / t / 1e9;
    const double bytes_ratio = dense_bytes / bytes;
    std::printf("%-26s %9.1f %9.3f %9.1f %7.0f%% %7.2f %8.2f %8s %8.2f %9.1e%s\n", ds.label,
                t * 1e6, bytes / batch / 1e6, gbs, 100.0 * gbs / copy_rw_gbs, bytes_ratio,
                t_dense / t, t_blas > 0 ? absl::StrFormat("%.2f", t_blas / t).c_str() : "-",
                (t_dense / t) / bytes_ratio, err, err < 0 || err > 2e-3 ? "  CHECK FAILED" : "");
    if (err < 0 || err > 2e-3) ok = false;
  }
  return ok;
}

int Run(int seq_len, int iters, bool decode) {
  std::string why;
  cudaDeviceProp prop = {};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("device: %s (sm_%d%d), %.1f GiB\n", prop.name, prop.major, prop.minor,
              prop.totalGlobalMem / 1073741824.0);
  const double copy = MemcpyGBps(size_t{1} << 30, 10);
  std::printf("d2d memcpy: %.1f GB/s copied (%.1f GB/s read+write)\n", copy, 2 * copy);

  const LayerShape shape{8, 32, seq_len, 128, 32};
  const gpu_testing::Layer layer = gpu_testing::RandomLayer(shape, DType::kF16, Layout::kHND, 42);
  auto backend = CreateCudaBackend({});
  if (!backend.ok()) {
    std::printf("error: %s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  std::printf("backend: %s\n", (*backend)->description().c_str());
  const double kv_bytes = 2.0 * shape.num_kv_heads * seq_len * shape.head_dim * 2;
  const double k_bytes = kv_bytes / 2;

  std::vector<Config> configs;
  auto add = [&](const char* name, EvictionPolicy p, double ratio, ChannelPolicy cp, int bits) {
    Config c{name, {}};
    c.spec.eviction.policy = p;
    c.spec.eviction.keep_ratio = ratio;
    c.spec.channels.key_policy = cp;
    c.spec.channels.key_lambda = cp == ChannelPolicy::kNone ? 0.0 : 0.5;
    c.spec.quant.bits = bits;
    configs.push_back(c);
  };
  add("streaming 10%", EvictionPolicy::kStreaming, 0.1, ChannelPolicy::kNone, 0);
  add("snapkv 10%", EvictionPolicy::kSnapKV, 0.1, ChannelPolicy::kNone, 0);
  add("snapkv 25% + think 0.5 + 4-bit", EvictionPolicy::kSnapKV, 0.25, ChannelPolicy::kThink, 4);
  add("h2o 10%", EvictionPolicy::kH2O, 0.1, ChannelPolicy::kNone, 0);
  add("keyformer 10%", EvictionPolicy::kKeyformer, 0.1, ChannelPolicy::kNone, 0);
  add("knorm 10%", EvictionPolicy::kKNorm, 0.1, ChannelPolicy::kNone, 0);
  // Issue 13's compression goal: under 0.5 ms of device time at 32K tokens on an H200.
  add("keyformer 25% + think 0.5 + 4-bit", EvictionPolicy::kKeyformer, 0.25, ChannelPolicy::kThink,
      4);

  // The memcpy baseline of a Compress: K and V of the layer copied device to device.
  double kv_copy_s = 0;
  {
    const size_t flush_bytes = size_t{512} << 20;
    DeviceBuffer flush(flush_bytes), src(static_cast<size_t>(kv_bytes)),
        dst(static_cast<size_t>(kv_bytes));
    if (flush.p != nullptr && src.p != nullptr && dst.p != nullptr) {
      kv_copy_s = TimeDevice(
          [&] {
            return cudaMemcpyAsync(dst.p, src.p, static_cast<size_t>(kv_bytes),
                                   cudaMemcpyDeviceToDevice) == cudaSuccess;
          },
          iters, flush, flush_bytes);
    }
  }

  std::printf("layer: Hkv 8, Hq 32, D 128, S %d, fp16, W 32; K+V %.1f MiB; median of %d\n", seq_len,
              kv_bytes / 1048576.0, iters);
  std::printf("memcpy D2D of the layer's K+V (%.1f MiB): %.3f ms (the x_memcpy baseline)\n",
              kv_bytes / 1048576.0, kv_copy_s * 1e3);
  std::printf("%-40s %9s %9s %9s %9s %9s %9s %10s %10s %9s %9s\n", "config", "score_ms",
              "select_ms", "pack_ms", "quant_ms", "device_ms", "wall_ms", "score_GB/s", "pack_GB/s",
              "kernel_ms", "x_memcpy");
  // Each config twice: the layer in host memory (staged through pinned memory and copied in),
  // then already on the device ("[dev]": what an NCCL receive or the engine itself hands over;
  // no host copy of K/V at all, so wall_ms approaches device_ms).
  const gpu_testing::DeviceLayer dev_layer(layer);
  if (!dev_layer.ok()) {
    std::printf("device copy of the layer failed: %s\n", dev_layer.error().c_str());
  }
  for (int on_device = 0; on_device < (dev_layer.ok() ? 2 : 1); ++on_device) {
    for (const Config& c : configs) {
      std::vector<double> sc, se, pa, qu, to, wall;
      size_t blob = 0;
      const LayerInput input = on_device ? dev_layer.input() : layer.input();
      const std::string label = on_device ? std::string(c.name) + " [dev]" : std::string(c.name);
      for (int i = 0; i < iters + 2; ++i) {
        CompressTimings t;
        const auto w0 = std::chrono::steady_clock::now();
        absl::StatusOr<CompactLayer> r = (*backend)->Compress(input, c.spec, &t);
        const double wl =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - w0).count();
        if (!r.ok()) {
          std::printf("%s: %s\n", c.name, std::string(r.status().message()).c_str());
          return 1;
        }
        blob = r->bytes.size();
        if (i < 2) continue;  // warm-up: pool growth, pinned staging growth
        sc.push_back(t.score);
        se.push_back(t.select);
        pa.push_back(t.pack);
        qu.push_back(t.quantize);
        to.push_back(t.total);
        wall.push_back(wl);
      }
      // Score reads K (and the small Q_obs); pack reads the kept rows and writes the blob.
      const double score_gbs = Median(sc) > 0 ? k_bytes / Median(sc) / 1e9 : 0;
      const double pack_gbs = Median(pa) > 0 ? 2.0 * blob / Median(pa) / 1e9 : 0;
      // kernel_ms: the four stages alone (device_ms adds the blob's copy back to the host).
      const double kernels = Median(sc) + Median(se) + Median(pa) + Median(qu);
      std::printf("%-40s %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %10.1f %10.1f %9.3f %9.2f\n",
                  label.c_str(), Median(sc) * 1e3, Median(se) * 1e3, Median(pa) * 1e3,
                  Median(qu) * 1e3, Median(to) * 1e3, Median(wall) * 1e3, score_gbs, pack_gbs,
                  kernels * 1e3, kv_copy_s > 0 ? kernels / kv_copy_s : 0.0);
    }
  }
  std::printf("device memory held by the backend pool: %.1f MiB\n",
              GpuMemoryUsedBytes() / 1048576.0);
  if (!decode) return 0;

  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  auto cpu = CreateCpuBackend({});
  if (!cpu.ok()) {
    std::printf("error: %s\n", std::string(cpu.status().message()).c_str());
    return 1;
  }
  Cublas cublas;
  std::printf(
      "\n== decode attention (step_us: one layer, one new token per sequence; MB/token: "
      "bytes read per sequence; %%memcpy: GB/s over the same-size D2D memcpy's read+write "
      "GB/s; bytes/: dense bytes over packed bytes; x_dense, x_cublas: speedup over the "
      "dense kernel and cuBLAS; x/bytes: x_dense over bytes/; max_err: against the CPU "
      "backend's Attend) ==\n");
  bool ok = true;
  for (int s : {4096, 32768}) {
    const gpu_testing::Layer dl =
        s == seq_len ? layer
                     : gpu_testing::RandomLayer({8, 32, s, 128, 32}, DType::kF16, Layout::kHND, 43);
    for (int batch : {1, 8}) {
      ok = DecodeRows(**backend, **cpu, dl, batch, iters, sms, 2 * copy, cublas) && ok;
    }
  }
  return ok ? 0 : 1;
}

}  // namespace
}  // namespace kvc

int main(int argc, char** argv) {
  int seq_len = 32768, iters = 10;
  bool decode = true;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--decode=0") == 0) decode = false;
    if (std::strncmp(argv[i], "--seq_len=", 10) == 0) seq_len = std::atoi(argv[i] + 10);
    if (std::strncmp(argv[i], "--iters=", 8) == 0) iters = std::atoi(argv[i] + 8);
  }
  if (seq_len < 64 || iters < 1) {
    std::fprintf(stderr, "--seq_len must be >= 64 and --iters >= 1\n");
    return 2;
  }
  if (!kvc::gpu_testing::DeviceOrSkipMessage()) return kvc::gpu_testing::kSkipExitCode;
  return kvc::Run(seq_len, iters, decode);
}

// Token scoring: Q_obs K^T (causal, or over every key for kvzip's rows), softmax (with optional
// Gumbel noise), group average, SnapKV pooling, key norms and seeded random scores.
//
// fp32 inputs: Q K^T is a tiled kernel on CUDA cores with fp32 accumulation (32 queries x 64 keys
// per block, head_dim streamed through shared memory in chunks of 32), then softmax and the group
// column sum as separate passes over a logits buffer.
//
// fp16/bf16 inputs (LaunchTensorCoreColumnScores): Q K^T on tensor cores (WMMA 16x16x16, fp32
// accumulation), fused with the softmax and the group column sum so that no logits buffer is
// written: pass 1 computes per-row (max, sum of exp) partials per 64-key tile, a small kernel
// merges them per row, and pass 2 recomputes each logit tile and adds its probabilities into the
// column sums. (row tile, key tile) pairs past every row's causal limit are skipped (up to half
// the work when W = S). Products of fp16/bf16 values are exact in fp32, so the logits differ from
// the CUDA core kernel only by summation order.
#include <mma.h>

#include <cmath>

#include "cuda/cuda_common.cuh"
#include "cuda/reduce.cuh"
#include "kvc/noise.h"

namespace kvc::cuda {
namespace {

constexpr int kTileQ = 32;
constexpr int kTileK = 64;
constexpr int kChunk = 32;
constexpr int kThreads = 256;

template <typename E, typename HD>
__global__ void QKLogitsKernel(const typename E::T* __restrict__ q, Strides qs,
                               const typename E::T* __restrict__ k, Strides ks, int group,
                               int obs_window, int row0, int rows, int seq_len, int runtime_d,
                               float scale, bool causal, float* __restrict__ logits) {
  __shared__ float sq[kTileQ][kChunk + 1];
  __shared__ float sk[kTileK][kChunk + 1];
  const int d = HD::Get(runtime_d);
  const int hq = blockIdx.z, hkv = hq / group;
  const int i0 = blockIdx.y * kTileQ, j0 = blockIdx.x * kTileK;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  // Local row i is query row0 + i, at prompt position seq_len - obs_window + row0 + i; it sees
  // keys j <= that position.
  const int first_pos = seq_len - obs_window + row0 + i0;
  const int last_pos = first_pos + kTileQ - 1;
  const bool all_masked = causal && j0 > last_pos;

  float acc[2][4] = {};
  if (!all_masked) {
    for (int c0 = 0; c0 < d; c0 += kChunk) {
      for (int e = tid; e < kTileQ * kChunk; e += kThreads) {
        const int r = e / kChunk, c = e % kChunk;
        const int i = i0 + r, ch = c0 + c;
        sq[r][c] =
            (i < rows && ch < d) ? E::Load(q, hq * qs.head + (row0 + i) * qs.token + ch) : 0.f;
      }
      for (int e = tid; e < kTileK * kChunk; e += kThreads) {
        const int r = e / kChunk, c = e % kChunk;
        const int j = j0 + r, ch = c0 + c;
        sk[r][c] = (j < seq_len && ch < d) ? E::Load(k, hkv * ks.head + j * ks.token + ch) : 0.f;
      }
      __syncthreads();
#pragma unroll 8
      for (int c = 0; c < kChunk; ++c) {
        const float a0 = sq[ty * 2][c], a1 = sq[ty * 2 + 1][c];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
          const float b = sk[tx + 16 * x][c];
          acc[0][x] = fmaf(a0, b, acc[0][x]);
          acc[1][x] = fmaf(a1, b, acc[1][x]);
        }
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int y = 0; y < 2; ++y) {
    const int i = i0 + ty * 2 + y;
    if (i >= rows) continue;
    const int pos = seq_len - obs_window + row0 + i;
    float* row = logits + (static_cast<size_t>(hq) * rows + i) * seq_len;
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int j = j0 + tx + 16 * x;
      if (j < seq_len) row[j] = !causal || j <= pos ? acc[y][x] * scale : -INFINITY;
    }
  }
}

__global__ void SoftmaxRowsKernel(float* __restrict__ logits, int obs_window, int row0, int rows,
                                  int seq_len, bool gumbel, uint64_t seed, uint32_t layer,
                                  float inv_tau) {
  __shared__ float red[32];
  const int r = blockIdx.x;
  const int hq = r / rows, i = row0 + r % rows;    // i: the query's row in the whole window
  const int valid = seq_len - obs_window + i + 1;  // keys 0 .. pos
  float* row = logits + static_cast<size_t>(r) * seq_len;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < valid; j += blockDim.x) {
    float x = row[j];
    if (gumbel) {
      x = (x + CounterGumbel(seed, layer, static_cast<uint32_t>(hq), static_cast<uint32_t>(i),
                             static_cast<uint32_t>(j))) *
          inv_tau;
      row[j] = x;
    }
    mx = fmaxf(mx, x);
  }
  mx = BlockReduce<true>(mx, red);
  float sum = 0.f;
  for (int j = threadIdx.x; j < valid; j += blockDim.x) sum += expf(row[j] - mx);
  sum = BlockReduce<false>(sum, red);
  const float inv = 1.0f / sum;
  for (int j = threadIdx.x; j < seq_len; j += blockDim.x) {
    row[j] = j < valid ? expf(row[j] - mx) * inv : 0.f;
  }
}

__global__ void GroupColumnSumKernel(const float* __restrict__ probs, int group, int rows,
                                     int seq_len, int num_kv_heads, bool accumulate,
                                     float* __restrict__ scores) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(num_kv_heads) * seq_len) return;
  const int h = static_cast<int>(idx / seq_len), j = static_cast<int>(idx % seq_len);
  float s = 0.f;
  for (int g = 0; g < group; ++g) {
    const float* p = probs + static_cast<size_t>(h * group + g) * rows * seq_len + j;
    for (int i = 0; i < rows; ++i) s += p[static_cast<size_t>(i) * seq_len];
  }
  s /= static_cast<float>(group);
  scores[idx] = accumulate ? scores[idx] + s : s;
}

__global__ void Pool1dKernel(const float* __restrict__ in, int rows, int seq_len, int len,
                             int kernel, bool avg, float* __restrict__ out) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(rows) * seq_len) return;
  const int j = static_cast<int>(idx % seq_len);
  const float* row = in + (idx - j);
  if (j >= len) {
    out[idx] = row[j];
    return;
  }
  const int lo = max(0, j - kernel / 2), hi = min(len - 1, j + kernel / 2);
  float acc = avg ? 0.f : -INFINITY;
  // Same order of operations as the CPU (running max from the left, left-to-right sum).
  if (!avg) acc = row[lo];
  for (int t = avg ? lo : lo + 1; t <= hi; ++t) acc = avg ? acc + row[t] : fmaxf(acc, row[t]);
  out[idx] = avg ? acc / static_cast<float>(hi - lo + 1) : acc;
}

// One warp per (head, token) so that the channel loads of a token are coalesced.
template <typename E>
__global__ void KeyNormKernel(const typename E::T* __restrict__ k, Strides ks, int num_kv_heads,
                              int seq_len, int head_dim, float* __restrict__ scores) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= static_cast<int64_t>(num_kv_heads) * seq_len) return;
  const int h = static_cast<int>(w / seq_len), j = static_cast<int>(w % seq_len);
  float s = 0.f;
  for (int c = lane; c < head_dim; c += 32) {
    const float x = E::Load(k, h * ks.head + j * ks.token + c);
    s = fmaf(x, x, s);
  }
  s = WarpSum(s);
  if (lane == 0) scores[w] = -sqrtf(s);
}

__global__ void RandomScoresKernel(int num_kv_heads, int seq_len, uint64_t seed, uint32_t layer,
                                   float* __restrict__ scores) {
  const int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (idx >= static_cast<int64_t>(num_kv_heads) * seq_len) return;
  const int h = static_cast<int>(idx / seq_len), j = static_cast<int>(idx % seq_len);
  scores[idx] = CounterUniform(seed, layer, static_cast<uint32_t>(h), 0u, static_cast<uint32_t>(j));
}

__global__ void SumHeadsKernel(const float* __restrict__ scores, int num_kv_heads, int seq_len,
                               float* __restrict__ out) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= seq_len) return;
  float s = 0.f;
  for (int h = 0; h < num_kv_heads; ++h) s += scores[static_cast<size_t>(h) * seq_len + j];
  out[j] = s;
}

// ---- tensor-core column scores (fp16 / bf16) ----

constexpr int kTcKeys = 64;  // keys per block (one tile)
constexpr int kTcRows = 64;  // query rows per inner tile (4 warps x 16 rows)
constexpr int kTcThreads = 128;
constexpr int kTcLds = kTcKeys + 4;  // float stride of the logit tile (multiple of 4, WMMA store)

// Element stride of the Q and K tiles in shared memory: head_dim rounded up to the WMMA k-step
// (16) plus 8 elements of padding against bank conflicts (WMMA needs a multiple of 8).
__host__ __device__ __forceinline__ int TcLd(int d) { return (d + 15) / 16 * 16 + 8; }

// Dynamic shared memory: K tile, Q tile (both kTcKeys/kTcRows x TcLd halves), logit tile, and
// 2 x kTcRows floats of per-row or per-column values. Every part is a multiple of 128 bytes.
__host__ __device__ __forceinline__ size_t TcSmemBytes(int d) {
  return static_cast<size_t>(kTcKeys + kTcRows) * TcLd(d) * 2 + sizeof(float) * kTcRows * kTcLds +
         sizeof(float) * 2 * kTcRows;
}

struct TcArgs {
  const void* q;
  const void* k;
  Strides qs, ks;
  int group, obs_window, row0, rows, seq_len, head_dim, ntiles;
  float scale, inv_tau;
  bool gumbel, accumulate;
  uint64_t seed;
  uint32_t layer;
  float2* tile_stats;       // [Hq * rows, ntiles] (max, sum of exp) per row and key tile
  const float2* row_stats;  // [Hq * rows] (max, 1 / sum)
  float* scores;            // [Hkv, S]
};

// Copies rows [first, first + n) of a [*, D] operand into a shared tile of kTile x TcLd(D)
// elements, zero-filling rows >= n and channels >= D. row_ptr(i) is the element offset of row i.
template <typename E, typename RowOffset>
__device__ __forceinline__ void LoadTile(const typename E::T* __restrict__ src, int n, int d,
                                         int tile_rows, bool vec, RowOffset row_off,
                                         typename E::T* dst) {
  using T = typename E::T;
  const int ld = TcLd(d);
  if (vec) {                     // D % 8 == 0 and every row 16-byte aligned: 8 elements per load
    const int per_row = ld / 8;  // includes the zero-filled padding vectors
    for (int e = threadIdx.x; e < tile_rows * per_row; e += blockDim.x) {
      const int r = e / per_row, c = (e % per_row) * 8;
      uint4 v = make_uint4(0, 0, 0, 0);
      if (r < n && c < d) v = *reinterpret_cast<const uint4*>(src + row_off(r) + c);
      *reinterpret_cast<uint4*>(dst + r * ld + c) = v;
    }
  } else {
    const T zero = T(0.0f);
    for (int e = threadIdx.x; e < tile_rows * ld; e += blockDim.x) {
      const int r = e / ld, c = e % ld;
      dst[e] = (r < n && c < d) ? src[row_off(r) + c] : zero;
    }
  }
}

// Logits of query rows [rt * kTcRows, +kTcRows) of KV head h against the block's key tile into
// the logit tile; each warp computes (and later reads) its own 16 rows only.
template <typename T>
__device__ __forceinline__ void TcLogitTile(const T* sq, const T* sk, int d, float* ss) {
  namespace wmma = nvcuda::wmma;
  const int warp = threadIdx.x / 32, ld = TcLd(d), dp = (d + 15) / 16 * 16;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[kTcKeys / 16];
#pragma unroll
  for (int n = 0; n < kTcKeys / 16; ++n) wmma::fill_fragment(acc[n], 0.0f);
  for (int d0 = 0; d0 < dp; d0 += 16) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
    wmma::load_matrix_sync(a, sq + warp * 16 * ld + d0, ld);
#pragma unroll
    for (int n = 0; n < kTcKeys / 16; ++n) {
      // K tile rows are keys: as K^T (D x keys) it is column-major with leading dimension ld.
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
      wmma::load_matrix_sync(b, sk + n * 16 * ld + d0, ld);
      wmma::mma_sync(acc[n], a, b, acc[n]);
    }
  }
#pragma unroll
  for (int n = 0; n < kTcKeys / 16; ++n) {
    wmma::store_matrix_sync(ss + warp * 16 * kTcLds + n * 16, acc[n], kTcLds, wmma::mem_row_major);
  }
  __syncwarp();
}

// The softmax input of local tile row lr for key j, with the same operations as QKLogitsKernel and
// SoftmaxRowsKernel: logit * scale, then (+ Gumbel) * inv_tau; -inf where masked (j > pos or
// j >= S) and for rows past the end.
struct RowInfo {
  bool live;
  int hq, i, pos;  // query head, window row (row0-relative + row0), last visible key
};

__device__ __forceinline__ RowInfo TcRow(const TcArgs& a, int h, int global_row) {
  RowInfo r{false, 0, 0, -1};
  if (global_row >= a.group * a.rows) return r;
  const int gi = global_row / a.rows, ii = global_row % a.rows;
  r.live = true;
  r.hq = h * a.group + gi;
  r.i = a.row0 + ii;
  r.pos = a.seq_len - a.obs_window + r.i;
  return r;
}

__device__ __forceinline__ float TcInput(const TcArgs& a, const RowInfo& r, float logit, int j) {
  if (!r.live || j > r.pos || j >= a.seq_len) return -INFINITY;
  float x = logit * a.scale;
  if (a.gumbel) {
    x = (x + CounterGumbel(a.seed, a.layer, static_cast<uint32_t>(r.hq), static_cast<uint32_t>(r.i),
                           static_cast<uint32_t>(j))) *
        a.inv_tau;
  }
  return x;
}

// Pass 1 (kStats) writes per-(row, key tile) max and sum of exp; pass 2 adds probabilities
// exp(x - max) / sum into per-key column sums and writes scores. grid (ntiles, Hkv).
template <typename E, bool kStats>
__global__ void __launch_bounds__(kTcThreads) TcColumnKernel(TcArgs a) {
  using T = typename E::T;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  const int d = a.head_dim, ld = TcLd(d);
  T* sk = reinterpret_cast<T*>(tc_smem);
  T* sq = sk + kTcKeys * ld;
  float* ss = reinterpret_cast<float*>(sq + kTcRows * ld);
  float* sx = ss + kTcRows * kTcLds;  // 2 x kTcRows floats
  const int tile = blockIdx.x, h = blockIdx.y, j0 = tile * kTcKeys;
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const bool kvec = d % 8 == 0 && a.ks.token % 8 == 0 && a.ks.head % 8 == 0 &&
                    (reinterpret_cast<uintptr_t>(k) & 15) == 0;
  const bool qvec = d % 8 == 0 && a.qs.token % 8 == 0 && a.qs.head % 8 == 0 &&
                    (reinterpret_cast<uintptr_t>(q) & 15) == 0;
  const int64_t k_base = h * a.ks.head;
  LoadTile<E>(
      k, min(kTcKeys, a.seq_len - j0), d, kTcKeys, kvec,
      [&](int r) { return k_base + static_cast<int64_t>(j0 + r) * a.ks.token; }, sk);
  const int total_rows = a.group * a.rows;
  const int lr = threadIdx.x >> 1, half = threadIdx.x & 1;  // this thread's tile row, key half
  float colacc = 0.f;                                       // pass 2: column threadIdx.x & 63
  for (int r0 = 0; r0 < total_rows; r0 += kTcRows) {
    // A row tile whose every row sees only keys before this key tile contributes nothing: skip
    // its loads and MMAs (block-uniform). The tile's rows are window rows of one or two query
    // heads; the last visible key is largest for its largest window row. Pass 1 records the
    // skipped (row, key tile) pairs as empty partials for TcRowStatsKernel.
    const int last = min(r0 + kTcRows, total_rows) - 1;
    const int max_ii = r0 / a.rows == last / a.rows ? last % a.rows : a.rows - 1;
    if (j0 > a.seq_len - a.obs_window + a.row0 + max_ii) {
      if (kStats) {
        const RowInfo ri = TcRow(a, h, r0 + lr);
        if (half == 0 && ri.live) {
          const size_t row = static_cast<size_t>(ri.hq) * a.rows + (ri.i - a.row0);
          a.tile_stats[row * a.ntiles + tile] = make_float2(-INFINITY, 0.f);
        }
      }
      continue;
    }
    __syncthreads();  // the previous tile's readers of sq / ss are done
    LoadTile<E>(
        q, min(kTcRows, total_rows - r0), d, kTcRows, qvec,
        [&](int r) {
          const int gr = r0 + r, gi = gr / a.rows, ii = gr % a.rows;
          return (h * a.group + gi) * a.qs.head + static_cast<int64_t>(a.row0 + ii) * a.qs.token;
        },
        sq);
    __syncthreads();
    TcLogitTile(sq, sk, d, ss);
    // Thread (lr, half) owns keys half * 32 .. + 31 of tile row lr; lr is in this warp's rows.
    const RowInfo ri = TcRow(a, h, r0 + lr);
    float* srow = ss + lr * kTcLds + half * 32;
    if (kStats) {
      float mx = -INFINITY;
      for (int c = 0; c < 32; ++c) {
        srow[c] = TcInput(a, ri, srow[c], j0 + half * 32 + c);
        mx = fmaxf(mx, srow[c]);
      }
      float sum = 0.f;
      if (mx != -INFINITY) {
        for (int c = 0; c < 32; ++c) sum += expf(srow[c] - mx);
      }
      const float omx = __shfl_xor_sync(0xffffffffu, mx, 1);
      const float osum = __shfl_xor_sync(0xffffffffu, sum, 1);
      const float m2 = fmaxf(mx, omx);
      float l2 = 0.f;
      if (m2 != -INFINITY) {
        l2 = (mx == -INFINITY ? 0.f : sum * expf(mx - m2)) +
             (omx == -INFINITY ? 0.f : osum * expf(omx - m2));
      }
      if (half == 0 && ri.live) {
        const size_t row = static_cast<size_t>(ri.hq) * a.rows + (ri.i - a.row0);
        a.tile_stats[row * a.ntiles + tile] = make_float2(m2, l2);
      }
    } else {
      float2 st = make_float2(0.f, 0.f);
      if (ri.live) st = a.row_stats[static_cast<size_t>(ri.hq) * a.rows + (ri.i - a.row0)];
      for (int c = 0; c < 32; ++c) {
        const float x = TcInput(a, ri, srow[c], j0 + half * 32 + c);
        srow[c] = x == -INFINITY ? 0.f : expf(x - st.x) * st.y;
      }
      __syncthreads();  // column sums read rows of every warp
      const int col = threadIdx.x & 63, rh = threadIdx.x >> 6;
      for (int r = rh * 32; r < rh * 32 + 32; ++r) colacc += ss[r * kTcLds + col];
    }
  }
  if (!kStats) {
    const int col = threadIdx.x & 63, rh = threadIdx.x >> 6;
    sx[rh * kTcRows + col] = colacc;
    __syncthreads();
    const int j = j0 + threadIdx.x;
    if (threadIdx.x < kTcKeys && j < a.seq_len) {
      const float s = (sx[threadIdx.x] + sx[kTcRows + threadIdx.x]) / static_cast<float>(a.group);
      float* dst = a.scores + static_cast<size_t>(h) * a.seq_len + j;
      *dst = a.accumulate ? *dst + s : s;
    }
  }
}

// One warp per row: merges the tile partials into (max, 1 / sum).
__global__ void TcRowStatsKernel(const float2* __restrict__ tile_stats, int n_rows, int ntiles,
                                 float2* __restrict__ row_stats) {
  const int64_t w = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (w >= n_rows) return;
  const float2* t = tile_stats + w * ntiles;
  float mx = -INFINITY;
  for (int i = lane; i < ntiles; i += 32) mx = fmaxf(mx, t[i].x);
  mx = WarpMax(mx);
  float sum = 0.f;
  for (int i = lane; i < ntiles; i += 32) {
    if (t[i].x != -INFINITY) sum += t[i].y * expf(t[i].x - mx);
  }
  sum = WarpSum(sum);
  if (lane == 0) row_stats[w] = make_float2(mx, 1.0f / sum);
}

}  // namespace

cudaError_t LaunchQKLogits(ElemType dtype, const void* q, Strides qs, const void* k, Strides ks,
                           int num_q_heads, int num_kv_heads, int obs_window, QueryRows qr,
                           int seq_len, int head_dim, float scale, float* logits,
                           cudaStream_t stream, bool causal) {
  if (qr.rows <= 0) return cudaSuccess;
  if (qr.row0 < 0 || qr.row0 + qr.rows > obs_window) return cudaErrorInvalidValue;
  const dim3 grid((seq_len + kTileK - 1) / kTileK, (qr.rows + kTileQ - 1) / kTileQ, num_q_heads);
  const int group = num_q_heads / num_kv_heads;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    return KVC_DISPATCH_HEAD_DIM(head_dim, HD, [&] {
      return Launch(QKLogitsKernel<E, HD>, grid, kThreads, 0, stream,
                    static_cast<const typename E::T*>(q), qs, static_cast<const typename E::T*>(k),
                    ks, group, obs_window, qr.row0, qr.rows, seq_len, head_dim, scale, causal,
                    logits);
    });
  });
}

cudaError_t LaunchSoftmaxRows(float* logits, int num_q_heads, int obs_window, QueryRows qr,
                              int seq_len, bool gumbel, uint64_t seed, uint32_t layer,
                              float inv_tau, cudaStream_t stream) {
  const int rows = num_q_heads * qr.rows;
  if (rows <= 0) return cudaSuccess;
  if (qr.row0 < 0 || qr.row0 + qr.rows > obs_window) return cudaErrorInvalidValue;
  return Launch(SoftmaxRowsKernel, rows, 256, 0, stream, logits, obs_window, qr.row0, qr.rows,
                seq_len, gumbel, seed, layer, inv_tau);
}

cudaError_t LaunchGroupColumnSum(const float* probs, int num_q_heads, int num_kv_heads, int rows,
                                 int seq_len, bool accumulate, float* scores, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(num_kv_heads) * seq_len;
  return Launch(GroupColumnSumKernel, Blocks(n, 256), 256, 0, stream, probs,
                num_q_heads / num_kv_heads, rows, seq_len, num_kv_heads, accumulate, scores);
}

cudaError_t LaunchPool1d(const float* in, int rows, int seq_len, int len, int kernel, bool avg,
                         float* out, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(rows) * seq_len;
  return Launch(Pool1dKernel, Blocks(n, 256), 256, 0, stream, in, rows, seq_len, len, kernel, avg,
                out);
}

cudaError_t LaunchKeyNormScores(ElemType dtype, const void* k, Strides ks, int num_kv_heads,
                                int seq_len, int head_dim, float* scores, cudaStream_t stream) {
  const int64_t threads = static_cast<int64_t>(num_kv_heads) * seq_len * 32;
  return KVC_DISPATCH_DTYPE(dtype, E, [&] {
    return Launch(KeyNormKernel<E>, Blocks(threads, 256), 256, 0, stream,
                  static_cast<const typename E::T*>(k), ks, num_kv_heads, seq_len, head_dim,
                  scores);
  });
}

cudaError_t LaunchRandomScores(int num_kv_heads, int seq_len, uint64_t seed, uint32_t layer,
                               float* scores, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(num_kv_heads) * seq_len;
  return Launch(RandomScoresKernel, Blocks(n, 256), 256, 0, stream, num_kv_heads, seq_len, seed,
                layer, scores);
}

cudaError_t LaunchSumHeads(const float* scores, int num_kv_heads, int seq_len, float* out,
                           cudaStream_t stream) {
  return Launch(SumHeadsKernel, Blocks(seq_len, 256), 256, 0, stream, scores, num_kv_heads, seq_len,
                out);
}

size_t ColumnScoreScratchFloats(int num_q_heads, int rows, int seq_len) {
  const size_t n_rows = static_cast<size_t>(num_q_heads) * rows;
  const size_t ntiles = (static_cast<size_t>(seq_len) + kTcKeys - 1) / kTcKeys;
  return 2 * n_rows * ntiles + 2 * n_rows;
}

cudaError_t LaunchTensorCoreColumnScores(ElemType dtype, const void* q, Strides qs, const void* k,
                                         Strides ks, int num_q_heads, int num_kv_heads,
                                         int obs_window, QueryRows qr, int seq_len, int head_dim,
                                         float scale, bool gumbel, uint64_t seed, uint32_t layer,
                                         float inv_tau, bool accumulate, float* scratch,
                                         float* scores, cudaStream_t stream) {
  if (dtype == ElemType::kF32) return cudaErrorInvalidValue;  // the CUDA-core path handles fp32
  if (qr.rows <= 0) return cudaSuccess;
  if (qr.row0 < 0 || qr.row0 + qr.rows > obs_window || obs_window > seq_len || head_dim < 8 ||
      head_dim > 256 || num_kv_heads < 1 || num_q_heads % num_kv_heads != 0) {
    return cudaErrorInvalidValue;
  }
  TcArgs a;
  a.q = q;
  a.k = k;
  a.qs = qs;
  a.ks = ks;
  a.group = num_q_heads / num_kv_heads;
  a.obs_window = obs_window;
  a.row0 = qr.row0;
  a.rows = qr.rows;
  a.seq_len = seq_len;
  a.head_dim = head_dim;
  a.ntiles = (seq_len + kTcKeys - 1) / kTcKeys;
  a.scale = scale;
  a.inv_tau = inv_tau;
  a.gumbel = gumbel;
  a.accumulate = accumulate;
  a.seed = seed;
  a.layer = layer;
  const size_t n_rows = static_cast<size_t>(num_q_heads) * qr.rows;
  a.tile_stats = reinterpret_cast<float2*>(scratch);
  a.row_stats = reinterpret_cast<const float2*>(scratch + 2 * n_rows * a.ntiles);
  a.scores = scores;
  const size_t smem = TcSmemBytes(head_dim);
  const dim3 grid(a.ntiles, num_kv_heads);
  auto run = [&](auto* stats_kernel, auto* column_kernel) -> cudaError_t {
    KVC_CUDA_CALL(cudaFuncSetAttribute(stats_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    KVC_CUDA_CALL(cudaFuncSetAttribute(column_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(smem)));
    KVC_CUDA_CALL(Launch(stats_kernel, grid, kTcThreads, smem, stream, a));
    KVC_CUDA_CALL(Launch(TcRowStatsKernel, Blocks(static_cast<int64_t>(n_rows) * 32, 256), 256, 0,
                         stream, a.tile_stats, static_cast<int>(n_rows), a.ntiles,
                         reinterpret_cast<float2*>(scratch + 2 * n_rows * a.ntiles)));
    return Launch(column_kernel, grid, kTcThreads, smem, stream, a);
  };
  if (dtype == ElemType::kF16) return run(TcColumnKernel<F16, true>, TcColumnKernel<F16, false>);
  return run(TcColumnKernel<BF16, true>, TcColumnKernel<BF16, false>);
}

}  // namespace kvc::cuda

// Selection: top-k kept positions per head and key/value channel selection.
//
// Top-k is a radix select split over blocks: each row of S scores is cut into segments of
// kTopKSegment keys, one block each, so a Llama-3-8B layer at 128K tokens (8 rows) runs on 256
// blocks instead of 8. Four 8-bit passes build a global histogram per row (integer atomics: the
// counts do not depend on the order of the additions); every block re-derives the row's radix
// state from the histograms so far. Then each block counts the keys above and equal to the k-th
// largest key in its segment, one small kernel turns the counts into each segment's offsets, and
// an ordered scan per segment writes the kept positions ascending, ties to the lower position.
#include <algorithm>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "cuda/cuda_common.cuh"
#include "cuda/reduce.cuh"

namespace kvc::cuda {
namespace {

constexpr int kTopKThreads = 256;                // one per radix bucket
constexpr int kTopKSegment = 4096;               // keys per block by default (16 per thread)
constexpr int kTopKPasses = 4;                   // 8 bits each
constexpr uint32_t kProtectedKey = 0xffffffffu;  // above OrderedKey(+inf)

__device__ __forceinline__ uint32_t TokenKey(const float* row, int j, int sink_end,
                                             int recent_begin) {
  return (j < sink_end || j >= recent_begin) ? kProtectedKey : OrderedKey(row[j]);
}

struct TopKArgs {
  const float* scores;  // [rows, S]
  int rows, seq_len, k, sink_end, recent_begin;
  int segment, segments;  // keys per block, blocks per row
  int* hist;              // [kTopKPasses, rows, 256], zeroed before the first pass
  int2* counts;           // [rows, segments]: keys above the threshold, keys equal to it
  int2* offsets;          // [rows, segments]: equal keys before the segment, kept keys before it
  int32_t* out;           // [rows, k]
};

using TopKScan = cub::BlockScan<int, kTopKThreads>;

struct TopKShared {
  typename TopKScan::TempStorage scan;
  int bucket, above, all;
};

// The radix state of `row` after `passes` passes: the key prefix fixed so far (`mask` covers
// it) and how many keys with that prefix still have to be kept. Every thread of the block must
// call it; all get the result.
struct Radix {
  uint32_t prefix, mask;
  int remaining;
};

__device__ Radix DeriveRadix(const TopKArgs& a, int row, int passes, TopKShared& sh) {
  Radix r{0u, 0u, a.k};
  for (int p = 0; p < passes; ++p) {
    // Thread t holds bucket 255 - t, so the inclusive scan is the count of keys in buckets >= b.
    const int b = kTopKThreads - 1 - static_cast<int>(threadIdx.x);
    const int h = a.hist[(static_cast<size_t>(p) * a.rows + row) * 256 + b];
    int incl;
    TopKScan(sh.scan).InclusiveSum(h, incl);
    if (threadIdx.x == 0) sh.bucket = -1;
    __syncthreads();
    // The highest bucket b >= 1 at which the count reaches `remaining`; else bucket 0 with all
    // of buckets 1..255 above it.
    const int excl = incl - h;
    if (b >= 1 && excl < r.remaining && r.remaining <= incl) {
      sh.bucket = b;
      sh.above = excl;
    }
    if (b == 1) sh.all = incl;
    __syncthreads();
    const int bucket = sh.bucket >= 0 ? sh.bucket : 0;
    const int above = sh.bucket >= 0 ? sh.above : sh.all;
    __syncthreads();  // sh is rewritten by the next pass
    const int shift = 24 - 8 * p;
    r.remaining -= above;
    r.prefix |= static_cast<uint32_t>(bucket) << shift;
    r.mask |= 0xffu << shift;
  }
  return r;
}

// Block (row, segment) of a flat grid: rows * segments blocks.
__device__ __forceinline__ void RowAndSegment(const TopKArgs& a, int* row, int* seg, int* j0,
                                              int* j1) {
  *row = static_cast<int>(blockIdx.x / a.segments);
  *seg = static_cast<int>(blockIdx.x % a.segments);
  *j0 = *seg * a.segment;
  *j1 = min(*j0 + a.segment, a.seq_len);
}

// Pass `pass`: the segment's histogram of byte `pass` (from the top) of the keys that match the
// prefix so far, added into the row's global histogram. Equal buckets within a warp are counted
// with one shared atomic (protected keys all share bucket 255).
__global__ void __launch_bounds__(kTopKThreads) TopKHistKernel(TopKArgs a, int pass) {
  __shared__ TopKShared sh;
  __shared__ int hist[256];
  int row, seg, j0, j1;
  RowAndSegment(a, &row, &seg, &j0, &j1);
  hist[threadIdx.x] = 0;
  const Radix r = DeriveRadix(a, row, pass, sh);
  __syncthreads();
  const float* scores = a.scores + static_cast<size_t>(row) * a.seq_len;
  const int shift = 24 - 8 * pass, lane = threadIdx.x & 31;
  for (int base = j0; base < j1; base += kTopKThreads) {  // uniform: every lane reaches the match
    const int j = base + static_cast<int>(threadIdx.x);
    int bucket = 256;  // none
    if (j < j1) {
      const uint32_t key = TokenKey(scores, j, a.sink_end, a.recent_begin);
      if ((key & r.mask) == r.prefix) bucket = static_cast<int>((key >> shift) & 0xffu);
    }
    const unsigned peers = __match_any_sync(0xffffffffu, bucket);
    if (bucket < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[bucket], __popc(peers));
  }
  __syncthreads();
  const int c = hist[threadIdx.x];
  if (c != 0) atomicAdd(&a.hist[(static_cast<size_t>(pass) * a.rows + row) * 256 + threadIdx.x], c);
}

// Keys of the segment above the row's threshold (the k-th largest key) and equal to it.
__global__ void __launch_bounds__(kTopKThreads) TopKCountKernel(TopKArgs a) {
  using Reduce = cub::BlockReduce<int, kTopKThreads>;
  __shared__ TopKShared sh;
  __shared__ typename Reduce::TempStorage red;
  int row, seg, j0, j1;
  RowAndSegment(a, &row, &seg, &j0, &j1);
  const Radix r = DeriveRadix(a, row, kTopKPasses, sh);
  const float* scores = a.scores + static_cast<size_t>(row) * a.seq_len;
  int gt = 0, eq = 0;
  for (int j = j0 + static_cast<int>(threadIdx.x); j < j1; j += kTopKThreads) {
    const uint32_t key = TokenKey(scores, j, a.sink_end, a.recent_begin);
    gt += key > r.prefix ? 1 : 0;
    eq += key == r.prefix ? 1 : 0;
  }
  gt = Reduce(red).Sum(gt);
  __syncthreads();
  eq = Reduce(red).Sum(eq);
  if (threadIdx.x == 0) a.counts[static_cast<size_t>(row) * a.segments + seg] = make_int2(gt, eq);
}

// One block per row: each segment's equal keys and kept keys before it. A segment keeps all its
// keys above the threshold and its equal keys whose rank among the row's equal keys is below
// `need` (the row's remaining count): ties go to the lower positions.
__global__ void __launch_bounds__(kTopKThreads) TopKOffsetKernel(TopKArgs a) {
  __shared__ TopKShared sh;
  const int row = blockIdx.x;
  const Radix r = DeriveRadix(a, row, kTopKPasses, sh);
  if (threadIdx.x != 0) return;
  const size_t base = static_cast<size_t>(row) * a.segments;
  int eq_before = 0, keep_before = 0;
  for (int s = 0; s < a.segments; ++s) {
    const int2 c = a.counts[base + s];
    a.offsets[base + s] = make_int2(eq_before, keep_before);
    keep_before += c.x + max(0, min(r.remaining - eq_before, c.y));
    eq_before += c.y;
  }
}

// The segment's kept positions, ascending, at the segment's offset in the row's output.
__global__ void __launch_bounds__(kTopKThreads) TopKWriteKernel(TopKArgs a) {
  __shared__ TopKShared sh;
  int row, seg, j0, j1;
  RowAndSegment(a, &row, &seg, &j0, &j1);
  const Radix r = DeriveRadix(a, row, kTopKPasses, sh);
  const uint32_t threshold = r.prefix;
  const int need = r.remaining;
  const int2 off = a.offsets[static_cast<size_t>(row) * a.segments + seg];
  int running_eq = off.x, running_keep = off.y;
  const float* scores = a.scores + static_cast<size_t>(row) * a.seq_len;
  int32_t* dst = a.out + static_cast<size_t>(row) * a.k;
  for (int base = j0; base < j1; base += kTopKThreads) {
    const int j = base + static_cast<int>(threadIdx.x);
    const uint32_t key = j < j1 ? TokenKey(scores, j, a.sink_end, a.recent_begin) : 0u;
    const int eq = (j < j1 && key == threshold) ? 1 : 0;
    int eq_rank, eq_total;
    TopKScan(sh.scan).ExclusiveSum(eq, eq_rank, eq_total);
    __syncthreads();
    const int keep = (j < j1 && (key > threshold || (eq && running_eq + eq_rank < need))) ? 1 : 0;
    int keep_rank, keep_total;
    TopKScan(sh.scan).ExclusiveSum(keep, keep_rank, keep_total);
    __syncthreads();
    if (keep && running_keep + keep_rank < a.k) dst[running_keep + keep_rank] = j;
    running_eq += eq_total;
    running_keep += keep_total;
  }
}

// ---- channel selection ----

constexpr int kSliceThreads = 128;
constexpr int kChannelSliceTokens = 512;

int ChannelSlices(int n_kept) {
  return std::max(1, (n_kept + kChannelSliceTokens - 1) / kChannelSliceTokens);
}

// Grid (slices, Hkv): per channel, the slice's sum over old kept tokens of K^2 (|K| for l1) in
// float per thread, the threads' sums added in a fixed order in double. Threads cover the
// channels of 128 / D tokens at once (D <= 128) or one token's channels (D > 128).
template <typename E>
__global__ void __launch_bounds__(kSliceThreads)
    KeyChannelSliceKernel(ChannelArgs a, double* __restrict__ partial) {
  __shared__ double sums[kSliceThreads];
  const int slice = blockIdx.x, h = blockIdx.y, d = a.head_dim;
  const int lanes = d <= kSliceThreads ? kSliceThreads / d : 1;
  const int r = d <= kSliceThreads ? threadIdx.x / d : 0;
  const int c = d <= kSliceThreads ? threadIdx.x % d : threadIdx.x;
  const int j0 = slice * kChannelSliceTokens, j1 = min(j0 + kChannelSliceTokens, a.m);
  const auto* k = static_cast<const typename E::T*>(a.k);
  const int32_t* pos = a.positions + static_cast<size_t>(h) * a.n_kept;
  float acc0 = 0.f, acc1 = 0.f;
  if (r < lanes) {
    for (int j = j0 + r; j < j1; j += lanes) {
      const int64_t row = h * a.ks.head + pos[j] * a.ks.token;
      const float x = E::Load(k, row + c);
      acc0 = a.key_policy == 2 ? acc0 + fabsf(x) : fmaf(x, x, acc0);
      if (c + kSliceThreads < d) {
        const float y = E::Load(k, row + c + kSliceThreads);
        acc1 = a.key_policy == 2 ? acc1 + fabsf(y) : fmaf(y, y, acc1);
      }
    }
  }
  double* out = partial + (static_cast<size_t>(h) * gridDim.x + slice) * d;
  if (d > kSliceThreads) {
    out[c] = acc0;
    if (c + kSliceThreads < d) out[c + kSliceThreads] = acc1;
    return;
  }
  sums[threadIdx.x] = acc0;
  __syncthreads();
  if (threadIdx.x < d) {
    double t = 0.0;
    for (int i = 0; i < lanes; ++i) t += sums[i * d + threadIdx.x];
    out[threadIdx.x] = t;
  }
}

// One block per KV head, one thread per channel: the slices in order, then the policy's score in
// the CPU engine's operations (kernels/cpu/channels.cc).
template <typename E>
__global__ void KeyChannelFinishKernel(ChannelArgs a, int slices,
                                       const double* __restrict__ partial,
                                       float* __restrict__ key_scores) {
  const int h = blockIdx.x, c = threadIdx.x;
  if (c >= a.head_dim) return;
  double sum = 0.0;
  const double* p = partial + static_cast<size_t>(h) * slices * a.head_dim + c;
  for (int s = 0; s < slices; ++s) sum += p[static_cast<size_t>(s) * a.head_dim];
  float s = static_cast<float>(sum);
  if (a.key_policy == 3) {
    s = sqrtf(s);
  } else if (a.key_policy == 1) {
    const auto* q = static_cast<const typename E::T*>(a.q);
    const int group = a.num_q_heads / a.num_kv_heads;
    float qsq = 0.f;
    for (int g = 0; g < group; ++g) {
      for (int i = 0; i < a.obs_window; ++i) {
        const float x = E::Load(q, (h * group + g) * a.qs.head + i * a.qs.token + c);
        qsq = fmaf(x, x, qsq);
      }
    }
    const float inv =
        a.m > 0 ? 1.0f / (static_cast<float>(group * a.obs_window) * static_cast<float>(a.m))
                : 0.0f;
    s *= qsq * inv;
  }
  key_scores[h * a.head_dim + c] = s;
}

// One block per (query head, query row): the causal softmax over all n_kept kept tokens (what
// decode attention will see), then o[c] = sum over the m old tokens of p_j v[pos_j, c].
template <typename E>
__global__ void ValueAttnKernel(ChannelArgs a, float* __restrict__ probs, float* __restrict__ o) {
  __shared__ float sq[256];
  __shared__ float red[32];
  const int r = blockIdx.x;
  const int hq = r / a.obs_window, i = r % a.obs_window;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int h = hq / group;
  const auto* q = static_cast<const typename E::T*>(a.q);
  const auto* k = static_cast<const typename E::T*>(a.k);
  const auto* v = static_cast<const typename E::T*>(a.v);
  const int32_t* pos = a.positions + static_cast<size_t>(h) * a.n_kept;
  const int qpos = a.seq_len - a.obs_window + i;
  const float scale = 1.0f / sqrtf(static_cast<float>(a.head_dim));
  for (int c = threadIdx.x; c < a.head_dim; c += blockDim.x) {
    sq[c] = E::Load(q, hq * a.qs.head + i * a.qs.token + c);
  }
  __syncthreads();
  float* p = probs + static_cast<size_t>(r) * a.n_kept;
  float mx = -INFINITY;
  for (int j = threadIdx.x; j < a.n_kept; j += blockDim.x) {
    float x = -INFINITY;
    if (pos[j] <= qpos) {
      const int64_t row = h * a.ks.head + pos[j] * a.ks.token;
      float s = 0.f;
      for (int c = 0; c < a.head_dim; ++c) s = fmaf(sq[c], E::Load(k, row + c), s);
      x = s * scale;
    }
    p[j] = x;
    mx = fmaxf(mx, x);
  }
  mx = BlockReduce<true>(mx, red);
  float sum = 0.f;
  for (int j = threadIdx.x; j < a.n_kept; j += blockDim.x) {
    const float e = p[j] == -INFINITY ? 0.f : expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  sum = BlockReduce<false>(sum, red);
  const float inv = sum > 0.f ? 1.0f / sum : 0.f;
  for (int c = threadIdx.x; c < a.head_dim; c += blockDim.x) {
    float acc = 0.f;
    for (int j = 0; j < a.m; ++j) {
      acc = fmaf(p[j] * inv, E::Load(v, h * a.vs.head + pos[j] * a.vs.token + c), acc);
    }
    o[static_cast<size_t>(r) * a.head_dim + c] = acc;
  }
}

__global__ void ValueChannelScoreKernel(const float* __restrict__ o, int group, int obs_window,
                                        int head_dim, float* __restrict__ value_scores) {
  const int h = blockIdx.x, c = threadIdx.x;
  if (c >= head_dim) return;
  float s = 0.f;
  for (int r = h * group * obs_window; r < (h + 1) * group * obs_window; ++r) {
    const float x = o[static_cast<size_t>(r) * head_dim + c];
    s = fmaf(x, x, s);
  }
  value_scores[h * head_dim + c] = s;
}

// One block per head: keeps the `keep` channels of highest score (ties: lower index), ascending.
__global__ void ChannelTopKernel(const float* __restrict__ scores, int head_dim, int keep,
                                 int32_t* __restrict__ out) {
  __shared__ uint32_t keys[256];
  __shared__ int flags[256];
  const int h = blockIdx.x, c = threadIdx.x;
  if (c < head_dim) keys[c] = OrderedKey(scores[h * head_dim + c]);
  __syncthreads();
  if (c < head_dim) {
    int rank = 0;
    for (int o = 0; o < head_dim; ++o) {
      rank += (keys[o] > keys[c] || (keys[o] == keys[c] && o < c)) ? 1 : 0;
    }
    flags[c] = rank < keep ? 1 : 0;
  }
  __syncthreads();
  if (c == 0) {
    int n = 0;
    for (int o = 0; o < head_dim; ++o) {
      if (flags[o]) out[h * keep + n++] = o;
    }
  }
}

__global__ void IotaKernel(int num_heads, int n, int32_t* __restrict__ out) {
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx < num_heads * n) out[idx] = idx % n;
}

int Segments(int seq_len, int segment) { return (seq_len + segment - 1) / segment; }

}  // namespace

size_t TopKScratchBytes(int rows, int seq_len, int segment) {
  if (segment <= 0) segment = kTopKSegment;
  const size_t segments = static_cast<size_t>(Segments(seq_len, segment));
  return sizeof(int) * kTopKPasses * 256 * static_cast<size_t>(rows) +
         2 * sizeof(int2) * static_cast<size_t>(rows) * segments;
}

cudaError_t LaunchTopKPositions(const float* scores, int rows, int seq_len, int k, int sink_end,
                                int recent_begin, void* scratch, int32_t* out, cudaStream_t stream,
                                int segment) {
  if (segment <= 0) segment = kTopKSegment;
  if (k < 1 || k > seq_len || rows < 1 || scratch == nullptr || segment % kTopKThreads != 0) {
    return cudaErrorInvalidValue;
  }
  TopKArgs a;
  a.scores = scores;
  a.rows = rows;
  a.seq_len = seq_len;
  a.k = k;
  a.sink_end = sink_end;
  a.recent_begin = recent_begin;
  a.segment = segment;
  a.segments = Segments(seq_len, segment);
  const size_t hist_ints = static_cast<size_t>(kTopKPasses) * 256 * rows;
  a.hist = static_cast<int*>(scratch);
  a.counts = reinterpret_cast<int2*>(a.hist + hist_ints);
  a.offsets = a.counts + static_cast<size_t>(rows) * a.segments;
  a.out = out;
  const int64_t blocks = static_cast<int64_t>(rows) * a.segments;
  if (blocks > INT32_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(blocks));
  KVC_CUDA_CALL(cudaMemsetAsync(a.hist, 0, sizeof(int) * hist_ints, stream));
  for (int pass = 0; pass < kTopKPasses; ++pass) {
    KVC_CUDA_CALL(Launch(TopKHistKernel, grid, kTopKThreads, 0, stream, a, pass));
  }
  KVC_CUDA_CALL(Launch(TopKCountKernel, grid, kTopKThreads, 0, stream, a));
  KVC_CUDA_CALL(Launch(TopKOffsetKernel, rows, kTopKThreads, 0, stream, a));
  return Launch(TopKWriteKernel, grid, kTopKThreads, 0, stream, a);
}

size_t ChannelScratchFloats(int num_kv_heads, int num_q_heads, int obs_window, int n_kept,
                            int head_dim) {
  return 2 * static_cast<size_t>(num_kv_heads) * ChannelSlices(n_kept) * head_dim +
         2 * static_cast<size_t>(num_kv_heads) * head_dim +
         static_cast<size_t>(num_q_heads) * obs_window * (static_cast<size_t>(n_kept) + head_dim);
}

cudaError_t LaunchSelectChannels(const ChannelArgs& a, cudaStream_t stream) {
  const int hkv = a.num_kv_heads, d = a.head_dim;
  const int slices = ChannelSlices(a.n_kept);
  // The doubles first: the scratch is 256-byte aligned.
  auto* partial = reinterpret_cast<double*>(a.scratch);
  float* key_scores = a.scratch + 2 * static_cast<size_t>(hkv) * slices * d;
  float* value_scores = key_scores + static_cast<size_t>(hkv) * d;
  float* probs = value_scores + static_cast<size_t>(hkv) * d;
  float* o = probs + static_cast<size_t>(a.num_q_heads) * a.obs_window * a.n_kept;
  if (a.key_policy != 0 && a.key_channels < d) {
    KVC_CUDA_CALL(KVC_DISPATCH_DTYPE(a.dtype, E, [&] {
      KVC_CUDA_CALL(Launch(KeyChannelSliceKernel<E>, dim3(slices, hkv), kSliceThreads, 0, stream, a,
                           partial));
      return Launch(KeyChannelFinishKernel<E>, hkv, 256, 0, stream, a, slices, partial, key_scores);
    }));
    KVC_CUDA_CALL(
        Launch(ChannelTopKernel, hkv, 256, 0, stream, key_scores, d, a.key_channels, a.key_idx));
  } else {
    KVC_CUDA_CALL(Launch(IotaKernel, (hkv * a.key_channels + 255) / 256, 256, 0, stream, hkv,
                         a.key_channels, a.key_idx));
  }
  if (a.prune_values && a.value_channels < d) {
    KVC_CUDA_CALL(KVC_DISPATCH_DTYPE(a.dtype, E, [&] {
      return Launch(ValueAttnKernel<E>, a.num_q_heads * a.obs_window, 256, 0, stream, a, probs, o);
    }));
    KVC_CUDA_CALL(Launch(ValueChannelScoreKernel, hkv, 256, 0, stream, o, a.num_q_heads / hkv,
                         a.obs_window, d, value_scores));
    return Launch(ChannelTopKernel, hkv, 256, 0, stream, value_scores, d, a.value_channels,
                  a.value_idx);
  }
  return Launch(IotaKernel, (hkv * a.value_channels + 255) / 256, 256, 0, stream, hkv,
                a.value_channels, a.value_idx);
}

}  // namespace kvc::cuda

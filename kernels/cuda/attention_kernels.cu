// Decode attention directly over the packed blob: pruned key channels are absent from the dot
// product, pruned value channels contribute zero, quantized blocks are dequantized on the fly,
// and the uncompressed new tokens are attended causally after the cache.
//
// Two implementations with the same semantics: the split kernel (DecodeChunkKernel +
// DecodeCombineKernel, planned by cuda/decode_plan.h) reads every packed byte once, as 16-lane
// coalesced rows with fused dequantization, for all query heads of a KV head at once; the generic
// kernel (PackedAttentionKernel, one block per query row) covers every other shape.
#include "cuda/cuda_common.cuh"
#include "cuda/decode_plan.h"
#include "cuda/reduce.cuh"

namespace kvc::cuda {
namespace {

__device__ __forceinline__ uint32_t CodeAt(const uint8_t* row, int i, int bits) {
  const int bit = i * bits;
  return (row[bit >> 3] >> (bit & 7)) & ((1u << bits) - 1u);
}

template <typename T>
__device__ __forceinline__ const T* At(const uint8_t* blob, uint64_t off) {
  return reinterpret_cast<const T*>(blob + off);
}

// One block per (query head, query row). Scores: one warp per token, lanes over the channels, so
// that a row's loads are coalesced; values: one thread per channel (consecutive threads read
// consecutive elements of a row).
template <typename E>
__global__ void PackedAttentionKernel(AttnArgs a) {
  using T = typename E::T;
  __shared__ float sq[256];
  __shared__ int vinv[256];
  __shared__ float red[32];
  const int hq = blockIdx.x / a.n_q, i = blockIdx.x % a.n_q;
  const int group = a.num_q_heads / a.num_kv_heads;
  const int h = hq / group;
  const AttnHead hd = a.heads[h];
  const int d = a.head_dim, m = hd.n_kept - hd.n_recent;
  const int n_new_vis = a.n_new - a.n_q + i + 1;
  const int total = hd.n_kept + n_new_vis;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  const int32_t* kidx = At<int32_t>(a.blob, hd.key_idx);
  const int32_t* vidx = At<int32_t>(a.blob, hd.value_idx);
  const int kq_bytes = (hd.key_channels * a.bits + 7) / 8;
  const int vbits = a.value_bits;
  const int vq_bytes = (hd.value_channels * vbits + 7) / 8;
  // Written without Tv + G - 1: G comes from the blob header and may be as large as INT32_MAX.
  const int v_groups =
      vbits > 0 && hd.value_channels > 0 ? 1 + (hd.value_channels - 1) / a.group : 0;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    sq[c] = a.q[(static_cast<size_t>(hq) * a.n_q + i) * d + c];
    vinv[c] = -1;
  }
  __syncthreads();
  for (int c = threadIdx.x; c < hd.value_channels; c += blockDim.x) vinv[vidx[c]] = c;
  float* p = a.scratch + static_cast<size_t>(blockIdx.x) * (a.max_kept + a.n_new);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  float mx = -INFINITY;
  for (int t = warp; t < total; t += warps) {
    float s = 0.f;
    if (t < m) {
      if (a.bits == 0) {
        const T* row = At<T>(a.blob, hd.key_old) + static_cast<size_t>(t) * hd.key_channels;
        for (int c = lane; c < hd.key_channels; c += 32) s = fmaf(sq[kidx[c]], E::Load(row, c), s);
      } else {
        const float* sc =
            At<float>(a.blob, hd.key_scale) + static_cast<size_t>(t / a.group) * hd.key_channels;
        const float* ze =
            At<float>(a.blob, hd.key_zero) + static_cast<size_t>(t / a.group) * hd.key_channels;
        const uint8_t* row = At<uint8_t>(a.blob, hd.key_codes) + static_cast<size_t>(t) * kq_bytes;
        for (int c = lane; c < hd.key_channels; c += 32) {
          const float x = static_cast<float>(CodeAt(row, c, a.bits)) * sc[c] + ze[c];
          s = fmaf(sq[kidx[c]], x, s);
        }
      }
    } else if (t < hd.n_kept) {
      const T* row = At<T>(a.blob, hd.key_recent) + static_cast<size_t>(t - m) * d;
      for (int c = lane; c < d; c += 32) s = fmaf(sq[c], E::Load(row, c), s);
    } else {
      const float* row = a.k_new + (static_cast<size_t>(h) * a.n_new + (t - hd.n_kept)) * d;
      for (int c = lane; c < d; c += 32) s = fmaf(sq[c], row[c], s);
    }
    s = WarpSum(s) * scale;
    if (lane == 0) p[t] = s;
    mx = fmaxf(mx, s);
  }
  // The barriers inside BlockReduce also make every warp's p[] visible to the whole block.
  mx = BlockReduce<true>(mx, red);
  float sum = 0.f;
  for (int t = threadIdx.x; t < total; t += blockDim.x) {
    const float e = expf(p[t] - mx);
    p[t] = e;
    sum += e;
  }
  sum = BlockReduce<false>(sum, red);
  const float inv = 1.0f / sum;
  for (int c = threadIdx.x; c < d; c += blockDim.x) {
    float acc = 0.f;
    const int ci = vinv[c];
    if (ci >= 0) {
      for (int t = 0; t < m; ++t) {
        float x;
        if (vbits == 0) {
          x = E::Load(At<T>(a.blob, hd.value_old) + static_cast<size_t>(t) * hd.value_channels, ci);
        } else {
          const size_t g = static_cast<size_t>(t) * v_groups + ci / a.group;
          const uint8_t* row =
              At<uint8_t>(a.blob, hd.value_codes) + static_cast<size_t>(t) * vq_bytes;
          x = static_cast<float>(CodeAt(row, ci, vbits)) * At<float>(a.blob, hd.value_scale)[g] +
              At<float>(a.blob, hd.value_zero)[g];
        }
        acc = fmaf(p[t], x, acc);
      }
    }
    const T* vr = At<T>(a.blob, hd.value_recent);
    for (int t = m; t < hd.n_kept; ++t) {
      acc = fmaf(p[t], E::Load(vr, static_cast<size_t>(t - m) * d + c), acc);
    }
    for (int t = hd.n_kept; t < total; ++t) {
      acc = fmaf(p[t], a.v_new[(static_cast<size_t>(h) * a.n_new + (t - hd.n_kept)) * d + c], acc);
    }
    a.out[(static_cast<size_t>(hq) * a.n_q + i) * d + c] = acc * inv;
  }
}

// ---- split decode attention ----
//
// Block: 128 threads = 8 teams of 16 lanes. A chunk of C kept tokens (all old or all recent) is
// read in batches of kDecBatch consecutive rows, dealt round-robin to the teams (batch b to team
// b % 8). Lane l of a team owns the 8 channels [8l, 8l + 8) of every row (compact channel indices
// in old blocks, head channels in recent ones), so a team reads a row as 16 consecutive slots:
// 16 bytes each for fp16/bf16, or `bits` bytes of codes. Every slot is aligned to its size: the
// plan requires channel counts that are multiples of 8 and every block of the blob starts 16-byte
// aligned. A batch starts at a multiple of kDecBatch within its block and quantization groups are
// multiples of 8, so a batch never straddles a key group: the query is rescaled once per batch at
// most, outside the unrolled rows (this, and batches of 4 rows, keep the kernel near 100
// registers, where 16-row unrolling with a per-row group check took up to 254).
//
// The value sums of the 8 teams are combined in a fixed order (the two teams of a warp with one
// shuffle, then the four warps through shared memory), never with atomics: the result repeats run
// to run.
constexpr int kDecLanes = 16;
constexpr int kDecThreads = kDecodeTeams * kDecLanes;
constexpr int kDecWarps = kDecThreads / 32;
constexpr int kDecBatch = 4;  // rows per batch (loaded together)
static_assert(kDecLanes * 8 == kDecodeMaxHeadDim, "a team covers head_dim channels");
static_assert(kDecodeMaxChunk % kDecodeTeams == 0 && kDecodeMinChunk % kDecodeTeams == 0);
static_assert(kDecodeTeams % kDecBatch == 0, "chunks start at multiples of the batch");
// Blocks per multiprocessor the split kernel is compiled for, which caps its registers (65536 per
// SM): with 4 query rows per KV head (Llama-3's g = 4, one new token) 7 blocks for full-precision
// rows (<= 72 registers) and 6 for codes (<= 80), with 8 rows 4 blocks (<= 128); none of them
// spills on sm_80 or sm_90 (nvcc -Xptxas -v). Tighter caps spill.
template <int kBits, int kR>
constexpr int DecMinBlocks() {
  return kR <= 4 ? (kBits == 0 ? 7 : 6) : 4;
}

template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using Type = __half2;
  static __device__ __forceinline__ float2 Widen(Type v) { return __half22float2(v); }
};
template <>
struct Pair<__nv_bfloat16> {
  using Type = __nv_bfloat162;
  static __device__ __forceinline__ float2 Widen(Type v) { return __bfloat1622float2(v); }
};

// Bytes of one lane's slot in a row: 8 elements of 2 bytes, or 8 codes of kBits bits.
template <int kBits>
constexpr int SlotBytes() {
  return kBits == 0 ? 16 : kBits;
}

template <int kBits>
__device__ __forceinline__ uint4 LoadSlot(const uint8_t* p) {
  if constexpr (kBits == 0) {
    return __ldg(reinterpret_cast<const uint4*>(p));
  } else if constexpr (kBits == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    return make_uint4(v.x, v.y, 0u, 0u);
  } else if constexpr (kBits == 4) {
    return make_uint4(__ldg(reinterpret_cast<const unsigned int*>(p)), 0u, 0u, 0u);
  } else {
    return make_uint4(__ldg(reinterpret_cast<const unsigned short*>(p)), 0u, 0u, 0u);
  }
}

// The 8 values of a slot as floats: elements widened exactly (kBits == 0) or raw codes.
template <typename T, int kBits>
__device__ __forceinline__ void SlotValues(const uint4& w, float (&x)[8]) {
  if constexpr (kBits == 0) {
    using P = Pair<T>;
    const uint32_t u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      typename P::Type v;
      memcpy(&v, &u[i], sizeof(v));
      const float2 f = P::Widen(v);
      x[2 * i] = f.x;
      x[2 * i + 1] = f.y;
    }
  } else if constexpr (kBits == 8) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      x[k] = static_cast<float>(((k < 4 ? w.x : w.y) >> (8 * (k & 3))) & 0xffu);
    }
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      x[k] = static_cast<float>((w.x >> (kBits * k)) & ((1u << kBits) - 1u));
    }
  }
}

// Everything a chunk needs about its rows: kBits is the head's bits for old chunks, 0 for recent.
struct ChunkRows {
  const uint8_t* keys;    // row 0 of the chunk's key block (old: key_old or key_codes)
  const uint8_t* values;  // row 0 of the value block
  int key_row_bytes, value_row_bytes;
  int key_channels, value_channels;  // slots in use: channels / 8
  const int32_t* key_idx;            // old only: compact -> head channel (else null)
  const int32_t* value_idx;
  const float* key_scale;  // old quantized: [ceil(m/G), Tk]; scale, zero of group (t0 + t) / G
  const float* key_zero;
  const float* value_scale;  // old quantized: [m, ceil(Tv/G)]
  const float* value_zero;
  int t0;  // first row of the chunk within its block (for the quantization group)
};

// Scores of the team's batches of the chunk's nt rows for all kR query rows into s_p[rr][row]
// (scaled logits).
template <typename T, int kBits, int kR>
__device__ __forceinline__ void ChunkScores(const ChunkRows& cr, int group, int lane, int team,
                                            int nt, unsigned team_mask, float scale, int nr,
                                            const float (*s_q)[kDecodeMaxHeadDim],
                                            float (*s_p)[kDecodeMaxChunk]) {
  const bool active = 8 * lane < cr.key_channels;
  // kBits == 0: qk = q[ch]. Quantized: qk = q[ch] * scale[group][c] and qz = sum q[ch] * zero,
  // so that q . (code * scale + zero) = qk . code + qz; refreshed when the batch's group changes.
  float qk[8][kR], qz[kR];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    int ch = 0;
    if (kBits == 0 && active) {
      ch = cr.key_idx != nullptr ? __ldg(cr.key_idx + 8 * lane + k) : 8 * lane + k;
    }
#pragma unroll
    for (int r = 0; r < kR; ++r) qk[k][r] = kBits == 0 && active ? s_q[r][ch] : 0.f;
  }
#pragma unroll
  for (int r = 0; r < kR; ++r) qz[r] = 0.f;
  int cur_group = -1;
  const uint8_t* lane_keys = cr.keys + lane * SlotBytes<kBits>();
  for (int t = team * kDecBatch; t < nt; t += kDecodeTeams * kDecBatch) {
    if constexpr (kBits > 0) {
      const int grp = (cr.t0 + t) / group;  // the whole batch's group
      if (grp != cur_group && active) {
        cur_group = grp;
        const float* sc = cr.key_scale + static_cast<size_t>(grp) * cr.key_channels + 8 * lane;
        const float* ze = cr.key_zero + static_cast<size_t>(grp) * cr.key_channels + 8 * lane;
#pragma unroll
        for (int r = 0; r < kR; ++r) qz[r] = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const int ch = __ldg(cr.key_idx + 8 * lane + k);
          const float sk = __ldg(sc + k), zk = __ldg(ze + k);
#pragma unroll
          for (int r = 0; r < kR; ++r) {
            const float q = s_q[r][ch];
            qk[k][r] = q * sk;
            qz[r] = fmaf(q, zk, qz[r]);
          }
        }
      }
    }
    uint4 w[kDecBatch];
#pragma unroll
    for (int u = 0; u < kDecBatch; ++u) {
      w[u] = make_uint4(0u, 0u, 0u, 0u);
      if (active && t + u < nt) {
        w[u] = LoadSlot<kBits>(lane_keys + static_cast<size_t>(t + u) * cr.key_row_bytes);
      }
    }
#pragma unroll
    for (int u = 0; u < kDecBatch; ++u) {
      const int row = t + u;
      if (row >= nt) break;  // uniform within the team
      float x[8];
      SlotValues<T, kBits>(w[u], x);
      float dot[kR];
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        float acc = qz[r];
#pragma unroll
        for (int k = 0; k < 8; ++k) acc = fmaf(qk[k][r], x[k], acc);
        dot[r] = acc;
      }
#pragma unroll
      for (int o = kDecLanes / 2; o > 0; o >>= 1) {
#pragma unroll
        for (int r = 0; r < kR; ++r) dot[r] += __shfl_xor_sync(team_mask, dot[r], o);
      }
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        if (lane == r && r < nr) s_p[r][row] = dot[r] * scale;
      }
    }
  }
}

// This lane's share of sum over the team's rows of p[rr][row] * value[row] (its 8 value slots),
// into acc (zero-point terms included).
template <typename T, int kBits, int kR>
__device__ __forceinline__ void ChunkValues(const ChunkRows& cr, int group, int lane, int team,
                                            int nt, int nr, const float (*s_p)[kDecodeMaxChunk],
                                            float (&acc)[8][kR]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
#pragma unroll
    for (int r = 0; r < kR; ++r) acc[k][r] = 0.f;
  }
  if (8 * lane >= cr.value_channels) return;  // no shuffles below: lanes may leave
  float zacc[kR];
#pragma unroll
  for (int r = 0; r < kR; ++r) zacc[r] = 0.f;
  // Quantized values: one (scale, zero) per row for this lane's 8 channels (group % 8 == 0).
  const int v_groups = kBits > 0 ? 1 + (cr.value_channels - 1) / group : 0;
  const int lane_group = kBits > 0 ? (8 * lane) / group : 0;
  const uint8_t* lane_values = cr.values + lane * SlotBytes<kBits>();
  for (int t = team * kDecBatch; t < nt; t += kDecodeTeams * kDecBatch) {
    uint4 w[kDecBatch];
    float vs[kDecBatch], vz[kDecBatch];
#pragma unroll
    for (int u = 0; u < kDecBatch; ++u) {
      w[u] = make_uint4(0u, 0u, 0u, 0u);
      vs[u] = vz[u] = 0.f;
      if (t + u < nt) {
        w[u] = LoadSlot<kBits>(lane_values + static_cast<size_t>(t + u) * cr.value_row_bytes);
        if constexpr (kBits > 0) {
          const size_t gi = static_cast<size_t>(cr.t0 + t + u) * v_groups + lane_group;
          vs[u] = __ldg(cr.value_scale + gi);
          vz[u] = __ldg(cr.value_zero + gi);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kDecBatch; ++u) {
      const int row = t + u;
      if (row >= nt) break;
      float x[8];
      SlotValues<T, kBits>(w[u], x);
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        const float p = r < nr ? s_p[r][row] : 0.f;
        float pk = p;
        if constexpr (kBits > 0) {
          pk = p * vs[u];
          zacc[r] = fmaf(p, vz[u], zacc[r]);
        }
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[k][r] = fmaf(pk, x[k], acc[k][r]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) {
#pragma unroll
    for (int r = 0; r < kR; ++r) acc[k][r] += zacc[r];
  }
}

template <typename E, int kBits, int kR>
__global__ void __launch_bounds__(kDecThreads, DecMinBlocks<kBits, kR>())
    DecodeChunkKernel(DecodeArgs a) {
  using T = typename E::T;
  static_assert(sizeof(T) == 2, "fp16/bf16 only");
  // One buffer, two lives: the query rows [kR][D] and the scores [kR][chunk] while the chunk is
  // read, then the four warps' value sums [4][kR][D] for the fixed-order combine.
  __shared__ float smem[kR * 4 * kDecodeMaxHeadDim];
  static_assert(kDecodeMaxHeadDim + kDecodeMaxChunk <= 4 * kDecodeMaxHeadDim);
  __shared__ float s_ml[kR][2];
  auto* s_q = reinterpret_cast<float(*)[kDecodeMaxHeadDim]>(smem);
  auto* s_p = reinterpret_cast<float(*)[kDecodeMaxChunk]>(smem + kR * kDecodeMaxHeadDim);
  auto* s_part = reinterpret_cast<float(*)[kR][kDecodeMaxHeadDim]>(smem);
  const int c = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const DecodeSeq seq = a.seqs[b];
  const AttnHead hd = seq.heads[h];
  const int m = hd.n_kept - hd.n_recent, chunk = a.chunk;
  const int co = (m + chunk - 1) / chunk, cr = (hd.n_recent + chunk - 1) / chunk;
  if (c >= co + cr) return;  // this head keeps fewer tokens than the longest one
  const bool old = c < co;
  const int t0 = old ? c * chunk : (c - co) * chunk;  // first row of the chunk in its block
  const int nt = min(chunk, (old ? m : hd.n_recent) - t0);
  const int d = a.head_dim, g = a.num_q_heads / a.num_kv_heads, nr = g * a.n_q;
  const int tid = threadIdx.x, lane = tid % kDecLanes, team = tid / kDecLanes;
  const int warp = tid / 32, wl = tid % 32;
  const uint8_t* blob = seq.blob;

  for (int e = tid; e < kR * kDecodeMaxHeadDim; e += kDecThreads) {
    const int rr = e / kDecodeMaxHeadDim, ch = e % kDecodeMaxHeadDim;
    float v = 0.f;
    if (rr < nr && ch < d) {
      const int hq = h * g + rr / a.n_q, i = rr % a.n_q;
      v = seq.q[(static_cast<size_t>(hq) * a.n_q + i) * d + ch];
    }
    s_q[rr][ch] = v;
  }
  __syncthreads();

  const unsigned team_mask = 0xffffu << (16 * (team & 1));
  const float scale = 1.0f / sqrtf(static_cast<float>(d));
  ChunkRows rows;
  rows.t0 = t0;
  if (old) {
    rows.key_channels = hd.key_channels;
    rows.value_channels = hd.value_channels;
    rows.key_idx = reinterpret_cast<const int32_t*>(blob + hd.key_idx);
    rows.value_idx = reinterpret_cast<const int32_t*>(blob + hd.value_idx);
    rows.key_row_bytes = kBits == 0 ? 2 * hd.key_channels : hd.key_channels * kBits / 8;
    rows.value_row_bytes = kBits == 0 ? 2 * hd.value_channels : hd.value_channels * kBits / 8;
    rows.keys = blob + (kBits == 0 ? hd.key_old : hd.key_codes) +
                static_cast<size_t>(t0) * rows.key_row_bytes;
    rows.values = blob + (kBits == 0 ? hd.value_old : hd.value_codes) +
                  static_cast<size_t>(t0) * rows.value_row_bytes;
    rows.key_scale = reinterpret_cast<const float*>(blob + hd.key_scale);
    rows.key_zero = reinterpret_cast<const float*>(blob + hd.key_zero);
    rows.value_scale = reinterpret_cast<const float*>(blob + hd.value_scale);
    rows.value_zero = reinterpret_cast<const float*>(blob + hd.value_zero);
    ChunkScores<T, kBits, kR>(rows, a.group, lane, team, nt, team_mask, scale, nr, s_q, s_p);
  } else {
    rows.key_channels = rows.value_channels = d;
    rows.key_idx = rows.value_idx = nullptr;
    rows.key_row_bytes = rows.value_row_bytes = 2 * d;
    rows.keys = blob + hd.key_recent + static_cast<size_t>(t0) * rows.key_row_bytes;
    rows.values = blob + hd.value_recent + static_cast<size_t>(t0) * rows.value_row_bytes;
    rows.key_scale = rows.key_zero = rows.value_scale = rows.value_zero = nullptr;
    ChunkScores<T, 0, kR>(rows, 1, lane, team, nt, team_mask, scale, nr, s_q, s_p);
  }
  __syncthreads();

  // Partial softmax of each query row over the chunk: max, exp, sum (warp w: rows w, w + 4, ..).
  for (int r = warp; r < nr; r += kDecWarps) {
    float mx = -INFINITY;
    for (int j = wl; j < nt; j += 32) mx = fmaxf(mx, s_p[r][j]);
    mx = WarpMax(mx);
    float sum = 0.f;
    for (int j = wl; j < nt; j += 32) {
      const float e = expf(s_p[r][j] - mx);
      s_p[r][j] = e;
      sum += e;
    }
    sum = WarpSum(sum);
    if (wl == 0) {
      s_ml[r][0] = mx;
      s_ml[r][1] = sum;
    }
  }
  __syncthreads();

  float acc[8][kR];
  if (old) {
    ChunkValues<T, kBits, kR>(rows, a.group, lane, team, nt, nr, s_p, acc);
  } else {
    ChunkValues<T, 0, kR>(rows, 1, lane, team, nt, nr, s_p, acc);
  }
  // Teams 2w and 2w + 1 (lanes l and l + 16 of warp w) own the same channels: one shuffle adds
  // the pair, and both lanes get the same sum (IEEE addition commutes).
  __syncwarp();
#pragma unroll
  for (int k = 0; k < 8; ++k) {
#pragma unroll
    for (int r = 0; r < kR; ++r) acc[k][r] += __shfl_xor_sync(0xffffffffu, acc[k][r], 16);
  }
  __syncthreads();  // every read of s_q and s_p is done: smem becomes s_part
  for (int e = tid; e < 4 * kR * kDecodeMaxHeadDim; e += kDecThreads) smem[e] = 0.f;
  __syncthreads();
  if ((team & 1) == 0 && 8 * lane < rows.value_channels) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int ch = rows.value_idx != nullptr ? rows.value_idx[8 * lane + k] : 8 * lane + k;
#pragma unroll
      for (int r = 0; r < kR; ++r) {
        if (r < nr) s_part[warp][r][ch] = acc[k][r];
      }
    }
  }
  __syncthreads();

  // Partial row: D unnormalized outputs (the warps' sums in a fixed order), then max and sum.
  const int stride = d + 2;
  float* dst =
      a.partial + ((static_cast<size_t>(b) * a.num_kv_heads + h) * a.max_chunks + c) * nr * stride;
  for (int e = tid; e < nr * stride; e += kDecThreads) {
    const int r = e / stride, x = e % stride;
    dst[e] = x < d ? (s_part[0][r][x] + s_part[1][r][x]) + (s_part[2][r][x] + s_part[3][r][x])
                   : s_ml[r][x - d];
  }
}

// One block per (query row, sequence): merges the chunk partials of the row's KV head with the
// uncompressed new tokens it sees (causal). blockDim.x == kDecThreads >= head_dim.
__global__ void __launch_bounds__(kDecThreads) DecodeCombineKernel(DecodeArgs a) {
  __shared__ float s_new[kDecodeMaxNew];
  __shared__ float s_w[kDecThreads];
  __shared__ float red[32];
  const int b = blockIdx.y, hq = blockIdx.x / a.n_q, i = blockIdx.x % a.n_q;
  const int g = a.num_q_heads / a.num_kv_heads, h = hq / g, r = (hq % g) * a.n_q + i;
  const int d = a.head_dim, nr = g * a.n_q, stride = d + 2, tid = threadIdx.x;
  const DecodeSeq seq = a.seqs[b];
  const AttnHead hd = seq.heads[h];
  const int m = hd.n_kept - hd.n_recent;
  const int n_chunks = (m + a.chunk - 1) / a.chunk + (hd.n_recent + a.chunk - 1) / a.chunk;
  const float* part = a.partial +
                      (static_cast<size_t>(b) * a.num_kv_heads + h) * a.max_chunks * nr * stride +
                      static_cast<size_t>(r) * stride;
  const size_t chunk_stride = static_cast<size_t>(nr) * stride;
  const float* q = seq.q + (static_cast<size_t>(hq) * a.n_q + i) * d;
  const int n_vis = a.n_new - a.n_q + i + 1;
  const float scale = 1.0f / sqrtf(static_cast<float>(d));

  // Scores of the visible new tokens: one warp per token.
  const int warp = tid / 32, wl = tid % 32;
  for (int t = warp; t < n_vis; t += kDecThreads / 32) {
    const float* k = seq.k_new + (static_cast<size_t>(h) * a.n_new + t) * d;
    float s = 0.f;
    for (int ch = wl; ch < d; ch += 32) s = fmaf(q[ch], k[ch], s);
    s = WarpSum(s);
    if (wl == 0) s_new[t] = s * scale;
  }
  __syncthreads();
  float mx = -INFINITY;
  for (int x = tid; x < n_chunks; x += kDecThreads) mx = fmaxf(mx, part[x * chunk_stride + d]);
  for (int t = tid; t < n_vis; t += kDecThreads) mx = fmaxf(mx, s_new[t]);
  mx = BlockReduce<true>(mx, red);
  float sum = 0.f;
  for (int x = tid; x < n_chunks; x += kDecThreads) {
    const float cm = part[x * chunk_stride + d];
    if (cm != -INFINITY) sum += part[x * chunk_stride + d + 1] * expf(cm - mx);
  }
  for (int t = tid; t < n_vis; t += kDecThreads) sum += expf(s_new[t] - mx);
  sum = BlockReduce<false>(sum, red);

  float acc = 0.f;
  for (int x0 = 0; x0 < n_chunks; x0 += kDecThreads) {
    __syncthreads();  // s_w of the previous round is consumed
    if (x0 + tid < n_chunks) {
      const float cm = part[(x0 + tid) * chunk_stride + d];
      s_w[tid] = cm == -INFINITY ? 0.f : expf(cm - mx);
    }
    __syncthreads();
    if (tid < d) {
      const int n = min(kDecThreads, n_chunks - x0);
      for (int x = 0; x < n; ++x) acc = fmaf(s_w[x], part[(x0 + x) * chunk_stride + tid], acc);
    }
  }
  if (tid < d) {
    for (int t = 0; t < n_vis; ++t) {
      acc = fmaf(expf(s_new[t] - mx), seq.v_new[(static_cast<size_t>(h) * a.n_new + t) * d + tid],
                 acc);
    }
    seq.out[(static_cast<size_t>(hq) * a.n_q + i) * d + tid] = acc / sum;
  }
}

template <typename E, int kBits, int kR>
cudaError_t LaunchDecodeT(const DecodeArgs& a, cudaStream_t stream) {
  if (a.max_chunks > 0) {
    KVC_CUDA_CALL(Launch(DecodeChunkKernel<E, kBits, kR>,
                         dim3(a.max_chunks, a.num_kv_heads, a.batch), kDecThreads, 0, stream, a));
  }
  return Launch(DecodeCombineKernel, dim3(a.num_q_heads * a.n_q, a.batch), kDecThreads, 0, stream,
                a);
}

template <typename E, int kR>
cudaError_t LaunchDecodeBits(const DecodeArgs& a, cudaStream_t stream) {
  switch (a.bits) {
    case 0:
      return LaunchDecodeT<E, 0, kR>(a, stream);
    case 2:
      return LaunchDecodeT<E, 2, kR>(a, stream);
    case 4:
      return LaunchDecodeT<E, 4, kR>(a, stream);
    case 8:
      return LaunchDecodeT<E, 8, kR>(a, stream);
  }
  return cudaErrorInvalidValue;
}

template <typename E>
cudaError_t LaunchDecodeRows(const DecodeArgs& a, cudaStream_t stream) {
  return a.row_tile == 4 ? LaunchDecodeBits<E, 4>(a, stream) : LaunchDecodeBits<E, 8>(a, stream);
}

}  // namespace

size_t AttnScratchFloats(int num_q_heads, int n_q, int max_kept, int n_new) {
  return static_cast<size_t>(num_q_heads) * n_q * (static_cast<size_t>(max_kept) + n_new);
}

cudaError_t LaunchPackedAttention(const AttnArgs& a, cudaStream_t stream) {
  if (a.n_q < 1 || a.num_q_heads < 1 || a.head_dim < 8 || a.head_dim > 256) {
    return cudaErrorInvalidValue;
  }
  return KVC_DISPATCH_DTYPE(a.dtype, E, [&] {
    return Launch(PackedAttentionKernel<E>, a.num_q_heads * a.n_q, 128, 0, stream, a);
  });
}

cudaError_t LaunchDecodeAttention(const DecodeArgs& a, cudaStream_t stream) {
  const int g = a.num_kv_heads > 0 ? a.num_q_heads / a.num_kv_heads : 0;
  if ((a.dtype != ElemType::kF16 && a.dtype != ElemType::kBF16) || a.num_kv_heads < 1 || g < 1 ||
      a.num_q_heads % a.num_kv_heads != 0 || a.head_dim < 8 || a.head_dim % 8 != 0 ||
      a.head_dim > kDecodeMaxHeadDim || a.n_q < 1 || a.n_new < a.n_q || a.n_new > kDecodeMaxNew ||
      a.batch < 1 || (a.row_tile != 4 && a.row_tile != 8) || g * a.n_q > a.row_tile ||
      a.chunk < kDecodeMinChunk || a.chunk > kDecodeMaxChunk || a.chunk % kDecodeTeams != 0 ||
      a.max_chunks < 0 || (a.bits > 0 && (a.group < 8 || a.group % 8 != 0)) || a.seqs == nullptr ||
      (a.max_chunks > 0 && a.partial == nullptr)) {
    return cudaErrorInvalidValue;
  }
  return a.dtype == ElemType::kF16 ? LaunchDecodeRows<F16>(a, stream)
                                   : LaunchDecodeRows<BF16>(a, stream);
}

}  // namespace kvc::cuda

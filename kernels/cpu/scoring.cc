// Attention scores of the observation queries (h2o, snapkv, keyformer: the policies' scorers and
// the dispatch are in scorers.cc). Attention-based policies compute, per KV head, the GEMM of the
// group's observation queries against all keys ([g*W, D] x [D, S], one 1024-key chunk at a time;
// the logits path of ScoringLogitsPath, cpu/engine.h: fp32 multiply-adds on AVX2 and AVX-512,
// cpu/f32_logits.h, OpenBLAS sgemm on fp32 copies below them; on AMX the same products from bf16
// tiles, and on AVX-512 BF16 a bf16 layer's exact products from bf16 dot products,
// cpu/amx_logits.h; with ScoringMath::kInteger int8 products from AVX2 up (AVX-512 VNNI or
// AVX2's vpmaddubsw), cpu/int8_logits.h), then a causal row softmax (online over the chunks)
// whose rows are accumulated into the head's score. Query rows are processed in blocks so the
// logits buffer stays bounded even when W == S.
#include <cblas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cpu/amx_logits.h"
#include "cpu/engine.h"
#include "cpu/f32_logits.h"
#include "cpu/int8_logits.h"
#include "cpu/score_extra.h"
#include "cpu/simd.h"
#include "kvc/convert.h"
#include "kvc/cost.h"
#include "kvc/noise.h"
#include "kvc/selection.h"
#include "kvc/status_macros.h"

namespace kvc::cpu {
namespace {

constexpr int kTokenChunk = kScoreTokenChunk;

// The first 64-byte-aligned address at or after p (p's buffer must have 15 floats of slack).
float* AlignUp64(float* p) {
  return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t{63});
}

// 1-D pooling over x[0, n) with an odd kernel, same-size output, window clipped at the edges
// (max: max of the in-range values; avg: their mean).
void Pool1D(float* x, int n, int kernel, PoolKind kind, ScratchArray& scratch) {
  if (kernel <= 1 || n <= 1) return;
  float* tmp = scratch.Get<float>(static_cast<size_t>(n));
  std::copy_n(x, n, tmp);
  const int half = kernel / 2;
  for (int j = 0; j < n; ++j) {
    const int lo = std::max(0, j - half), hi = std::min(n - 1, j + half);
    if (kind == PoolKind::kMax) {
      float m = tmp[lo];
      for (int i = lo + 1; i <= hi; ++i) m = std::max(m, tmp[i]);
      x[j] = m;
    } else {
      float s = 0.0f;
      for (int i = lo; i <= hi; ++i) s += tmp[i];
      x[j] = s / static_cast<float>(hi - lo + 1);
    }
  }
}

// score[j] = (1/g) * sum over the group's query heads and observation rows of softmax(a)_j, where
// row t sees keys j <= S - W + t; keyformer adds Gumbel noise and divides by tau first. kvzip:
// the rows are reconstruction queries from after the context, each sees all S keys, and
// score[j] = max over the group's query heads and rows of softmax(a)_j, whose denominator also
// holds exp(in.q_stats[row]) when the client sent the rows' log-masses (spec.query_stats). With
// reconstruction passes (spec.pass_rows) a row's softmax runs over the first sink_tokens keys and
// its pass's chunk only, and it scores only those. With spec.top_rows = K > 1, kvzip's score is
// the mean of the K largest of those probabilities (absent ones count 0) instead of the largest.
void AttentionScoreHead(const LayerInput& in, const EvictionSpec& spec, int h, float* out) {
  const LayerShape& sh = in.shape;
  const int S = sh.seq_len, D = sh.head_dim, W = sh.obs_window, g = sh.group_size();
  const int rows = g * W;
  const bool recon = Policy(spec.policy).rows_after_context;
  Scratch& s = Scratch::ForThisThread();
  // Query rows are converted one block at a time, so neither they nor the block's logits grow
  // with W (kvc/cost.h: ScoreRowBlock).
  const int block = ScoreRowBlock(S, rows, D);
  float* q = s.q.Get<float>(static_cast<size_t>(block) * D);
  // AMX: the logits from bf16 hi/lo tiles instead of sgemm (same values to ~2^-16, see
  // cpu/amx_logits.h). bf16 keys are exact in one bf16 part: their lo products are skipped.
  // AVX-512 BF16 without tiles: bf16 layers' logits from one bf16 dot product per element pair
  // (exact products, fp32 sums; cpu/amx_logits.h), other dtypes on sgemm.
  // Int8 (ScoringMath::kInteger, AVX2 and up): keys rounded to 8 bits, queries to 8 (AVX-512
  // VNNI) or 7 (AVX2); the kernel picked once here, so that packing and products agree.
  const LogitsPath path = ScoringLogitsPath(in.dtype, D, in.scoring_math);
  const bool use_amx = path == LogitsPath::kAmx, use_dot = path == LogitsPath::kBf16Dot;
  const bool use_int8 = path == LogitsPath::kInt8Dot, use_f32 = path == LogitsPath::kF32Fma;
  const bool key_lo = in.dtype != DType::kBF16;
  uint16_t *q_hi = nullptr, *q_lo = nullptr, *k_hi = nullptr, *k_lo = nullptr;
  float* k = nullptr;  // the fp32 key chunk of the sgemm path, packed on the fp32 FMA path
  float* qf = nullptr;  // the fp32 FMA path's packed query rows
  // The int8 path's packed queries and keys with their scales (and the keys' offsets).
  uint8_t* q8 = nullptr;
  int8_t* k8 = nullptr;
  float *q8_scale = nullptr, *k8_scale = nullptr;
  int32_t* k8_offset = nullptr;
  const i8::Kernel i8_kernel = i8::ActiveKernel();
  if (path == LogitsPath::kSgemm) {
    k = s.k.Get<float>(static_cast<size_t>(std::min(S, kTokenChunk)) * D);
  } else if (use_f32) {
    // In the AMX chunk's and rows' scratch (as many bytes: 32-row and -key padding, 4 bytes an
    // element).
    k = s.amx_k.Get<float>(f32::PackedKeyElems(std::min(S, kTokenChunk), D));
    qf = s.amx_q.Get<float>(static_cast<size_t>(block) * D);
  } else if (use_int8) {
    const size_t keys = i8::PaddedKeys(std::min(S, kTokenChunk));
    q8_scale = s.amx_q.Get<float>(static_cast<size_t>(block) * (D / 4 + 1));
    q8 = reinterpret_cast<uint8_t*>(q8_scale + block);
    k8_scale = s.amx_k.Get<float>(keys * (D / 4 + 2));
    k8_offset = reinterpret_cast<int32_t*>(k8_scale + keys);
    k8 = reinterpret_cast<int8_t*>(k8_offset + keys);
  } else {
    const size_t qn = amx::PackedQueryElems(block, D);
    const size_t kn = amx::PackedKeyElems(std::min(S, kTokenChunk), D);
    q_hi = s.amx_q.Get<uint16_t>(2 * qn);
    q_lo = q_hi + qn;
    k_hi = s.amx_k.Get<uint16_t>((use_dot ? 1 : 2) * kn);
    k_lo = key_lo && use_amx ? k_hi + kn : nullptr;
  }

  std::fill(out, out + S, 0.0f);
  // kvzip with top_rows K > 1: per token its K largest probabilities so far, in K planes of S
  // (plane 0 the largest), so that the common case, below the K-th, is one contiguous compare.
  const int top_k = recon ? spec.top_rows : 1;
  float* top = nullptr;
  if (top_k > 1) {
    top = s.top.Get<float>(static_cast<size_t>(top_k) * S);
    std::fill(top, top + static_cast<size_t>(top_k) * S, 0.0f);
  }
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  const bool gumbel = spec.policy == EvictionPolicy::kKeyformer;
  const float inv_tau = static_cast<float>(1.0 / spec.tau);
  const bool unit_tau = spec.tau == 1.0;
  const float inv_g = 1.0f / static_cast<float>(g);
  const auto layer = static_cast<uint32_t>(in.layer_index);

  // Scores the rows of one span; false once the request is cancelled.
  const auto score_span = [&](const RowSpan& span) {
    // Keys [0, keys_seen(t)) (those of the span's pieces below) are visible to observation row t.
    const auto keys_seen = [&](int t) { return recon ? span.hi : S - W + t + 1; };
    for (int r0 = span.begin; r0 < span.end; r0 += block) {
      if (Cancelled(in)) return false;
      const int nr = std::min(block, span.end - r0);
      LoadQueryRows(in, h, r0, nr, q);
      if (use_amx) amx::PackQueries(q, nr, D, scale, q_hi, q_lo);
      if (use_int8) i8::PackQueries(i8_kernel, q, nr, D, scale, q8, q8_scale);
      if (use_f32) f32::PackQueries(q, nr, D, qf);
      // Unscaled (bf16 values, exact in one part): DotLogits scales the sums.
      if (use_dot) FromFloat(q, DType::kBF16, static_cast<size_t>(nr) * D, q_hi);
      // Keys past the last row's causal limit are never read: trim the GEMM to them.
      int max_len = 0;
      for (int r = r0; r < r0 + nr; ++r) max_len = std::max(max_len, keys_seen(r % W));
      // Online softmax over key chunks. Each chunk's GEMM writes its [nr, n] logits straight into
      // the chunk's slot of the block's buffer (chunk-major [chunks - 1][nr][kTokenChunk]; the last
      // chunk into `tile`), where each row's part is exponentiated against the row's running max
      // m_c and summed while it is still in L2; the final pass scales each part by
      // exp(m_c - m) / sum into the scores. Keys are converted one chunk at a time (an L2-sized
      // GEMM operand), re-converted per row block, which costs little next to the GEMM.
      // The block's key pieces (start, length), at most kTokenChunk each: the sinks', then the
      // span's [lo, max_len).
      std::vector<std::pair<int, int>>& pieces = s.pieces;
      pieces.clear();
      for (int c0 = 0; c0 < span.sink_end; c0 += kTokenChunk) {
        pieces.emplace_back(c0, std::min(kTokenChunk, span.sink_end - c0));
      }
      for (int c0 = span.lo; c0 < max_len; c0 += kTokenChunk) {
        pieces.emplace_back(c0, std::min(kTokenChunk, max_len - c0));
      }
      const int chunks = static_cast<int>(pieces.size());
      const size_t slot = static_cast<size_t>(nr) * kTokenChunk;
      float* tile = s.tile.Get<float>(static_cast<size_t>(nr) * std::min(kTokenChunk, max_len));
      float* parked = AlignUp64(s.logits.Get<float>(slot * (chunks - 1) + 16));
      float* stats = s.row_max.Get<float>(static_cast<size_t>(nr) * (chunks + 2));
      float* row_max = stats;
      float* row_sum = stats + nr;
      float* shift = stats + 2 * static_cast<size_t>(nr);  // [nr, chunks]: m_c per chunk
      std::fill(row_max, row_max + nr, -std::numeric_limits<float>::infinity());
      std::fill(row_sum, row_sum + nr, 0.0f);
      if (recon && spec.query_stats && in.q_stats != nullptr) {
        // kvzip with the rows' log-masses over keys not uploaded (their own reconstruction
        // tokens): that mass starts the softmax's denominator, exp(lse - m) with m = lse.
        for (int r = r0; r < r0 + nr; ++r) {
          row_max[r - r0] = in.q_stats[static_cast<size_t>(h * g + r / W) * W + r % W];
          row_sum[r - r0] = 1.0f;
        }
      }
      for (int c = 0; c < chunks; ++c) {
        if (Cancelled(in)) return false;
        const auto [c0, n] = pieces[static_cast<size_t>(c)];
        if (path == LogitsPath::kSgemm) LoadHeadRows(in, /*values=*/false, h, c0, n, k);
        // All but the last chunk: the GEMM writes straight into the chunk's parked slot (it stays
        // in L2 for the passes below); the last one into the tile the final pass reads.
        float* dst = c + 1 < chunks ? parked + c * slot : tile;
        if (path != LogitsPath::kSgemm) {
          // Straight from the cache's rows (no fp32 copy of the chunk).
          size_t stride = 0;
          const uint8_t* rows = HeadRows(in, /*values=*/false, h, c0, &stride);
          const auto ldc = static_cast<size_t>(n);
          if (use_f32) {
            f32::PackKeys(rows, in.dtype, stride, n, D, k);
            f32::Logits(qf, nr, k, n, D, scale, dst, ldc);
          } else if (use_int8) {
            i8::PackKeys(i8_kernel, rows, in.dtype, stride, n, D, k8, k8_scale, k8_offset);
            i8::Logits(i8_kernel, q8, q8_scale, nr, k8, k8_scale, k8_offset, n, D, dst, ldc);
          } else {
            amx::PackKeys(rows, in.dtype, stride, n, D, k_hi, k_lo);
            if (use_amx) {
              amx::Logits(q_hi, q_lo, nr, k_hi, k_lo, n, D, dst, ldc);
            } else {
              amx::DotLogits(q_hi, nr, k_hi, n, D, scale, dst, ldc);
            }
          }
        } else {
          cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, nr, n, D, scale, q, D, k, D, 0.0f,
                      dst, n);
        }
        for (int r = r0; r < r0 + nr; ++r) {
          const int i = r - r0, t = r % W;
          const int valid = std::min(n, keys_seen(t) - c0);
          if (valid <= 0) continue;
          float* part = dst + static_cast<size_t>(i) * n;
          const auto q_head = static_cast<uint32_t>(h * g + r / W);
          const auto col0 = static_cast<uint32_t>(c0);
          // keyformer at tau != 1 needs the noisy values' max; otherwise the logits' max (at
          // tau = 1, exp(a + G - m) = exp(a - m) / -log(u) <= 2^25 for m >= max a).
          const float part_max =
              gumbel && !unit_tau
                  ? simd::AddGumbel(part, valid, spec.seed, layer, q_head, t, col0, inv_tau)
                  : simd::Max(part, valid);
          const float m = std::max(row_max[i], part_max);
          if (m > row_max[i]) {
            row_sum[i] *= std::exp(row_max[i] - m);  // exp(-inf) = 0 on the first chunk
            row_max[i] = m;
          }
          row_sum[i] += gumbel && unit_tau
                            ? simd::GumbelExpSum(part, valid, m, spec.seed, layer, q_head, t, col0)
                            : simd::ExpShiftSum(part, valid, m);
          shift[static_cast<size_t>(i) * chunks + c] = m;
        }
      }
      // Chunk by chunk, so that the chunk's scores stay in L1: the rows' common prefix as one
      // matrix-vector product (the scores read once per eight rows), then each row's remainder
      // (the causal staircase of the last W keys).
      float* coef = s.acc.Get<float>(static_cast<size_t>(nr));
      std::vector<const float*>& rows_of = s.rows;
      for (int c = 0; c < chunks; ++c) {
        const auto [c0, n] = pieces[static_cast<size_t>(c)];
        const bool last = c + 1 == chunks;
        rows_of.clear();
        int common = kTokenChunk;
        for (int r = r0; r < r0 + nr; ++r) {
          const int i = r - r0;
          const int valid = std::min(n, keys_seen(r % W) - c0);
          if (valid <= 0) continue;
          const float m_c = shift[static_cast<size_t>(i) * chunks + c];
          coef[rows_of.size()] = (recon ? 1.0f : inv_g) * std::exp(m_c - row_max[i]) / row_sum[i];
          rows_of.push_back(last ? tile + static_cast<size_t>(i) * n
                                 : parked + c * slot + static_cast<size_t>(i) * n);
          common = std::min(common, valid);
        }
        if (rows_of.empty()) continue;
        if (recon && top == nullptr) {
          // Every row sees the whole chunk: the maximum of the rows' probabilities.
          float* o = out + c0;
          for (size_t k = 0; k < rows_of.size(); ++k) {
            const float a = coef[k];
            const float* x = rows_of[k];
            for (int j = 0; j < common; ++j) o[j] = std::max(o[j], a * x[j]);
          }
          continue;
        }
        if (recon) {
          // The K largest: a probability above the K-th moves the smaller ones down a plane.
          float* t = top + c0;
          const float* kth = t + static_cast<size_t>(top_k - 1) * S;
          for (size_t k = 0; k < rows_of.size(); ++k) {
            const float a = coef[k];
            const float* x = rows_of[k];
            for (int j = 0; j < common; ++j) {
              const float v = a * x[j];
              if (!(v > kth[j])) continue;
              int i = top_k - 1;
              for (; i > 0 && t[static_cast<size_t>(i - 1) * S + j] < v; --i) {
                t[static_cast<size_t>(i) * S + j] = t[static_cast<size_t>(i - 1) * S + j];
              }
              t[static_cast<size_t>(i) * S + j] = v;
            }
          }
          continue;
        }
        simd::AxpyRows(rows_of.data(), coef, static_cast<int>(rows_of.size()), out + c0,
                       static_cast<size_t>(common));
        for (int r = r0, k = 0; r < r0 + nr; ++r) {
          const int valid = std::min(n, keys_seen(r % W) - c0);
          if (valid <= 0) continue;
          if (valid > common) {
            simd::Axpy(coef[k], rows_of[k] + common, out + c0 + common,
                       static_cast<size_t>(valid - common));
          }
          ++k;
        }
      }
    }
    return true;
  };
  // The group's rows in spans that see the same keys: one span of every row over [0, S) (causal
  // rows stop earlier) unless kvzip's rows come from passes; then one span per query head and
  // pass, over the sinks ([0, min(sink_tokens, lo))) and the pass's chunk [lo, hi).
  if (recon && !spec.pass_rows.empty()) {
    for (int i = 0; i < g; ++i) {
      int first = i * W;
      for (size_t p = 0; p < spec.pass_rows.size(); ++p) {
        const PassKeys keys = PassKeyRange(spec, S, p);
        const RowSpan span{first, first + spec.pass_rows[p], keys.sink_end, keys.lo, keys.hi};
        if (!score_span(span)) return;
        first = span.end;
      }
    }
  } else if (!score_span(RowSpan{0, rows, 0, 0, S})) {
    return;
  }
  if (top != nullptr) {
    // The mean of each token's K largest, summed from the largest down.
    const float inv_k = 1.0f / static_cast<float>(top_k);
    for (int j = 0; j < S; ++j) {
      float sum = 0.0f;
      for (int i = 0; i < top_k; ++i) sum += top[static_cast<size_t>(i) * S + j];
      out[j] = sum * inv_k;
    }
  }
  if (spec.policy == EvictionPolicy::kSnapKV) {
    // SnapKV pools the prefix only; the observation window is kept unconditionally.
    Pool1D(out, S - W, spec.pool_kernel, spec.pool, s.acc);
  }
}

}  // namespace

LogitsPath ScoringLogitsPath(DType dtype, int head_dim, ScoringMath math) {
  if (amx::Usable(head_dim)) return LogitsPath::kAmx;
  if (math == ScoringMath::kInteger && i8::Usable(head_dim)) return LogitsPath::kInt8Dot;
  if (dtype == DType::kBF16 && amx::DotUsable(head_dim)) return LogitsPath::kBf16Dot;
  if (f32::Usable(head_dim)) return LogitsPath::kF32Fma;
  return LogitsPath::kSgemm;
}

std::string_view LogitsPathName(LogitsPath path) {
  switch (path) {
    case LogitsPath::kSgemm:
      return "sgemm fp32";
    case LogitsPath::kBf16Dot:
      return "avx512-bf16 dot products";
    case LogitsPath::kAmx:
      return "amx tiles (bf16 hi/lo)";
    case LogitsPath::kInt8Dot:
      return i8::ActiveKernel() == i8::Kernel::kVnni ? "avx512-vnni int8 dot products"
                                                     : "avx2 int8 dot products (7-bit queries)";
    case LogitsPath::kF32Fma:
      return CpuIsaAtLeast(CpuIsa::kAvx512) ? "avx512 fp32 fma" : "avx2 fp32 fma";
  }
  return "unknown";
}

void PrepareBlas(const ThreadPool* pool) {
  if (pool->num_threads() > 1 && openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

void LoadQueryRows(const LayerInput& in, int h, int first, int count, float* dst) {
  const LayerShape& sh = in.shape;
  const int D = sh.head_dim, W = sh.obs_window, g = sh.group_size(), Hq = sh.num_q_heads;
  const size_t esize = DTypeSize(in.dtype);
  const auto* base = static_cast<const uint8_t*>(in.q_obs);
  // Runs of rows within one query head: HND [Hq, W, D] is contiguous per head (and the group's
  // heads follow each other); NHD [W, Hq, D] strides by Hq * D between a head's rows.
  for (int r = first; r < first + count;) {
    const int i = r / W, t = r % W;
    const int n = std::min(first + count - r, W - t);
    const int qh = h * g + i;
    float* out = dst + static_cast<size_t>(r - first) * D;
    if (in.layout == Layout::kHND) {
      ToFloat(base + ((static_cast<size_t>(qh) * W + t) * D) * esize, in.dtype,
              static_cast<size_t>(n) * D, out);
    } else {
      RowsToFloat(base + ((static_cast<size_t>(t) * Hq + qh) * D) * esize, in.dtype,
                  static_cast<size_t>(Hq) * D, n, D, out);
    }
    r += n;
  }
}

const uint8_t* HeadRows(const LayerInput& in, bool values, int h, int first, size_t* stride) {
  const LayerShape& sh = in.shape;
  const int S = sh.seq_len, D = sh.head_dim, H = sh.num_kv_heads;
  const auto* base = static_cast<const uint8_t*>(values ? in.v : in.k);
  const size_t offset = ElementOffset(in.layout, H, S, D, h, first, 0);
  *stride = in.layout == Layout::kHND ? D : static_cast<size_t>(H) * D;
  return base + offset * DTypeSize(in.dtype);
}

void LoadHeadRows(const LayerInput& in, bool values, int h, int first, int count, float* dst) {
  size_t stride = 0;
  const uint8_t* rows = HeadRows(in, values, h, first, &stride);
  RowsToFloat(rows, in.dtype, stride, count, in.shape.head_dim, dst);
}

void ObservedAttentionScores(const LayerInput& in, const EvictionSpec& spec, ThreadPool* pool,
                             float* out) {
  PrepareBlas(pool);
  const int S = in.shape.seq_len;
  pool->ParallelFor(in.shape.num_kv_heads, [&](int h) {
    ScratchTask task;
    AttentionScoreHead(in, spec, h, out + static_cast<size_t>(h) * S);
  });
}

}  // namespace kvc::cpu

namespace kvc {

std::string ScoringLogitsDescription(ScoringMath math) {
  std::vector<std::pair<cpu::LogitsPath, std::string>> paths;  // in first-seen order
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    const cpu::LogitsPath path = cpu::ScoringLogitsPath(t, 128, math);
    auto it =
        std::find_if(paths.begin(), paths.end(), [&](const auto& p) { return p.first == path; });
    if (it == paths.end()) it = paths.insert(paths.end(), {path, ""});
    absl::StrAppend(&it->second, it->second.empty() ? "" : " ", std::string(DTypeName(t)));
  }
  std::string out;
  for (const auto& [path, dtypes] : paths) {
    absl::StrAppend(&out, out.empty() ? "" : "; ", dtypes, ": ",
                    std::string(cpu::LogitsPathName(path)));
  }
  return out;
}

absl::StatusOr<std::vector<float>> ScoreTokens(const LayerInput& in, const EvictionSpec& spec) {
  RETURN_IF_ERROR(ValidateInput(in));
  CompressionSpec full;
  full.eviction = spec;
  RETURN_IF_ERROR(ValidateSpec(full, in.shape, in.layer_index));
  RETURN_IF_ERROR(ValidateSpecInput(full, in));
  return CallNoThrow([&]() -> absl::StatusOr<std::vector<float>> {
    std::vector<float> scores;
    cpu::ScoreTokensImpl(in, spec, ThreadPool::Default(), &scores);
    RETURN_IF_ERROR(cpu::CancelStatus(in));
    return scores;
  });
}

}  // namespace kvc

#include "kvc/contiguous_export.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/types/optional.h"
#include "kvc/convert.h"
#include "kvc/cpu_isa.h"
#include "kvc/dtype.h"
#include "kvc/spec.h"
#include "kvc/status_macros.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#include "core/convert_x86_inl.h"
#define KVC_TURN_X86 1
#endif

namespace kvc {

namespace {

// The turn of every key of a layer by -shift positions: one angle per channel pair.
struct Turn {
  std::vector<double> cs, sn;
  // The same per rotary channel i, for the fused kernels: out[i] = x[i] * ch_c[i] +
  // x[partner(i)] * ch_s[i], partner(i) the other channel of i's pair and ch_s = -sn on the
  // pair's first channel. x0 * c + x1 * (-s) rounds as x0 * c - x1 * s does, and x1 * c + x0 * s
  // as x0 * s + x1 * c: the same bits as RotateRowBody.
  std::vector<double> ch_c, ch_s;
  int half = 0;
  bool half_split = false;
};

// The turn under a validated `rope` of keys of head_dim d; nothing (no channel moves) when shift
// is 0 or no channel is rotary.
absl::optional<Turn> MakeTurn(const RopeParams& rope, int d, int shift) {
  const int rd = rope.rotary_dims == 0 ? d : rope.rotary_dims;
  Turn t;
  t.half = rd / 2;
  t.half_split = rope.half_split;
  if (shift == 0 || t.half == 0) return absl::nullopt;
  t.cs.resize(t.half);
  t.sn.resize(t.half);
  for (int p = 0; p < t.half; ++p) {
    const double freq = std::pow(rope.theta, -2.0 * p / rd);
    const double angle = -static_cast<double>(shift) / rope.linear_factor * freq;
    t.cs[p] = std::cos(angle);
    t.sn[p] = std::sin(angle);
  }
  t.ch_c.resize(2 * t.half);
  t.ch_s.resize(2 * t.half);
  for (int p = 0; p < t.half; ++p) {
    const int i0 = t.half_split ? p : 2 * p, i1 = t.half_split ? p + t.half : 2 * p + 1;
    t.ch_c[i0] = t.ch_c[i1] = t.cs[p];
    t.ch_s[i0] = -t.sn[p];
    t.ch_s[i1] = t.sn[p];
  }
  return t;
}

// Turns the pairs of one row (floats; only the first `half` pairs' channels move): in double,
// each result rounded to float once. The file is compiled with -ffp-contract=off
// (kernels/CMakeLists.txt): a fused multiply-add would round differently on FMA targets.
inline __attribute__((always_inline)) void RotateRowBody(const Turn& t, float* row) {
  const double* cs = t.cs.data();
  const double* sn = t.sn.data();
  if (t.half_split) {  // pairs (p, p + half): both halves contiguous
    float* lo = row;
    float* hi = row + t.half;
    for (int p = 0; p < t.half; ++p) {
      const double x0 = lo[p], x1 = hi[p];
      lo[p] = static_cast<float>(x0 * cs[p] - x1 * sn[p]);
      hi[p] = static_cast<float>(x0 * sn[p] + x1 * cs[p]);
    }
  } else {  // pairs (2p, 2p + 1)
    for (int p = 0; p < t.half; ++p) {
      const double x0 = row[2 * p], x1 = row[2 * p + 1];
      row[2 * p] = static_cast<float>(x0 * cs[p] - x1 * sn[p]);
      row[2 * p + 1] = static_cast<float>(x0 * sn[p] + x1 * cs[p]);
    }
  }
}

// The same loop vectorized for each instruction set (the compiler's own vectorization of the
// body; the same operations, so the same bits): 4 or 8 doubles at a time instead of 2.
void RotateRowPortable(const Turn& t, float* row) { RotateRowBody(t, row); }
#if defined(__x86_64__) || defined(_M_X64)
__attribute__((target("avx2"))) void RotateRowAvx2(const Turn& t, float* row) {
  RotateRowBody(t, row);
}
__attribute__((target("avx512f"))) void RotateRowAvx512(const Turn& t, float* row) {
  RotateRowBody(t, row);
}
#endif

using RotateRowFn = void (*)(const Turn&, float*);
RotateRowFn PickRotateRow() {
#if defined(__x86_64__) || defined(_M_X64)
  if (CpuIsaAtLeast(CpuIsa::kAvx512)) return RotateRowAvx512;
  if (CpuIsaAtLeast(CpuIsa::kAvx2)) return RotateRowAvx2;
#endif
  return RotateRowPortable;
}

#ifdef KVC_TURN_X86
#define KVC_TURN_AVX2_INL __attribute__((target("avx2,f16c"), always_inline)) inline

using convert_x86::LoadFloat8;
using convert_x86::StoreFloat8;
using convert_x86::LoadFloat16;
using convert_x86::StoreFloat16;

// x * c + partner * s on eight channels, in double, each rounded to float once.
KVC_TURN_AVX2_INL __m256 Turn8(__m256 x, __m256 partner, const double* c, const double* s) {
  const __m256d xl = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d xh = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  const __m256d pl = _mm256_cvtps_pd(_mm256_castps256_ps128(partner));
  const __m256d ph = _mm256_cvtps_pd(_mm256_extractf128_ps(partner, 1));
  const __m256d rl = _mm256_add_pd(_mm256_mul_pd(xl, _mm256_loadu_pd(c)),
                                   _mm256_mul_pd(pl, _mm256_loadu_pd(s)));
  const __m256d rh = _mm256_add_pd(_mm256_mul_pd(xh, _mm256_loadu_pd(c + 4)),
                                   _mm256_mul_pd(ph, _mm256_loadu_pd(s + 4)));
  return _mm256_set_m128(_mm256_cvtpd_ps(rh), _mm256_cvtpd_ps(rl));
}

// RotateRows in registers, straight from src to dst (no float buffer: a pass over the keys
// instead of three), for a turn whose rotary channels come in groups of eight (FusedTurnFits).
// Channels past the rotary ones are copied (the buffer path's trip through float leaves them as
// they are, NaN payloads aside).
template <DType T>
__attribute__((target("avx2,f16c"))) void TurnRowsAvx2(const Turn& t, int d, const uint8_t* src,
                                                      size_t rows, uint8_t* dst) {
  constexpr size_t kElem = T == DType::kF32 ? 4 : 2;
  const size_t row_bytes = static_cast<size_t>(d) * kElem;
  const int half = t.half, rd = 2 * half;
  const double* c = t.ch_c.data();
  const double* s = t.ch_s.data();
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* in = src + r * row_bytes;
    uint8_t* out = dst + r * row_bytes;
    if (t.half_split) {  // pairs (p, p + half): both halves read before either is written
      for (int i = 0; i < half; i += 8) {
        const __m256 lo = LoadFloat8<T>(in, i), hi = LoadFloat8<T>(in, half + i);
        StoreFloat8<T>(out, i, Turn8(lo, hi, c + i, s + i));
        StoreFloat8<T>(out, half + i, Turn8(hi, lo, c + half + i, s + half + i));
      }
    } else {  // pairs (2p, 2p + 1): the partner is the neighbour within the pair
      for (int i = 0; i < rd; i += 8) {
        const __m256 x = LoadFloat8<T>(in, i);
        StoreFloat8<T>(out, i, Turn8(x, _mm256_permute_ps(x, 0xb1), c + i, s + i));
      }
    }
    if (rd < d && in != out) {
      std::memcpy(out + static_cast<size_t>(rd) * kElem, in + static_cast<size_t>(rd) * kElem,
                  static_cast<size_t>(d - rd) * kElem);
    }
  }
}

// The same sixteen channels at a time with AVX-512 (twice the double lanes per instruction; the
// turn is bound by its arithmetic, engine_bench BM_TurnKeys), the same products, sums and
// roundings: the same bits.
#define KVC_TURN_AVX512_INL \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"), always_inline)) inline

KVC_TURN_AVX512_INL __m512d Low8(__m512 x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
KVC_TURN_AVX512_INL __m512d High8(__m512 x) {
  return _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

KVC_TURN_AVX512_INL __m512 Turn16(__m512 x, __m512 partner, const double* c, const double* s) {
  const __m512d rl = _mm512_add_pd(_mm512_mul_pd(Low8(x), _mm512_loadu_pd(c)),
                                   _mm512_mul_pd(Low8(partner), _mm512_loadu_pd(s)));
  const __m512d rh = _mm512_add_pd(_mm512_mul_pd(High8(x), _mm512_loadu_pd(c + 8)),
                                   _mm512_mul_pd(High8(partner), _mm512_loadu_pd(s + 8)));
  const __m512d lo = _mm512_castps_pd(_mm512_castps256_ps512(_mm512_cvtpd_ps(rl)));
  return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm512_cvtpd_ps(rh)), 1));
}

template <DType T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c"))) void TurnRowsAvx512(
    const Turn& t, int d, const uint8_t* src, size_t rows, uint8_t* dst) {
  constexpr size_t kElem = T == DType::kF32 ? 4 : 2;
  const size_t row_bytes = static_cast<size_t>(d) * kElem;
  const int half = t.half, rd = 2 * half;
  const double* c = t.ch_c.data();
  const double* s = t.ch_s.data();
  for (size_t r = 0; r < rows; ++r) {
    const uint8_t* in = src + r * row_bytes;
    uint8_t* out = dst + r * row_bytes;
    if (t.half_split) {
      for (int i = 0; i < half; i += 16) {
        const __m512 lo = LoadFloat16<T>(in, i), hi = LoadFloat16<T>(in, half + i);
        StoreFloat16<T>(out, i, Turn16(lo, hi, c + i, s + i));
        StoreFloat16<T>(out, half + i, Turn16(hi, lo, c + half + i, s + half + i));
      }
    } else {
      for (int i = 0; i < rd; i += 16) {
        const __m512 x = LoadFloat16<T>(in, i);
        StoreFloat16<T>(out, i, Turn16(x, _mm512_permute_ps(x, 0xb1), c + i, s + i));
      }
    }
    if (rd < d && in != out) {
      std::memcpy(out + static_cast<size_t>(rd) * kElem, in + static_cast<size_t>(rd) * kElem,
                  static_cast<size_t>(d - rd) * kElem);
    }
  }
}

// The AVX-512 kernel where the CPU has it and the rotary channels of each pair style come in
// groups of sixteen, else the AVX2 one.
template <DType T>
void TurnRowsX86(const Turn& t, int d, const uint8_t* src, size_t rows, uint8_t* dst) {
  if (CpuIsaAtLeast(CpuIsa::kAvx512) && (t.half_split ? t.half % 16 == 0 : t.half % 8 == 0)) {
    return TurnRowsAvx512<T>(t, d, src, rows, dst);
  }
  TurnRowsAvx2<T>(t, d, src, rows, dst);
}
#endif  // KVC_TURN_X86

// Whether the fused kernels take this turn: AVX2 and the rotary channels of each pair style in
// groups of eight.
bool FusedTurnFits(const Turn& t) {
#ifdef KVC_TURN_X86
  return CpuIsaAtLeast(CpuIsa::kAvx2) && (t.half_split ? t.half % 8 == 0 : t.half % 4 == 0);
#else
  (void)t;
  return false;
#endif
}

// `rows` rows of d elements of dt from src, turned, into dst (src == dst allowed). The fused
// kernels where they fit; otherwise blocks of rows go through a float buffer with the bulk
// conversions of kvc/convert.h (vectorized where the CPU allows): element-by-element loads and
// stores through a dtype switch made a contiguous download several times slower than a dense one.
// Channels past rotary_dims go through float and back unchanged.
void RotateRows(const Turn& t, DType dt, int d, const uint8_t* src, size_t rows, uint8_t* dst) {
#ifdef KVC_TURN_X86
  if (FusedTurnFits(t)) {
    switch (dt) {
      case DType::kF32:
        return TurnRowsX86<DType::kF32>(t, d, src, rows, dst);
      case DType::kF16:
        return TurnRowsX86<DType::kF16>(t, d, src, rows, dst);
      case DType::kBF16:
        return TurnRowsX86<DType::kBF16>(t, d, src, rows, dst);
    }
  }
#endif
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(dt);
  const size_t block_rows = std::max<size_t>(1, 16384 / static_cast<size_t>(d));
  std::vector<float> buf(std::min(block_rows, rows) * d);
  const RotateRowFn rotate = PickRotateRow();
  for (size_t r0 = 0; r0 < rows; r0 += block_rows) {
    const size_t nr = std::min(block_rows, rows - r0);
    ToFloat(src + r0 * row_bytes, dt, nr * d, buf.data());
    for (size_t r = 0; r < nr; ++r) rotate(t, buf.data() + r * d);
    FromFloat(buf.data(), dt, nr * d, dst + r0 * row_bytes);
  }
}

// Turns head h's keys of `layer` ([num_kv_heads, n_kept, head_dim]) in place.
void TurnHeadKeys(const Turn& t, int h, DenseLayer* layer) {
  const size_t rows = static_cast<size_t>(layer->n_kept);
  uint8_t* k = layer->k.data() + h * rows * layer->head_dim * DTypeSize(layer->dtype);
  RotateRows(t, layer->dtype, layer->head_dim, k, rows, k);
}

}  // namespace

absl::Status RotateKeys(const RopeParams& rope, int shift, DenseLayer* layer) {
  const int d = layer->head_dim;
  if (absl::Status s = ValidateRope(rope, d); !s.ok()) return s;
  const absl::optional<Turn> turn = MakeTurn(rope, d, shift);
  if (!turn) return absl::OkStatus();
  const size_t rows = static_cast<size_t>(layer->num_kv_heads) * layer->n_kept;
  if (layer->k.size() != rows * d * DTypeSize(layer->dtype)) {
    return absl::InvalidArgumentError("RotateKeys: key bytes do not match the layer's shape");
  }
  for (int h = 0; h < layer->num_kv_heads; ++h) TurnHeadKeys(*turn, h, layer);
  return absl::OkStatus();
}

absl::StatusOr<DenseExporter> MakeKeysContiguousExporter(const CompactLayerView& view,
                                                         const DenseRuns& runs,
                                                         const RopeParams& rope) {
  if (absl::Status s = ValidateRope(rope, view.head_dim()); !s.ok()) return s;
  const int heads = view.num_kv_heads();
  const int d = view.head_dim();
  const DType dt = view.dtype();
  const int n_kept = view.max_kept();
  const size_t row_bytes = static_cast<size_t>(d) * DTypeSize(dt);
  const size_t head_bytes = static_cast<size_t>(n_kept) * row_bytes;
  size_t total = 0;
  for (const auto& run : runs.k) {
    if (run.size() % row_bytes != 0) {
      return absl::InternalError("ExportKeysContiguous: a key run is not whole rows");
    }
    total += run.size();
  }
  if (total != static_cast<size_t>(heads) * head_bytes) {
    return absl::InternalError("ExportKeysContiguous: the key runs do not cover the layer");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<DenseLayer> layer, AllocateDenseExport(view, /*values=*/false));
  // Piece h: bytes [h, h + 1) * head_bytes of the runs laid end to end (runs are whole rows and
  // may span heads), turned into the same bytes of `k`.
  const absl::optional<Turn> turn = MakeTurn(rope, d, layer->seq_len - n_kept);
  std::vector<absl::Span<const uint8_t>> k = runs.k;
  return DenseExporter(
      std::move(layer), /*values=*/false,
      [k = std::move(k), turn, head_bytes, row_bytes, d, dt](int h, DenseLayer* out) {
        const size_t begin = static_cast<size_t>(h) * head_bytes, end = begin + head_bytes;
        size_t at = 0;  // where the run starts in the concatenation
        for (const auto& run : k) {
          const size_t lo = std::max(begin, at), hi = std::min(end, at + run.size());
          if (lo < hi) {
            const uint8_t* src = run.data() + (lo - at);
            uint8_t* dst = out->k.data() + lo;
            if (turn) {
              RotateRows(*turn, dt, d, src, (hi - lo) / row_bytes, dst);
            } else {
              std::memcpy(dst, src, hi - lo);
            }
          }
          at += run.size();
          if (at >= end) break;
        }
      });
}

absl::StatusOr<DenseLayer> ExportKeysContiguous(const CompactLayerView& view,
                                                const DenseRuns& runs, const RopeParams& rope) {
  ASSIGN_OR_RETURN(DenseExporter exporter, MakeKeysContiguousExporter(view, runs, rope));
  return std::move(exporter).Finish();
}

absl::StatusOr<DenseExporter> MakeContiguousExporter(const CompactLayerView& view,
                                                     const RopeParams& rope, bool keys_only) {
  if (absl::Status s = ValidateRope(rope, view.head_dim()); !s.ok()) return s;
  for (int h = 1; h < view.num_kv_heads(); ++h) {
    if (view.desc(h).n_kept != view.desc(0).n_kept) {
      return absl::FailedPreconditionError(absl::StrCat(
          "layer ", view.header().layer_index, ": head ", h, " keeps ", view.desc(h).n_kept,
          " tokens but head 0 keeps ", view.desc(0).n_kept,
          " (head-adaptive budgets); a contiguous export needs the same count for every head, "
          "fetch FORMAT_DENSE (padded) or FORMAT_PACKED"));
    }
  }
  absl::StatusOr<DenseExporter> exporter = MakeDenseExporter(view, /*values=*/!keys_only);
  if (!exporter.ok()) return exporter.status();
  const DenseLayer& layer = *exporter->layer();
  const int heads = layer.num_kv_heads;
  const absl::optional<Turn> turn = MakeTurn(rope, layer.head_dim, layer.seq_len - layer.n_kept);
  if (turn) {
    // Each head's keys are turned as soon as they are written (RotateKeys, head by head).
    exporter->AddStep([turn = *turn, heads](int piece, DenseLayer* out) {
      if (piece < heads) TurnHeadKeys(turn, piece, out);
    });
  }
  return exporter;
}

absl::StatusOr<DenseLayer> ExportDenseContiguous(const CompactLayerView& view,
                                                 const RopeParams& rope) {
  ASSIGN_OR_RETURN(DenseExporter exporter,
                   MakeContiguousExporter(view, rope, /*keys_only=*/false));
  return std::move(exporter).Finish();
}

absl::StatusOr<DenseLayer> ExportDenseKeysContiguous(const CompactLayerView& view,
                                                     const RopeParams& rope) {
  ASSIGN_OR_RETURN(DenseExporter exporter,
                   MakeContiguousExporter(view, rope, /*keys_only=*/true));
  return std::move(exporter).Finish();
}

}  // namespace kvc

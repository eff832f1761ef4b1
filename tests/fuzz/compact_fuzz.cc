// Fuzzes the compact-blob reader (kvc/compact.h), the dense exports (kvc/contiguous_export.h) and
// packed attention (kvc/attention.h) with arbitrary blobs. Properties: Parse never reads out of
// bounds and rejects with INVALID_ARGUMENT; on a blob it accepts, every reader (UnpackHeadToFloat,
// ExportDense, the contiguous exports, PackedAttentionCpu) stays in bounds; ExportDense's rows are
// UnpackHeadToFloat's rounded to the blob's dtype (its fused dequantization against the rows
// path); the keys-only contiguous export equals the full one's keys; and packed attention agrees
// with plain attention over the unpacked keys and values.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "absl/types/span.h"
#include "kvc/attention.h"
#include "kvc/compact.h"
#include "kvc/contiguous_export.h"
#include "kvc/dtype.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "compact_fuzz: %s\n", what);
    std::abort();
  }
}

// Equal bytes, or both NaN (a NaN's payload may differ between paths).
bool SameElement(const uint8_t* a, const uint8_t* b, kvc::DType t, size_t i) {
  const size_t e = kvc::DTypeSize(t);
  if (std::memcmp(a + i * e, b + i * e, e) == 0) return true;
  return std::isnan(kvc::LoadAsFloat(a, t, i)) && std::isnan(kvc::LoadAsFloat(b, t, i));
}

// Whether `runs`, joined, are the `size` bytes at `bytes`.
bool RunsAre(const std::vector<absl::Span<const uint8_t>>& runs, const uint8_t* bytes,
             size_t size) {
  size_t at = 0;
  for (const auto& run : runs) {
    if (run.size() > size - at || std::memcmp(run.data(), bytes + at, run.size()) != 0) {
      return false;
    }
    at += run.size();
  }
  return at == size;
}

// The dense exports of an accepted blob: ExportDense against the unpacked floats, and for a blob
// whose heads keep the same count the contiguous exports under a RoPE taken from the input.
void CheckExports(const kvc::CompactLayerView& view, const std::vector<std::vector<float>>& keys,
                  const std::vector<std::vector<float>>& values, size_t size) {
  absl::StatusOr<kvc::DenseLayer> dense = kvc::ExportDense(view);
  if (!dense.ok()) return;  // refused (e.g. too large): nothing to compare
  const kvc::DType dt = dense->dtype;
  const int d = dense->head_dim;
  std::vector<uint8_t> want(static_cast<size_t>(d) * kvc::DTypeSize(dt));
  for (int h = 0; h < dense->num_kv_heads; ++h) {
    for (int j = 0; j < view.desc(h).n_kept; ++j) {
      const size_t row = static_cast<size_t>(h) * dense->n_kept + j;
      for (const bool k : {true, false}) {
        const std::vector<float>& src = k ? keys[h] : values[h];
        const uint8_t* got = (k ? dense->k : dense->v).data() + row * want.size();
        for (int c = 0; c < d; ++c) {
          kvc::StoreFromFloat(want.data(), dt, c, src[static_cast<size_t>(j) * d + c]);
          Check(SameElement(got, want.data(), dt, c), "ExportDense differs from the unpacked row");
        }
      }
    }
  }
  // The keys-only export and the value runs the server sends beside it (a key-pruned layer).
  absl::StatusOr<kvc::DenseLayer> keys_alone = kvc::ExportDenseKeys(view);
  Check(keys_alone.ok() && keys_alone->k.size() == dense->k.size(),
        "ExportDenseKeys differs from ExportDense's keys in size");
  Check(dense->k.empty() ||
            std::memcmp(keys_alone->k.data(), dense->k.data(), dense->k.size()) == 0,
        "ExportDenseKeys differs from ExportDense's keys");
  // The runs a server sends in place of an export (a ragged head's padding included): the
  // exported bytes, in order.
  const auto* pos = reinterpret_cast<const uint8_t*>(dense->positions.data());
  const size_t pos_bytes = dense->positions.size() * sizeof(int32_t);
  kvc::DenseRuns runs;
  if (kvc::DenseRunsOf(view, &runs)) {
    Check(RunsAre(runs.k, dense->k.data(), dense->k.size()), "DenseRunsOf's keys differ");
    Check(RunsAre(runs.v, dense->v.data(), dense->v.size()), "DenseRunsOf's values differ");
    Check(RunsAre(runs.positions, pos, pos_bytes), "DenseRunsOf's positions differ");
  }
  if (kvc::DenseValueRunsOf(view, &runs)) {
    Check(runs.k.empty(), "DenseValueRunsOf gave key runs");
    Check(RunsAre(runs.v, dense->v.data(), dense->v.size()), "DenseValueRunsOf's values differ");
    Check(RunsAre(runs.positions, pos, pos_bytes), "DenseValueRunsOf's positions differ");
  }
  kvc::RopeParams rope;
  rope.theta = 100.0 + static_cast<double>(size % 1000) * 10;
  rope.half_split = (size / 3) % 2 == 0;
  rope.rotary_dims = (size / 5) % 2 == 0 ? 0 : (d / 2) & ~1;
  absl::StatusOr<kvc::DenseLayer> full = kvc::ExportDenseContiguous(view, rope);
  if (!full.ok() || !kvc::DenseRunsOf(view, &runs)) return;
  absl::StatusOr<kvc::DenseLayer> turned = kvc::ExportKeysContiguous(view, runs, rope);
  Check(turned.ok(), "ExportKeysContiguous refused what ExportDenseContiguous took");
  Check(turned->k.size() == full->k.size(), "contiguous exports differ in size");
  for (size_t i = 0; i < full->k.size() / kvc::DTypeSize(dt); ++i) {
    Check(SameElement(turned->k.data(), full->k.data(), dt, i),
          "ExportKeysContiguous differs from ExportDenseContiguous's keys");
  }
}

// Deterministic small values in [-0.5, 0.5].
float Pattern(size_t i) { return static_cast<float>((i * 2654435761u) % 1001) / 1000.0f - 0.5f; }

// Plain decode attention over float keys/values [n, D] (the unpacked cache) followed by the new
// tokens, for one query row; the reference for PackedAttentionCpu.
void Reference(const float* q, const std::vector<float>& keys, const std::vector<float>& values,
               int n_cached, const float* k_new, const float* v_new, int n_visible_new, int d,
               float* out) {
  const int n = n_cached + n_visible_new;
  std::vector<double> score(n);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto key = [&](int t) {
    return t < n_cached ? &keys[size_t(t) * d] : &k_new[size_t(t - n_cached) * d];
  };
  auto value = [&](int t) {
    return t < n_cached ? &values[size_t(t) * d] : &v_new[size_t(t - n_cached) * d];
  };
  double mx = -INFINITY;
  for (int t = 0; t < n; ++t) {
    double s = 0;
    for (int c = 0; c < d; ++c) s += double(q[c]) * key(t)[c];
    score[t] = s * scale;
    mx = std::max(mx, score[t]);
  }
  double sum = 0;
  for (int t = 0; t < n; ++t) sum += (score[t] = std::exp(score[t] - mx));
  for (int c = 0; c < d; ++c) {
    double acc = 0;
    for (int t = 0; t < n; ++t) acc += score[t] * value(t)[c];
    out[c] = static_cast<float>(acc / sum);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // Parse requires 8-byte alignment; a vector's buffer has it.
  const std::vector<uint8_t> blob(data, data + size);
  absl::StatusOr<kvc::CompactLayerView> view = kvc::CompactLayerView::Parse(blob);
  if (!view.ok()) {
    Check(view.status().code() == absl::StatusCode::kInvalidArgument, "error is not INVALID_ARG");
    return 0;
  }
  const int heads = view->num_kv_heads(), d = view->head_dim();
  Check(heads >= 1 && d >= 1, "accepted a blob without heads or channels");

  // Every head unpacked; the values feed the reference below.
  std::vector<std::vector<float>> keys(heads), values(heads);
  bool small = true;  // all finite and moderate, so the reference comparison is meaningful
  for (int h = 0; h < heads; ++h) {
    const size_t n = static_cast<size_t>(view->desc(h).n_kept) * d;
    keys[h].resize(n);
    values[h].resize(n);
    kvc::UnpackHeadToFloat(*view, h, keys[h].data(), values[h].data());
    for (size_t i = 0; i < n; ++i) {
      small = small && std::fabs(keys[h][i]) <= 16 && std::fabs(values[h][i]) <= 16;
    }
  }
  CheckExports(*view, keys, values, size);

  // One or two query heads per KV head, one or two queries, as many new tokens plus one.
  const int group = 1 + static_cast<int>(size % 2);
  const int n_q = 1 + static_cast<int>((size / 2) % 2);
  const int n_new = n_q + 1;
  kvc::DecodeQuery query;
  query.num_q_heads = heads * group;
  query.n_q = n_q;
  query.n_new = n_new;
  std::vector<float> q(size_t(query.num_q_heads) * n_q * d), k_new(size_t(heads) * n_new * d),
      v_new(k_new.size()), out(q.size(), NAN);
  for (size_t i = 0; i < q.size(); ++i) q[i] = Pattern(i);
  for (size_t i = 0; i < k_new.size(); ++i) k_new[i] = Pattern(i + 7), v_new[i] = Pattern(i + 13);
  query.q = q.data();
  query.k_new = k_new.data();
  query.v_new = v_new.data();
  // The default (kAuto: integer dot products on 2- and 4-bit heads of >= 32 channels) must take
  // every parsed blob and stay in bounds; its error against the float reference is a fraction of
  // the codes' own (tests/kernels/attention_int_test.cc holds that bound), so the comparison
  // below is made with the fp32 kernels.
  Check(kvc::PackedAttentionCpu(*view, query, out.data()).ok(),
        "packed attention refused a parsed blob");
  kvc::PackedAttentionOptions exact;
  exact.math = kvc::PackedAttentionOptions::Math::kExact;
  Check(kvc::PackedAttentionCpu(*view, query, out.data(), nullptr, exact).ok(),
        "exact packed attention refused a parsed blob");
  if (!small) return 0;
  std::vector<float> ref(d);
  for (int qh = 0; qh < query.num_q_heads; ++qh) {
    const int h = qh / group;
    for (int i = 0; i < n_q; ++i) {
      const size_t row = (size_t(qh) * n_q + i) * d;
      Reference(&q[row], keys[h], values[h], view->desc(h).n_kept, &k_new[size_t(h) * n_new * d],
                &v_new[size_t(h) * n_new * d], n_new - n_q + i + 1, d, ref.data());
      for (int c = 0; c < d; ++c) {
        Check(std::fabs(out[row + c] - ref[c]) <= 1e-2f * (1 + std::fabs(ref[c])),
              "packed attention differs from attention over the unpacked cache");
      }
    }
  }
  return 0;
}

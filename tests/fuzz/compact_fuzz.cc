// Fuzzes the compact-blob reader (kvc/compact.h) and packed attention (kvc/attention.h) with
// arbitrary blobs. Properties: Parse never reads out of bounds and rejects with INVALID_ARGUMENT;
// on a blob it accepts, every reader (UnpackHeadToFloat, ExportDense, PackedAttentionCpu) stays in
// bounds, and packed attention agrees with plain attention over the unpacked keys and values.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "absl/types/span.h"
#include "kvc/attention.h"
#include "kvc/compact.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "compact_fuzz: %s\n", what);
    std::abort();
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
  (void)kvc::ExportDense(*view);  // pads heads of different lengths; must stay in bounds

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
  const absl::Status st = kvc::PackedAttentionCpu(*view, query, out.data());
  Check(st.ok(), "packed attention refused a parsed blob");
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

#include "server/contiguous.h"

#include "absl/strings/str_cat.h"
#include "kvc/compact.h"
#include "kvc/spec.h"

namespace kvc::server {

namespace pb = kvcache::v1;

absl::Status CheckUniformKept(const pb::CacheInfo& info, const CacheEntry& entry) {
  if (info.compression().eviction().adaptive()) {
    // Head-adaptive budgets may still give every head the same count (adaptive_floor = 1 always
    // does): only the stored counts tell. A blob that does not parse is reported (DATA_LOSS) when
    // its layer is exported.
    for (size_t l = 0; l < entry.layers.size(); ++l) {
      absl::StatusOr<CompactLayerView> view = CompactLayerView::Parse(entry.layers[l]);
      if (!view.ok()) continue;
      for (int h = 1; h < view->num_kv_heads(); ++h) {
        if (view->head(h).n_kept != view->head(0).n_kept) {
          return absl::FailedPreconditionError(absl::StrCat(
              "FORMAT_DENSE_CONTIGUOUS: the cache was stored with head-adaptive budgets and its KV "
              "heads keep different counts (layer ",
              l, ": head ", h, " keeps ", view->head(h).n_kept, ", head 0 keeps ",
              view->head(0).n_kept,
              "); a stock engine needs one count for every head (fetch FORMAT_DENSE, padded with "
              "position -1, or FORMAT_PACKED)"));
        }
      }
    }
  }
  for (int l = 1; l < info.kept_tokens_size(); ++l) {
    if (info.kept_tokens(l) != info.kept_tokens(0)) {
      return absl::FailedPreconditionError(
          absl::StrCat("FORMAT_DENSE_CONTIGUOUS: layer ", l, " keeps ", info.kept_tokens(l),
                       " tokens per KV head but layer 0 keeps ", info.kept_tokens(0),
                       "; a stock engine needs one count for every layer (no layer_budgets)"));
    }
  }
  return absl::OkStatus();
}

}  // namespace kvc::server

#include "server/contiguous.h"

#include "absl/strings/str_cat.h"

namespace kvc::server {

namespace pb = kvcache::v1;

absl::Status CheckUniformKept(const pb::CacheInfo& info) {
  if (info.compression().eviction().adaptive()) {
    return absl::FailedPreconditionError(
        "FORMAT_DENSE_CONTIGUOUS: the cache was stored with head-adaptive budgets, so its KV "
        "heads keep different counts; a stock engine needs one count for every head (fetch "
        "FORMAT_DENSE, padded with position -1, or FORMAT_PACKED)");
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
